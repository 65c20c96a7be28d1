"""Memory and speed of leave-one-out statistics at many microbatches, against AdamW.

Each row compiles one jitted training step (donated parameters and optimizer state) of a
plain-JAX GPT-style decoder (``collector_overhead.py``'s model: bf16 compute, float32
parameters) over m microbatches, parameters and optimizer state FSDP-sharded over all devices
(the largest axis of each leaf divisible by the device count), microbatch rows split over
the devices:

* ``adamw``: ``optax.adamw`` after a ``lax.scan`` gradient accumulation (the baseline);
* ``loo 2-pass``: ``adamw_bc`` LOO, ``loo_passes=2`` (memory independent of m);
* ``loo 1-pass f32``: one pass, the m microbatch gradients stored in float32 (the default);
* ``loo 1-pass bf16``: one pass, stored in bfloat16 (``loo_storage="bfloat16"``).

Columns: per-device bytes of the compiled step (arguments + outputs + temporaries, donated
outputs counted once; ``memory_analysis()`` reports one device's share), of which the
temporaries, median ms per step, tokens/s and the step time over AdamW's of the same run.
A form whose step would not fit (``--budget_gb``) is reported and not run.

    python benchmarks/loo_memory.py --quick                 # CPU, seconds
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python benchmarks/loo_memory.py --quick
    python benchmarks/loo_memory.py --model gpt2-small      # GPU(s): 512 x 1024 as 64 x 8
    python benchmarks/loo_memory.py --model qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collector_overhead import bc_step, baseline_step, init_params, make_loss  # noqa: E402

import scaleopt.optim as so  # noqa: E402


def timed(step, params, opt_state, mbs, iters):
  """(median s/step, per-device GB of the compiled step, of which temporaries), one compile."""
  f = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, mbs).compile()
  ma = f.memory_analysis()
  gb = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
        + ma.temp_size_in_bytes) / 1e9
  times = []
  for i in range(iters + 1):  # the first call warms up
    t0 = time.perf_counter()
    params, opt_state, loss = f(params, opt_state, mbs)
    loss.block_until_ready()
    times.append(time.perf_counter() - t0)
  return float(np.median(times[1:])), gb, ma.temp_size_in_bytes / 1e9

# vocab, d, layers, ff, heads (plain-JAX stand-ins with the named models' parameter counts)
MODELS = {
    "quick": (256, 32, 1, 128, 2),
    "gpt2-small": (50304, 768, 12, 3072, 12),
    "qwen2.5-0.5b": (151936, 896, 24, 6528, 14),  # 494M parameters
}
FORMS = {  # name: collector options (None: the AdamW baseline)
    "adamw": None,
    "loo 2-pass": dict(loo_passes=2),
    "loo 1-pass f32": dict(loo_passes=1),
    "loo 1-pass bf16": dict(loo_passes=1, loo_storage="bfloat16"),
}


def fsdp(mesh: Mesh, x) -> NamedSharding:
  """The largest axis divisible by the device count on the mesh axis (replicated if none)."""
  n = mesh.devices.size
  axes = [i for i in np.argsort(x.shape)[::-1] if x.shape[i] % n == 0 and x.shape[i] >= n]
  spec = [None] * x.ndim
  if axes and n > 1:
    spec[axes[0]] = "fsdp"
  return NamedSharding(mesh, P(*spec))


def stored_bytes(params, m: int, dtype_bytes: int, n_dev: int) -> float:
  """m x params x bytes, one device's share when the stored gradients shard like params."""
  return m * sum(x.size for x in jax.tree.leaves(params)) * dtype_bytes / n_dev


def run_form(name, loss_fn, params, mbs, mesh, iters, budget):
  opts = FORMS[name]
  if opts is None:
    tx = optax.adamw(6e-4, b1=0.9, b2=0.95, weight_decay=0.1)
    step = baseline_step(loss_fn, tx)
  else:
    tx = optax.chain(so.clip_by_global_norm(1.0), so.collector_options(**opts),
                     so.adamw_bc(6e-4, b1=0.9, b2=0.95))
    step = bc_step(loss_fn, tx)
  shard = lambda t: jax.tree.map(lambda x: jax.device_put(jnp.array(x, copy=True), fsdp(mesh, x)), t)
  p = shard(params)
  st = shard(jax.jit(tx.init)(p))
  need = None
  if opts is not None and opts.get("loo_passes") == 1:
    need = stored_bytes(params, mbs.shape[0], 2 if opts.get("loo_storage") else 4,
                        mesh.devices.size) / 1e9
    if budget and need > budget:
      return dict(form=name, gb=float("nan"), temp_gb=need, ms=float("nan"), note="no fit")
  t, gb, temp = timed(step, p, st, mbs, iters)
  return dict(form=name, gb=gb, temp_gb=temp, ms=1e3 * t, note="")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--model", default="gpt2-small", choices=sorted(MODELS))
  ap.add_argument("--quick", action="store_true", help="CPU: tiny model, 8 x 16 tokens as 4 microbatches")
  ap.add_argument("--batch", type=int, default=512, help="sequences per step")
  ap.add_argument("--seq", type=int, default=1024)
  ap.add_argument("--microbatches", type=int, default=64)
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--forms", default=",".join(FORMS))
  ap.add_argument("--budget_gb", type=float, default=0.0,
                  help="skip one-pass forms whose stored gradients exceed this per device")
  a = ap.parse_args(argv)
  if a.quick:
    a.model, a.batch, a.seq, a.microbatches, a.iters = "quick", 8, 16, 4, 1
  forms = a.forms.split(",")
  bad = [f for f in forms if f not in FORMS]
  if bad:
    print(f"--forms: unknown form {bad[0]!r}; known: {', '.join(FORMS)}", file=sys.stderr)
    return 2
  vocab, d, layers, ff, heads = MODELS[a.model]
  params = init_params(jax.random.PRNGKey(0), vocab, d, layers, ff)
  m = a.microbatches
  mesh = Mesh(np.array(jax.devices()), ("fsdp",))
  tokens = jax.random.randint(jax.random.PRNGKey(1), (m, a.batch // m, a.seq + 1), 0, vocab)
  rows_split = (a.batch // m) % mesh.devices.size == 0
  mbs = jax.device_put(tokens, NamedSharding(mesh, P(None, "fsdp" if rows_split else None)))
  attn = "cudnn" if jax.default_backend() == "gpu" else "xla"
  loss_fn = make_loss(heads, attn)
  n_par = sum(x.size for x in jax.tree.leaves(params))
  print(f"# {a.model} ({n_par / 1e6:.1f}M params), {a.batch} x {a.seq} as {m} microbatches, "
        f"{mesh.devices.size} x {jax.devices()[0].device_kind}")
  rows = [run_form(f, loss_fn, params, mbs, mesh, a.iters, a.budget_gb) for f in forms]
  base = next((r["ms"] for r in rows if r["form"] == "adamw"), float("nan"))
  print(f"| form | MB/device | temp MB/device | ms/step | tokens/s | x AdamW |")
  print("|---|---|---|---|---|---|")
  for r in rows:
    tps = a.batch * a.seq / (r["ms"] / 1e3)
    print(f"| {r['form']} | {1e3 * r['gb']:,.1f} | {1e3 * r['temp_gb']:,.1f} | {r['ms']:.1f} | {tps:,.0f} | "
          f"{r['ms'] / base:.3f} {r['note']}|")
  return 0


if __name__ == "__main__":
  sys.exit(main())
