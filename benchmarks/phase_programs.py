"""A train step with device branches against one compiled program per branch outcome.

  PYTHONPATH=. python benchmarks/phase_programs.py [--config data1+b32+m1+optshampoo]
      [--steps 30] [--modes cond,phased,plain,phased_sync1,cond_sync1]

For one configuration (``mesh_throughput.py``'s syntax) the trainer's step is compiled as one
program with device branches (``cond``, ``run.host_phases: off``) and as one program per
outcome of its every-N work (``phased``: what the trainer runs on GPUs); each mode runs
``--steps`` steps on one device batch and prints ms per step (wall), ms per step inside the
dispatch call, and the device's memory in use and peak (GiB) after the mode:

* ``cond``: the one program, nothing read back;
* ``phased``: the program of each step's outcomes (``phased.Dispatcher``), compiled ahead one
  after another as the trainer does, nothing read back; ``jit``: each compiled at its first
  call (in the warm-up);
* ``plain``: only the program without the periodic work (every step a non-root step);
* ``*_sync1``: as the mode, reading each step's skip counter one step later.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import mesh_throughput as mt  # noqa: E402
from scaleopt.train import data as D, loop, mesh as mesh_lib, phased as phased_lib  # noqa: E402

DEFAULTS = dict(preset="gpt2-small", batch=32, seq=1024, micro=1, unroll=0, steps=100,
                dtype="bfloat16", platform="gpu")


def _memory() -> str:
  st = jax.devices()[0].memory_stats() or {}
  g = 2 ** 30
  return (f"in use {st.get('bytes_in_use', 0) / g:.1f} GiB, peak "
          f"{st.get('peak_bytes_in_use', 0) / g:.1f} GiB")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--config", default="data1+b32+m1+optshampoo")
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--modes", default="cond,phased,plain,phased_sync1,cond_sync1,jit")
  a = ap.parse_args(argv)
  c = mt.parse(a.config + "+rhost_phases=on", DEFAULTS)
  s = loop.setup(mt.train_config(c))
  fns = loop.compile_fns(s)
  d = s.cfg.data
  it = D.Batches(s.train_w, d.batch_size, d.microbatches, groups=s.spec.num_groups, seed=0)
  batch = {k: mesh_lib.put_global(fns.batch_sh, v, loop.batch_shape(s)) for k, v in it.next().items()}
  ph = fns.phased
  print(f"# {a.config} on {jax.device_count()} x {jax.devices()[0].device_kind}; "
        f"schedules {ph.schedules if ph else None}; jax {jax.__version__}", flush=True)
  st = fns.init()
  for mode in a.modes.split(","):
    base = mode.removesuffix("_sync1")
    if base == "cond":
      run = fns.train_step
    elif base in ("phased", "jit"):
      step0 = int(jax.device_get(st.step))
      ph = loop.compile_fns(s).phased  # fresh programs
      if base == "jit":  # each program compiled at its first call, in the warm-up below
        for k in ph.keys_ahead(step0, step0, step0 + ph.period):
          st, m = ph(k, st, batch)
      else:  # as the trainer does: compiled ahead
        ph.compile(ph.keys_ahead(step0, step0, step0 + ph.period), *mt.step_inputs(s, fns))
      run = phased_lib.Dispatcher(ph, int(jax.device_get(st.step)),
                                  int(jax.device_get(st.step - st.skipped)))
    else:
      off = tuple(False for _ in ph.schedules)
      run = lambda state, b, off=off: ph(off, state, b)
    for _ in range(2):  # compile / warm up
      st, m = run(st, batch)
    jax.block_until_ready(m["loss"])
    t0, prev, host = time.perf_counter(), None, 0.0
    for _ in range(a.steps):
      h0 = time.perf_counter()
      st, m = run(st, batch)
      host += time.perf_counter() - h0
      if mode.endswith("_sync1") and prev is not None:
        int(prev)
      prev = m["consec"]
    jax.block_until_ready(m["loss"])
    ms = 1e3 * (time.perf_counter() - t0) / a.steps
    print(f"{mode:14s} {ms:7.2f} ms/step, {1e3 * host / a.steps:7.2f} ms in dispatch; "
          f"{_memory()}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
