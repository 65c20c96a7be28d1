"""Shampoo root solvers on factors from training: time of one root step and accuracy.

  PYTHONPATH=. python benchmarks/shampoo_roots.py                  # gpt2-small stand-in, GPU
  PYTHONPATH=. python benchmarks/shampoo_roots.py --quick          # tiny model (CPU plumbing)
  PYTHONPATH=. python benchmarks/shampoo_roots.py --solvers eigh,newton:TF32_TF32_F32:20

The factors are real: ``--steps`` steps of Shampoo (block ``--block``, statistics every step,
eigh roots, float32 matmuls) on
``optim_step_cost.py``'s GPT-2-small stand-in (byte tokens of the embedded corpus, 4 x 8 x 1024
tokens per step);
then every L and R of the state (all blocks of one size concatenated, as a root step batches
them) goes to each solver on one device. A solver is ``eigh`` (``jax.lax.linalg.eigh``, the
backend's default: cuSOLVER syevd on GPU), ``eigh-jacobi`` (GPU only) or
``newton:PRECISION:ITERS`` (coupled Newton, ``newton_inverse_root``, at most ITERS iterations,
matmuls at PRECISION). Timed: the whole root step (every size, one jitted call), median of
``--repeats`` runs after a warm-up. Accuracy: on ``--sample`` matrices per size (evenly spaced),
the root P against a float64 NumPy reference (eigh of sym(F) + damping I, eigenvalues floored
as the optimizer floors them): relative Frobenius error ||P - P_ref|| / ||P_ref|| and the same
for the preconditioned block P_L M P_R of the state's momentum (median and max over blocks).
Baseline: the ``eigh`` row of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

if "--quick" in sys.argv:  # CPU: OpenBLAS may deadlock on concurrent large eigh calls
  os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import optim_step_cost as osc  # noqa: E402
from scaleopt.optim import build, collect  # noqa: E402
from scaleopt.optim import shampoo_lib as S  # noqa: E402
from scaleopt.optim.shampoo_lib import placement  # noqa: E402
from scaleopt.train import data  # noqa: E402

DEFAULT_SOLVERS = ("eigh,newton:highest:30,newton:BF16_BF16_F32_X3:30,newton:TF32_TF32_F32:30,"
                   "newton:TF32_TF32_F32:8,newton:BF16_BF16_F32:30")


def train_factors(quick: bool, steps: int, block: int):
  """Factors after ``steps`` steps: ({size: every L and R of that size stacked [N, s, s]},
  [(momentum blocks, L, R) of the first 8 blocks of each tensor], damping, eigenvalue floor,
  last loss)."""
  if quick:
    vocab, d, layers, heads, seq, mb_seqs, m = 512, 64, 2, 4, 64, 2, 4
  else:
    vocab, d, layers, heads, seq, mb_seqs, m = 50304, 768, 12, 12, 1024, 8, 4
  init, logits_fn, loss_fn = osc.model(vocab, d, layers, heads, seq)
  params = jax.jit(init)(jax.random.PRNGKey(0))
  cfg = dict(name="shampoo", learning_rate=3e-4, schedule={"kind": "constant"},
             extra=dict(block_size=block, root_every=10, stats_every=1, root_method="eigh",
                        matmul_precision="highest", stats_precision="highest"))
  tx, _ = build(cfg)
  st = jax.jit(tx.init)(params)
  rng = np.random.default_rng(0)

  @jax.jit
  def step(p, st, tok):
    mbs = {"tokens": tok[..., :-1], "targets": tok[..., 1:],
           "mask": jnp.ones(tok[..., 1:].shape, jnp.float32)}
    stats = collect(loss_fn, p, mbs, st)
    u, st = tx.update(stats.numerator, st, p, bc_stats=stats)
    return optax.apply_updates(p, u), st, stats.loss

  text = data.embedded_tokens("train")  # byte tokens: real text statistics
  for _ in range(steps):
    start = rng.integers(0, len(text) - seq - 1, m * mb_seqs)
    tok = jnp.asarray(np.stack([text[i:i + seq + 1] for i in start]).reshape(
        m, mb_seqs, seq + 1), jnp.int32)
    params, st, loss = step(params, st, tok)
  sh = next(x for x in jax.tree.leaves(st, is_leaf=lambda x: isinstance(
      x, S.ScaleByShampooState)) if isinstance(x, S.ScaleByShampooState))
  mu = jax.tree.leaves(sh.mu)
  mats: dict[int, list] = {}
  for k, f in sorted(sh.factors.items()):
    mats.setdefault(f.L.shape[-1], []).append(f.L)
    mats.setdefault(f.R.shape[-1], []).append(f.R)
  fac = {s: jnp.concatenate(v, 0) for s, v in mats.items()}
  dirs = [(S.to_blocks(mu[int(k)], S.blocking(mu[int(k)].shape, block))[:8], f.L[:8], f.R[:8])
          for k, f in sorted(sh.factors.items())]
  damping = float(sh.hp["damping"])
  return fac, dirs, damping, damping * float(sh.hp["eig_floor_ratio"]), float(loss)


def solver_fn(name: str, damping: float, floor: float):
  if name == "eigh":
    return lambda x: S.root_from_eig(*S.eigh_damped(x, damping, floor))
  if name == "eigh-jacobi":
    return lambda x: S.root_from_eig(*S.eigh_damped(x, damping, floor, "jacobi"))
  kind, prec, iters = name.split(":")
  if kind != "newton":
    raise SystemExit(f"--solvers: unknown solver {name!r}")
  return lambda x: S.newton_inverse_root(x, damping, 4, int(iters), prec)


def reference_root(f: np.ndarray, damping: float, floor: float) -> np.ndarray:
  a = 0.5 * (f + np.swapaxes(f, -1, -2)).astype(np.float64) + damping * np.eye(f.shape[-1])
  w, v = np.linalg.eigh(a)
  return (v * np.maximum(w, floor)[..., None, :] ** -0.25) @ np.swapaxes(v, -1, -2)


def rel(a, b, axes=(-2, -1)):
  return np.sqrt(np.sum((a - b) ** 2, axes)) / np.sqrt(np.sum(b ** 2, axes))


def measure(name, fn, fac, idx, ref, dsel, dref, repeats):
  """One table row: median time of the batched root step and the errors against float64."""
  step = jax.jit(lambda fs: placement.batched_by_size(fs, fn))  # as a root step batches them
  out = jax.block_until_ready(step(fac))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(step(fac))
    times.append(time.perf_counter() - t0)
  err = np.concatenate([rel(np.asarray(out[s])[idx[s]], ref[s]) for s in fac])
  root1 = jax.jit(lambda x: placement.batched_by_size({0: x}, fn)[0])
  derr = []
  for (mb, lf, rf), d_ref in zip(dsel, dref):
    pl, pr = np.asarray(root1(lf), np.float64), np.asarray(root1(rf), np.float64)
    derr.append(rel(pl @ np.asarray(mb, np.float64) @ pr, d_ref))
  derr = np.concatenate(derr)
  return dict(solver=name, ms=1e3 * float(np.median(times)), err_med=float(np.median(err)),
              err_max=float(err.max()), dir_med=float(np.median(derr)),
              dir_max=float(derr.max()))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--steps", type=int, default=100)
  ap.add_argument("--block", type=int, default=512)
  ap.add_argument("--solvers", default=DEFAULT_SOLVERS)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--sample", type=int, default=16)
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  fac, dirs, damping, floor, loss = train_factors(args.quick, args.steps, args.block)
  dev = jax.devices()[0]
  n_all = sum(x.shape[0] for x in fac.values())
  print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}; {n_all} factor "
        f"matrices ({', '.join(f'{x.shape[0]} of {s}' for s, x in fac.items())}) after "
        f"{args.steps} steps (loss {loss:.3f}); damping {damping:g}", flush=True)
  idx = {s: np.unique(np.linspace(0, x.shape[0] - 1, args.sample).astype(int))
         for s, x in fac.items()}
  host = {s: np.asarray(x) for s, x in fac.items()}
  ref = {s: reference_root(host[s][idx[s]], damping, floor) for s in fac}
  lam = {s: np.linalg.eigvalsh(host[s][idx[s]].astype(np.float64)) for s in fac}
  cond = np.concatenate([(l[:, -1] + damping) / (np.maximum(l[:, 0], 0) + damping)
                         for l in lam.values()])
  print(f"condition number of F + damping I over the sample: median {np.median(cond):.3g}, "
        f"max {cond.max():.3g}", flush=True)
  # direction error on the first 8 blocks of 4 tensors: P_L M P_R with both roots from the solver
  dsel = dirs[:: max(1, len(dirs) // 4)]
  dref = [np.asarray(reference_root(np.asarray(lf), damping, floor) @ np.asarray(mb, np.float64)
                     @ reference_root(np.asarray(rf), damping, floor)) for mb, lf, rf in dsel]
  rows = []
  for name in args.solvers.split(","):
    try:
      rows.append(measure(name, solver_fn(name, damping, floor), fac, idx, ref, dsel, dref,
                          args.repeats))
    except Exception as e:  # keep going: one failing solver must not hide the others
      print(f"{name}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
      continue
    print(f"{name:28s} {rows[-1]['ms']:9.2f} ms  root err med {rows[-1]['err_med']:.2e} max "
          f"{rows[-1]['err_max']:.2e}  direction err med {rows[-1]['dir_med']:.2e} max "
          f"{rows[-1]['dir_max']:.2e}", flush=True)
  base = next((r["ms"] for r in rows if r["solver"] == "eigh"), None)
  print(f"\n| solver | root step ms ({n_all} matrices, 1 device) | vs eigh | root rel. error "
        "median / max | direction rel. error median / max |")
  print("|---|---|---|---|---|")
  for r in rows:
    vs = f"{r['ms'] / base:.2f}x" if base else "-"
    print(f"| {r['solver']} | {r['ms']:.1f} | {vs} | {r['err_med']:.1e} / {r['err_max']:.1e} | "
          f"{r['dir_med']:.1e} / {r['dir_max']:.1e} |")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(dict(
        device=dev.device_kind, jax=jax.__version__, matrices=n_all, damping=damping,
        cond_median=float(np.median(cond)), rows=rows), indent=1))


if __name__ == "__main__":
  main()
