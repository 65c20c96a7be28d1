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

In the ``*_async`` modes a dispatch also waits once the runtime holds as many launched steps
as it queues; in the ``*_sync1`` modes (at most two steps in flight) a ``_hostms`` close to
the step time means the dispatch itself waited for the device: a step holding ``lax.cond`` /
``while_loop`` on GPU (``run.host_phases: off``; the trainer's default on GPUs picks programs
without them, ``benchmarks/phase_programs.py``).
"""
import pathlib
import sys
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import mesh_throughput as mt  # noqa: E402
from scaleopt.train import data as D, loop, mesh as mesh_lib  # noqa: E402

MODES = ("fixed_async", "fresh_async", "fixed_sync1", "fresh_sync1", "fresh_sync1_host")
DEFAULTS = dict(preset="gpt2-small", batch=64, seq=1024, micro=1, unroll=0, steps=100,
                dtype="bfloat16", platform="gpu")


def probe(name: str, n: int = 20) -> None:
  """Times ``n`` steps of configuration ``name`` (``mesh_throughput.py``'s syntax) per mode."""
  s = loop.setup(mt.train_config(mt.parse(name, DEFAULTS)))
  fns = loop.compile_fns(s)
  d = s.cfg.data
  it = D.Batches(s.train_w, d.batch_size, d.microbatches, groups=s.spec.num_groups, seed=0)
  shape = (d.microbatches * s.spec.num_groups, d.batch_size // d.microbatches, d.seq_len + 1)
  put = lambda b: {k: mesh_lib.put_global(fns.batch_sh, v, shape) for k, v in b.items()}
  fixed = put(it.next())
  st = fns.init()
  for _ in range(3):
    st, m = fns.train_step(st, fixed)
  jax.block_until_ready(m["loss"])
  out = {}
  for mode in MODES:
    t0, prev, host = time.perf_counter(), None, 0.0
    for _ in range(n):
      h0 = time.perf_counter()
      st, m = fns.train_step(st, put(it.next()) if "fresh" in mode else fixed)
      host += time.perf_counter() - h0
      if "sync1" in mode and prev is not None:
        int(prev)
      prev = m["consec"]
    jax.block_until_ready(m["loss"])
    out[mode] = 1e3 * (time.perf_counter() - t0) / n
    out[mode + "_hostms"] = 1e3 * host / n
  print(name, {k: round(v, 2) for k, v in out.items()}, flush=True)


if __name__ == "__main__":
  A = "fsdp4+b64+m1"
  for name in (A, A + "+optshampoo+eblock_shards=fsdp+eroot_every=1000", A):
    probe(name)
