"""Optimizer memory per parameter, from the compiled train step's memory analysis.

  PYTHONPATH=. python benchmarks/optimizer_memory.py [--preset gpt2-small] [--csv OUT.csv]
  PYTHONPATH=. python benchmarks/optimizer_memory.py --quick     # tiny model (CPU smoke run)
  PYTHONPATH=. python benchmarks/optimizer_memory.py --devices 4 [--state-only]

``--devices N`` (in a process that sees N devices; one-device rows need a one-device process
and are skipped there) measures rows on an N-device mesh (``fsdpN``, ``dataN``: AdamW and Shampoo with its
block factors split over the devices; ``dataN+shard``: the same with ``mesh.shard_optimizer``,
the state split over data too); every figure is then per device, divided by the full
parameter count N_params (bytes per parameter per device). On CPU, simulate the devices with
XLA_FLAGS=--xla_force_host_platform_device_count=N. ``--state-only`` skips compiling: the
state column is exact from the state's shardings (shard shapes), temp and peak are left out.

For every optimizer the full training step (collector scan, optimizer update, skip guard,
metrics; ``scaleopt.train``) is compiled, not run, with the state donated, on a batch so small
(4 microbatches of 1 x 16 tokens per device) that activations are negligible next to the
parameters.
``jax.jit(step).lower(state, batch).compile().memory_analysis()`` gives, per device:

  state       optimizer-state bytes in device memory (the ``opt_state`` leaves; exact, from
              their shapes)
  host        optimizer-state bytes kept in host memory between steps (Shampoo's
              ``offload_statistics``: L and R), from their shapes; on GPU also the compiled
              step's host argument bytes (``host args``), which must agree
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
BF16 = {"mu_dtype": "bfloat16"}
OPTIMIZERS = [
    ("adamw", {"name": "adamw"}),
    ("adamw, bf16 first moment", {"name": "adamw", "extra": BF16}),
    ("adamw_bc std (all)", dict(BC, extra={"mode": "std"})),
    ("adamw_bc inv (all, Welford)", dict(BC, extra={"mode": "inv"})),
    ("adamw_bc full, A/B", dict(BC, extra={"mode": "full", "crossfit": "ab"})),
    ("adamw_bc full, rolling-B", dict(BC, extra={"mode": "full", "crossfit": "rolling_b"})),
    ("adamw_bc full, symmetric", dict(BC, extra={"mode": "full", "crossfit": "symmetric"})),
    ("adamw_bc full, LOO", dict(BC, extra={"mode": "full", "crossfit": "loo"})),
    ("adamw_bc full, LOO, bf16 first moment",
     dict(BC, extra={"mode": "full", "crossfit": "loo", **BF16})),
    ("sophia (GNB)", {"name": "sophia"}),
    ("sophia (GNB), bf16 first moment", {"name": "sophia", "extra": BF16}),
    ("shampoo, block 512", {"name": "shampoo", "extra": {"block_size": 512}}),
    ("shampoo, block 1024", {"name": "shampoo", "extra": {"block_size": 1024}}),
    ("shampoo, block 1024, bf16 first moment",
     {"name": "shampoo", "extra": {"block_size": 1024, **BF16}}),
    ("shampoo, block 1024, no grafting",
     {"name": "shampoo", "extra": {"block_size": 1024, "graft": "none"}}),
    ("shampoo, block 512, statistics in host memory",
     {"name": "shampoo", "extra": {"offload_statistics": True}}),
    ("shampoo, block 1024, statistics in host memory",
     {"name": "shampoo", "extra": {"block_size": 1024, "offload_statistics": True}}),
    ("muon", {"name": "muon"}),
]
SHAMPOO = {"name": "shampoo", "extra": {"block_size": 1024}}
# (name, optimizer, mesh axis, mesh.shard_optimizer) rows added by --devices N
MESH_ROWS = [
    ("adamw", {"name": "adamw"}, "fsdp", False),
    ("shampoo, block 1024", SHAMPOO, "fsdp", False),
    ("adamw", {"name": "adamw"}, "data", False),
    ("shampoo, block 1024", SHAMPOO, "data", False),
    ("adamw", {"name": "adamw"}, "data", True),
    ("shampoo, block 1024", SHAMPOO, "data", True),
]


def _bytes(tree) -> int:
  return int(sum(np.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def _device_bytes(tree, shardings, memory: str = "device") -> int:
  """Bytes one device holds of ``tree`` (leaves of ShapeDtypeStruct) under ``shardings`` in
  ``memory`` (``device``: device memory; ``pinned_host``: host memory)."""
  kind = lambda sh: "pinned_host" if sh.memory_kind == "pinned_host" else "device"
  return int(sum(np.prod(sh.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
                 for x, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings))
                 if kind(sh) == memory))


def measure(preset: str, opt: dict, seq: int, dtype: str, mesh: dict = None,
            state_only: bool = False, shard_optimizer: bool = False) -> dict:
  mesh = mesh or {"data": 1}
  n_dev = int(np.prod(list(mesh.values())))
  raw = {"run": {"steps": 1, "progress": False, "plot": False, "tensorboard": False},
         "model": {"preset": preset, "dtype": dtype, "max_seq_len": seq},
         "data": {"source": "embedded", "seq_len": seq, "batch_size": 4 * n_dev,
                  "microbatches": 4},
         "optimizer": opt, "mesh": dict({"data": 1, "fsdp": 1, "tensor": 1}, **mesh,
                                        shard_optimizer=shard_optimizer)}
  s = loop.setup(C.from_dict(raw))
  fns = loop.compile_fns(s)
  n = models.count_params(s.model.cfg)
  state = _device_bytes(fns.state_shape.opt_state, fns.state_sh.opt_state) / n
  host = _device_bytes(fns.state_shape.opt_state, fns.state_sh.opt_state, "pinned_host") / n
  label = "x".join(f"{k}{v}" for k, v in mesh.items()) + ("+shard" if shard_optimizer else "")
  base = dict(params=n, devices=n_dev, mesh=label,
              state=state, host=host, layout=s.spec.layout)
  if state_only:
    return base
  st = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                    fns.state_shape, fns.state_sh)
  groups = s.spec.num_groups
  shape = (4 * groups, n_dev, seq + 1)
  batch = {"tokens": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=fns.batch_sh)}
  if s.spec.layout == "rolling_b":
    batch["b_tokens"] = batch["tokens"]
  ma = fns.train_step.lower(st, batch).compile().memory_analysis()
  peak = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
          + ma.temp_size_in_bytes)
  return dict(base, temp=ma.temp_size_in_bytes / n, peak=peak / n,
              args=ma.argument_size_in_bytes / n,
              host_args=getattr(ma, "host_argument_size_in_bytes", 0) / n)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="tiny model (CPU smoke run)")
  ap.add_argument("--preset", default="gpt2-small")
  ap.add_argument("--only", help="comma-separated row numbers (0-based) to measure")
  ap.add_argument("--devices", type=int, default=0,
                  help="also measure AdamW and Shampoo on fsdpN and dataN meshes")
  ap.add_argument("--state-only", action="store_true",
                  help="state bytes from the shardings only (no compile)")
  ap.add_argument("--csv")
  args = ap.parse_args(argv)
  preset, seq, dtype = args.preset, 16, "bfloat16"
  if args.quick:
    preset, dtype = "tiny", "float32"
  dev = jax.devices()[0]
  print(f"# device: {dev.device_kind} ({dev.platform}) x {jax.device_count()}, jax "
        f"{jax.__version__}, preset {preset}", flush=True)
  if args.devices > jax.device_count():
    print(f"--devices {args.devices}: only {jax.device_count()} devices", file=sys.stderr)
    return 2
  todo = [OPTIMIZERS[int(i)] for i in args.only.split(",")] if args.only else OPTIMIZERS
  # one-device rows need a one-device process (the mesh takes every visible device)
  todo = [(name, opt, None, False) for name, opt in todo] if jax.device_count() == 1 else []
  if args.devices > 1:
    todo += [(name, opt, {axis: args.devices}, shard) for name, opt, axis, shard in MESH_ROWS]
  rows = []
  for name, opt, mesh, shard in todo:
    try:
      r = dict(optimizer=name, **measure(preset, opt, seq, dtype, mesh, args.state_only, shard))
    except Exception as e:  # pylint: disable=broad-except
      r = dict(optimizer=name, mesh=str(mesh), error=f"{type(e).__name__}: {str(e)[:200]}")
    rows.append(r)
    print(f"# {r}", flush=True)
    if args.csv:  # after every row: a run cut short by a timeout keeps what it measured
      _write_csv(args.csv, rows)
  if not rows:
    print("no rows: one-device rows need one visible device, mesh rows --devices N")
    return 2
  print(f"\n{rows[0].get('params', 0) / 1e6:.1f}M parameters (float32: 4 bytes each); "
        "bytes per parameter per device\n")
  print(table(rows))
  return 0


def _write_csv(path: str, rows: list) -> None:
  keys = sorted({k for r in rows for k in r})
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=keys)
    w.writeheader()
    w.writerows(rows)


def table(rows: list) -> str:
  """Markdown table; "vs adamw" divides by the adamw row on the same mesh."""
  out = ["| optimizer | mesh | collector layout | state bytes/param/device | state in host "
         "memory | host args (compiled) | step temp bytes/param/device | peak bytes/param/device "
         "| peak vs adamw |",
         "|---|---|---|---|---|---|---|---|---|"]
  base = {r["mesh"]: r.get("peak") for r in rows if r["optimizer"] == "adamw" and "state" in r}
  for r in rows:
    if "error" in r:
      out.append(f"| {r['optimizer']} | {r.get('mesh', '-')} | - | {r['error']} | - | - | - | - "
                 "| - |")
      continue
    fmt = lambda k: f"{r[k]:.2f}" if k in r else "-"
    b = base.get(r["mesh"])
    rel = f"{r['peak'] / b:.2f}x" if b and "peak" in r else "-"
    out.append(f"| {r['optimizer']} | {r['mesh']} | {r['layout']} | {fmt('state')} | "
               f"{fmt('host')} | {fmt('host_args')} | {fmt('temp')} | {fmt('peak')} | {rel} |")
  return "\n".join(out)


if __name__ == "__main__":
  sys.exit(main())
