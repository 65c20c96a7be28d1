"""Bias of std / cf / inv / full Adam updates against the population preconditioned direction.

Problem (closed form, so the population direction is exact): linear regression with
x ~ N(0, I_4), y = eps (teacher w* = 0), current weights w = d, one example per microbatch,
per-example gradient g = x (x.d - eps) with E g = d and, by Isserlis,

    Var(g_k) = |d|^2 + d_k^2 + Var(eps).

Adam runs in steady state (v_{t-1} = P, t large, b1 = 0 so the numerator is this step's
gradient mean), the statistic entering v is the square of a group mean (the paper's rule), so
P_k = E[g_bar_k^2] = d_k^2 + Var(g_k) / m and the population direction is d / sqrt(P).
Groups A and B hold m microbatches each; std = A for both parts (same batch), cf = A numerator
and B preconditioner, inv = same batch with the pre-EMA delta-method correction, full = cf +
correction. Relative bias = |E u - d/sqrt(P)| / |d/sqrt(P)|, E by Monte Carlo (same draws for
every mode), with its standard error.

    scaleopt bias-study [--quick] [--out results/bias_reduction.md]
    python -m scaleopt.optim.bias_study --out docs/results.md      (the table in docs/results.md)
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import scaleopt.optim as so

D = jnp.array([1.0, 0.5, -0.3, 0.1])
MODES = ("std", "cf", "inv", "full")
BEGIN, END = "<!-- bias-study:begin -->", "<!-- bias-study:end -->"


def noise(key, shape, kind: str, sigma: float):
  z = jax.random.normal(key, shape)
  if kind == "gaussian":
    return sigma * z
  e = np.e  # centered log-normal with variance sigma^2
  return sigma * (jnp.exp(z) - np.sqrt(e)) / np.sqrt((e - 1.0) * e)


def measure(m: int, b2: float, kind: str, sigma: float, trials: int, seed: int = 0):
  var_g = float(jnp.sum(D * D)) + np.asarray(D) ** 2 + sigma ** 2
  P = np.asarray(D) ** 2 + var_g / m
  target = np.asarray(D) / np.sqrt(P)

  def loss(p, mb):
    return 0.5 * jnp.mean((mb["x"] @ p - mb["y"]) ** 2), {}

  # one transform per mode; "same" statistics come from one group, "cross" from A and B
  txs = {"std": so.scale_by_adam_bc(b1=0.0, b2=b2, mode="std"),
         "cf": so.scale_by_adam_bc(b1=0.0, b2=b2, mode="cf", crossfit="rolling_b"),
         "inv": so.scale_by_adam_bc(b1=0.0, b2=b2, mode="inv", correction="pre_ema"),
         "full": so.scale_by_adam_bc(b1=0.0, b2=b2, mode="full", crossfit="rolling_b",
                                     correction="pre_ema")}
  st = {k: tx.init(D)._replace(count=jnp.asarray(10_000, jnp.int32),
                               nu=jnp.asarray(P, jnp.float32)) for k, tx in txs.items()}

  def one(key):
    kx, ke = jax.random.split(key)
    x = jax.random.normal(kx, (2, m, 1, 4))
    y = noise(ke, (2, m, 1), kind, sigma)
    a, b = {"x": x[0], "y": y[0]}, {"x": x[1], "y": y[1]}
    same = so.collect(loss, D, a, st["inv"])
    cross = so.collect(loss, D, a, st["full"], b_microbatches=b)
    stats = {"std": same, "cf": cross, "inv": same, "full": cross}
    return jnp.stack([txs[k].update(stats[k].numerator, st[k], bc_stats=stats[k])[0]
                      for k in MODES])

  u = np.asarray(jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(seed), trials)),
                 np.float64)  # [trials, mode, coord]
  mean, se = u.mean(0), u.std(0) / np.sqrt(trials)
  tn = np.linalg.norm(target)
  out = {}
  for i, mode in enumerate(MODES):
    out[mode] = (np.linalg.norm(mean[i] - target) / tn, np.linalg.norm(se[i]) / tn)
  return out


def table(rows) -> str:
  head = ("| noise | sigma | m per group | b (weight of this step in v) | "
          + " | ".join(f"{m} rel. bias" for m in MODES) + " | MC s.e. |")
  sep = "|" + "---|" * (4 + len(MODES) + 1)
  lines = [head, sep]
  for (kind, sigma, m, b2), res in rows:
    se = max(v[1] for v in res.values())
    lines.append(f"| {kind} | {sigma} | {m} | {1 - b2:.2f} | "
                 + " | ".join(f"{res[k][0]:.4f}" for k in MODES) + f" | {se:.4f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="fewer settings and trials (make run)")
  ap.add_argument("--out", default="results/bias_reduction.md")
  ap.add_argument("--trials", type=int, default=None)
  args = ap.parse_args(argv)
  trials = args.trials or (8_000 if args.quick else 40_000)
  if args.quick:
    grid = [(k, s, m, b2) for k in ("gaussian", "lognormal") for s in (0.3,) for m in (4, 16)
            for b2 in (0.9, 0.5)]
  else:
    grid = [(k, s, m, b2) for k in ("gaussian", "lognormal") for s in (0.3, 3.0)
            for m in (4, 8, 32) for b2 in (0.9, 0.5)]
  t0 = time.time()
  rows = [(g, measure(g[2], g[3], g[0], g[1], trials)) for g in grid]
  tab = table(rows)
  secs = time.time() - t0
  print(tab)
  cmd = "scaleopt bias-study" + (" --quick" if args.quick else "")
  body = (f"{BEGIN}\nProduced by `{cmd}` ({trials} Monte Carlo trials per row, "
          f"{secs:.0f} s on {jax.devices()[0].platform.upper()}; problem and target in the "
          f"docstring of `scaleopt/optim/bias_study.py`).\n\n{tab}\n{END}")
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  text = out.read_text() if out.exists() else ""
  if BEGIN in text and END in text:
    text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: body, text, flags=re.S)
  else:
    text = (text + "\n\n" if text else "") + body + "\n"
  out.write_text(text)
  print(f"\nwrote {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
