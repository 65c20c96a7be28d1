"""What one-pass leave-one-out's folds cost, apart from the model's forward and backward.

A synthetic loss whose gradient is one elementwise pass, ``loss_r = a_r sum_leaves sum(sin p)``
(so g_r = a_r cos p), over the parameter tree of a model preset (default gpt2-small, 123.6M
parameters) at m microbatches. Rows, each one jitted step with donated parameters and state:

* ``adamw``: ``optax.adamw`` after the scan's running sum of the m gradients (the baseline;
  ``collector_overhead.py``'s steps);
* ``loo k=K``: ``adamw_bc`` (one-pass LOO + Jensen) with ``loo_fold_chunk=K``;
* ``read stack``: one read of a float32 stack of m gradients (the sum over its leading axis),
  the least any fold order can cost beyond the stack's one write.

Columns: median ms per step; the ms over AdamW's step of the same run (what the stored
gradients and their folds add to a training step at this m); seconds to lower and compile the
step (on CPU the unrolled folds' compile is what sets ``loo_fold_chunk``'s CPU default).

    python benchmarks/loo_folds.py                          # GPU: gpt2-small, m = 64
    python benchmarks/loo_folds.py --model tiny --m 8 --chunks 1,8 --iters 3  # CPU
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

import scaleopt.optim as so
from scaleopt.models.presets import get_preset
from scaleopt.models.transformer import functional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from collector_overhead import baseline_step, bc_step  # noqa: E402


def param_tree(model: str, key) -> dict:
  return jax.jit(functional(get_preset(model))[0])(key)


def loss_fn(params, mb):
  leaves = jax.tree.leaves(params)
  return mb["a"] * sum(jnp.sum(jnp.sin(p)) for p in leaves), {}


def timed(fn, args, iters: int, donate=(0, 1)) -> tuple[float, float]:
  """(median seconds per call of the compiled ``fn``, seconds to lower and compile it); its
  first outputs feed the next call."""
  t0 = time.perf_counter()
  f = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
  compile_s = time.perf_counter() - t0
  out = f(*args)
  jax.block_until_ready(out)
  times = []
  for _ in range(iters):
    args = (*out[:len(donate)], *args[len(donate):]) if donate else args
    t0 = time.perf_counter()
    out = f(*args)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t0)
  return float(np.median(times)), compile_s


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="gpt2-small")
  ap.add_argument("--m", type=int, default=64)
  ap.add_argument("--chunks", default="1,8,16,64")
  ap.add_argument("--iters", type=int, default=10)
  a = ap.parse_args(argv)
  try:
    chunks = [int(c) for c in a.chunks.split(",")]
    if min(chunks) < 1 or a.m < 2 or a.iters < 1:
      raise ValueError("chunks and iters must be integers >= 1 and m >= 2")
    params = param_tree(a.model, jax.random.PRNGKey(0))
  except ValueError as e:
    print(f"loo_folds: --model {a.model!r}, --m {a.m}, --chunks {a.chunks!r}, --iters "
          f"{a.iters}: {e}", file=sys.stderr)
    return 2
  n = sum(x.size for x in jax.tree.leaves(params))
  mbs = {"a": jnp.linspace(0.5, 1.5, a.m, dtype=jnp.float32)}
  print(f"{jax.devices()[0].device_kind} x {jax.device_count()}, jax {jax.__version__}, "
        f"{a.model} {n / 1e6:.1f}M parameters, m = {a.m}, stack {a.m * n * 4 / 1e9:.1f} GB")
  fresh = lambda: jax.tree.map(jnp.copy, params)
  tx = optax.adamw(1e-3)
  base = timed(baseline_step(loss_fn, tx), (fresh(), tx.init(params), mbs), a.iters)
  rows = [("adamw", base)]
  for k in chunks:
    tx = optax.chain(so.collector_options(loo_fold_chunk=k), so.adamw_bc(1e-3))
    step = bc_step(loss_fn, tx)
    rows.append((f"loo k={k}", timed(step, (fresh(), tx.init(params), mbs), a.iters)))
  stack = jax.tree.map(lambda x: jnp.broadcast_to(x, (a.m, *x.shape)) + 0, params)
  read = timed(lambda s: jax.tree.map(lambda x: jnp.sum(x, 0), s), (stack,), a.iters,
               donate=())[0]
  print("\n| row | ms/step | ms over adamw | compile s |\n|---|---|---|---|")
  for name, (t, c) in rows:
    print(f"| {name} | {t * 1e3:.2f} | {(t - base[0]) * 1e3:+.2f} | {c:.2f} |")
  print(f"| read stack ({a.m * n * 4 / read / 1e12:.2f} TB/s) | {read * 1e3:.2f} | - | - |")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
