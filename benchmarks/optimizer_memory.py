"""Optimizer memory per parameter, from the compiled train step's memory analysis.

  PYTHONPATH=. python benchmarks/optimizer_memory.py [--preset gpt2-small] [--csv OUT.csv]
  PYTHONPATH=. python benchmarks/optimizer_memory.py --quick     # tiny model (CPU smoke run)

For every optimizer the full training step (collector scan, optimizer update, skip guard,
metrics; ``scaleopt.train``) is compiled, not run, with the state donated, on a batch so small
(2 microbatches of 1 x 16 tokens) that activations are negligible next to the parameters.
``jax.jit(step).lower(state, batch).compile().memory_analysis()`` gives, per device:

  state       optimizer-state bytes (the ``opt_state`` leaves; exact, from their shapes)
  temp        the step's temporary buffers: the collector's per-step statistics (gradient
              sums, Welford pairs, A/B groups, Shampoo factor statistics), the update's
              intermediates, and the (tiny) activations
  peak        arguments + outputs - aliased (donated) + temp: parameters, state and
              everything the step allocates at once

all divided by the parameter count N (bytes per parameter; float32 parameters are 4 of them).
Baseline in the same run: optax.adamw through the same system (the ``adamw`` row).
"""

from __future__ import annotations

import argparse
import csv
import sys

import jax
import jax.numpy as jnp
import numpy as np

from scaleopt import models
from scaleopt.train import config as C
from scaleopt.train import loop

BC = {"name": "adamw_bc"}
OPTIMIZERS = [
    ("adamw", {"name": "adamw"}),
    ("adamw_bc std (all)", dict(BC, extra={"mode": "std"})),
    ("adamw_bc inv (all, Welford)", dict(BC, extra={"mode": "inv"})),
    ("adamw_bc full, A/B", dict(BC, extra={"mode": "full", "crossfit": "ab"})),
    ("adamw_bc full, rolling-B", dict(BC, extra={"mode": "full", "crossfit": "rolling_b"})),
    ("adamw_bc full, symmetric", dict(BC, extra={"mode": "full", "crossfit": "symmetric"})),
    ("adamw_bc full, LOO", dict(BC, extra={"mode": "full", "crossfit": "loo"})),
    ("sophia (GNB)", {"name": "sophia"}),
    ("shampoo, block 512", {"name": "shampoo", "extra": {"block_size": 512}}),
    ("shampoo, block 1024", {"name": "shampoo", "extra": {"block_size": 1024}}),
    ("muon", {"name": "muon"}),
]


def _bytes(tree) -> int:
  return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def measure(preset: str, opt: dict, seq: int, dtype: str) -> dict:
  raw = {"run": {"steps": 1, "progress": False, "plot": False, "tensorboard": False},
         "model": {"preset": preset, "dtype": dtype, "max_seq_len": seq},
         "data": {"source": "embedded", "seq_len": seq, "batch_size": 2, "microbatches": 2},
         "optimizer": opt, "mesh": {"data": 1}}
  s = loop.setup(C.from_dict(raw))
  fns = loop.compile_fns(s)
  st = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                    fns.state_shape, fns.state_sh)
  groups = s.spec.num_groups
  shape = (2 * groups, 1, seq + 1)
  batch = {"tokens": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=fns.batch_sh)}
  if s.spec.layout == "rolling_b":
    batch["b_tokens"] = batch["tokens"]
  ma = fns.train_step.lower(st, batch).compile().memory_analysis()
  n = models.count_params(s.model.cfg)
  peak = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
          + ma.temp_size_in_bytes)
  return dict(params=n, state=_bytes(fns.state_shape.opt_state) / n,
              temp=ma.temp_size_in_bytes / n, peak=peak / n,
              args=ma.argument_size_in_bytes / n, layout=s.spec.layout)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="tiny model (CPU smoke run)")
  ap.add_argument("--preset", default="gpt2-small")
  ap.add_argument("--only", help="comma-separated row numbers (0-based) to measure")
  ap.add_argument("--csv")
  args = ap.parse_args(argv)
  preset, seq, dtype = args.preset, 16, "bfloat16"
  if args.quick:
    preset, dtype = "tiny", "float32"
  dev = jax.devices()[0]
  print(f"# device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, preset {preset}",
        flush=True)
  rows = []
  todo = [OPTIMIZERS[int(i)] for i in args.only.split(",")] if args.only else OPTIMIZERS
  for name, opt in todo:
    try:
      r = dict(optimizer=name, **measure(preset, opt, seq, dtype))
    except Exception as e:  # pylint: disable=broad-except
      r = dict(optimizer=name, error=f"{type(e).__name__}: {str(e)[:200]}")
    rows.append(r)
    print(f"# {r}", flush=True)
  print(f"\n{rows[0].get('params', 0) / 1e6:.1f}M parameters (float32: 4 bytes each)\n")
  print("| optimizer | collector layout | state bytes/param | step temp bytes/param | "
        "peak bytes/param | peak vs adamw |")
  print("|---|---|---|---|---|---|")
  base = next((r["peak"] for r in rows if r["optimizer"] == "adamw" and "peak" in r), None)
  for r in rows:
    if "error" in r:
      print(f"| {r['optimizer']} | - | {r['error']} | - | - | - |")
      continue
    rel = f"{r['peak'] / base:.2f}x" if base else "-"
    print(f"| {r['optimizer']} | {r['layout']} | {r['state']:.2f} | {r['temp']:.2f} | "
          f"{r['peak']:.2f} | {rel} |")
  if args.csv:
    keys = sorted({k for r in rows for k in r})
    with open(args.csv, "w", newline="") as f:
      w = csv.DictWriter(f, fieldnames=keys)
      w.writeheader()
      w.writerows(rows)
  return 0


if __name__ == "__main__":
  sys.exit(main())
