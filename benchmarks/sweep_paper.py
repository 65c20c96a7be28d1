"""Benchmark: the full `paper` sweep preset vs a Python loop of jitted one-configuration calls.

  python benchmarks/sweep_paper.py [--config configs/sweeps/paper.yaml] [--json OUT.json]

1. The vmapped sweep (`run_sweep`): wall time of the whole preset, first chunk (incl. compile)
   reported separately.
2. The loop baseline, same process: one jitted call per (s, seed, N, optimizer, hyper-parameter)
   configuration, timed on a subset (every N, optimizer and grid point at one s and one seed)
   after one warm-up call per compiled shape, then extrapolated to the full grid. Two loops:
   "setup per call" (`run_single`: sample the problem, eigh, T steps — what a one-config script
   does) and "shared setup" (the quadratic statistics of each (s, seed) precomputed once and
   passed in; the call does the N-slice, eigh and T steps), the conservative baseline.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scaleopt.scaling import blas, config, optimizers, problem, sweep  # noqa: E402


@functools.partial(jax.jit, static_argnames=("kind", "fixed", "n", "steps", "shared"))
def _shared_setup_call(q, hyper, *, kind, fixed, n, steps, shared):
  q = problem.Quadratic(q.a_train[:n, :n], q.b_train[:, :n], q.a_test[:n, :n], q.b_test[:, :n],
                        q.c_test, q.floor)
  mu, v = jnp.linalg.eigh(q.a_train)
  return sweep.train_curve(q, optimizers.Curvature(mu, v), kind, fixed, hyper, steps, shared)


def time_loops(cfg: dict, s: float, seed: int) -> dict:
  """Per-call seconds of both loops on one (s, seed) slice, after warm-up."""
  specs = config.parse_optimizers(cfg["optimizers"])
  spec = problem.ProblemSpec.from_config(cfg["problem"])
  steps = cfg["train"]["steps"]
  out = {"setup_per_call": [], "shared_setup": []}
  with jax.enable_x64(True), blas.limit_blas_threads(cfg["compute"]["blas_threads"]):
    key = sweep.problem_keys(cfg["problem"]["seed"], cfg["problem"]["seeds"])[seed]
    q = jax.block_until_ready(problem.sample_problem(key, jnp.float64(s), spec))
    for o in specs:
      fixed = sweep._freeze(o.fixed)
      for n in cfg["problem"]["n_features"]:
        h0 = {k: jnp.float64(o.grid[0][k]) for k in o.grid_keys}
        _shared_setup_call(q, h0, kind=o.kind, fixed=fixed, n=n, steps=steps,
                           shared=spec.shares_statistics).block_until_ready()   # compile
        sweep.run_single(cfg, s, seed, n, o.name, o.grid[0])                    # compile
        for g in o.grid:
          h = {k: jnp.float64(g[k]) for k in o.grid_keys}
          t0 = time.perf_counter()
          _shared_setup_call(q, h, kind=o.kind, fixed=fixed, n=n, steps=steps,
                             shared=spec.shares_statistics).block_until_ready()
          out["shared_setup"].append(time.perf_counter() - t0)
          t0 = time.perf_counter()
          sweep.run_single(cfg, s, seed, n, o.name, g)
          out["setup_per_call"].append(time.perf_counter() - t0)
  return {k: float(np.sum(v)) for k, v in out.items()} | {"calls": len(out["shared_setup"])}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--config", default=str(ROOT / "configs/sweeps/paper.yaml"))
  ap.add_argument("--set", action="append", default=[])
  ap.add_argument("--json", default=None)
  ap.add_argument("--out", default=None, help="also write the sweep's alpha.csv, losses.csv, plots")
  args = ap.parse_args(argv)
  cfg = config.load_config(args.config, args.set + ["compute.progress=false"])
  p = cfg["problem"]
  n_total = len(p["s"]) * p["seeds"] * len(p["n_features"]) * sum(
      len(o.grid) for o in config.parse_optimizers(cfg["optimizers"]))

  t0 = time.perf_counter()
  res = sweep.run_sweep(cfg)
  sweep_s = time.perf_counter() - t0

  if args.out:
    rows, _ = sweep.write_outputs(res, pathlib.Path(args.out))
    print(sweep.alpha_table(rows))
  s_mid = p["s"][len(p["s"]) // 2]
  loop = time_loops(cfg, s_mid, 0)
  scale = n_total / loop["calls"]
  est = {k: loop[k] * scale for k in ("setup_per_call", "shared_setup")}
  dev = jax.devices()[0]
  out = {
      "device": f"{dev.platform}: {getattr(dev, 'device_kind', '')}",
      "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
      "python": platform.python_version(), "jax": jax.__version__,
      "configs": n_total, "sweep_s": sweep_s, "sweep_first_chunk_s": res.timing["first_chunk_s"],
      "loop_subset_calls": loop["calls"], "loop_subset_s": loop,
      "loop_estimated_s": est,
      "speedup_vs_shared_setup_loop": est["shared_setup"] / sweep_s,
      "speedup_vs_setup_per_call_loop": est["setup_per_call"] / sweep_s,
  }
  print(json.dumps(out, indent=2))
  print(f"\n| what | {out['device']} |\n|---|---|\n"
        f"| configurations | {n_total} |\n"
        f"| vmapped sweep, whole preset | {sweep_s:.1f} s (first chunk incl. compile "
        f"{res.timing['first_chunk_s']:.1f} s) |\n"
        f"| loop, shared setup (extrapolated from {loop['calls']} calls) | "
        f"{est['shared_setup']:.0f} s -> {out['speedup_vs_shared_setup_loop']:.1f}x |\n"
        f"| loop, setup per call (extrapolated) | {est['setup_per_call']:.0f} s -> "
        f"{out['speedup_vs_setup_per_call_loop']:.1f}x |")
  if args.json:
    pathlib.Path(args.json).write_text(json.dumps(out, indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
