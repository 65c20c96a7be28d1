"""What the host side of a training loop costs a train step (gpt2-small, 64 x 1024 tokens, FSDP
over 4 GPUs; AdamW, then Shampoo without root steps, then AdamW again).

  PYTHONPATH=. python benchmarks/host_loop.py

For each optimizer the trainer's jitted step (``scaleopt.train.loop``) runs 20 steps in five
host loops and prints ms per step (wall) and ms per step spent inside the dispatch call and
the batch put (``_hostms``):

* ``fixed_async``: one device batch reused, nothing read back (the device's own pace);
* ``fresh_async``: a new batch every step (``it.next()`` and the host-to-device put);
* ``fixed_sync1`` / ``fresh_sync1``: as above, reading each step's skip counter one step
  later (the loop's former stop rule);
* ``fresh_sync1_host``: the same, timed separately once more.

A ``_hostms`` close to the step time means the dispatch itself waited for the device: a step
holding ``lax.cond`` / ``while_loop`` on GPU.
"""
import time

import jax
import numpy as np

from scaleopt.train import config as C, data as D, loop


def raw(opt):
  return {"run": {"steps": 100, "log_every": 10, "eval_every": 0, "eval_batches": 0,
                  "checkpoint_every": 0, "progress": False, "plot": False, "tensorboard": False},
          "model": {"preset": "gpt2-small", "dtype": "bfloat16", "scan_unroll": 0},
          "data": {"source": "embedded", "seq_len": 1024, "batch_size": 64, "microbatches": 1},
          "optimizer": opt, "mesh": {"data": 1, "fsdp": 4}}


def probe(opt, n=20):
  s = loop.setup(C.from_dict(raw(opt))); fns = loop.compile_fns(s)
  it = D.Batches(s.train_w, 64, 1, groups=1, seed=0)
  shape = (1, 64, 1025)
  fixed = {k: loop._put(fns.batch_sh, v, shape) for k, v in it.next().items()}
  st = fns.init()
  for _ in range(3):
    st, m = fns.train_step(st, fixed)
  jax.block_until_ready(m["loss"])
  out = {}
  for mode in ("fixed_async", "fresh_async", "fixed_sync1", "fresh_sync1", "fresh_sync1_host"):
    t0 = time.perf_counter(); prev = None; host = 0.0
    for _ in range(n):
      h0 = time.perf_counter()
      b = {k: loop._put(fns.batch_sh, v, shape) for k, v in it.next().items()} if "fresh" in mode else fixed
      st, m = fns.train_step(st, b)
      host += time.perf_counter() - h0
      if "sync1" in mode and prev is not None:
        int(prev)
      prev = m["consec"]
    jax.block_until_ready(m["loss"])
    out[mode] = 1e3 * (time.perf_counter() - t0) / n
    out[mode + "_hostms"] = 1e3 * host / n
  print(opt["name"], opt.get("extra"), {k: round(v, 2) for k, v in out.items()}, flush=True)


if __name__ == "__main__":
  probe({"name": "adamw", "learning_rate": 6e-4})
  probe({"name": "shampoo", "learning_rate": 6e-4, "extra": {"block_shards": "fsdp", "root_every": 1000}})
  probe({"name": "adamw", "learning_rate": 6e-4})
