"""How far each reproduced reference mode moves from scaleopt's default, on one fixed stream.

A small MLP regression (8 -> 16 -> 4, skewed targets), 8 microbatches of 4 examples per step
(A/B: 4 + 4), 30 steps of the same microbatch stream for both arms of each pair, clip 0.5
(active on most steps), lr linear warm-up 0 -> 3e-3 over 10 steps, then constant. Reported: the relative difference of the updates summed over
the 30 steps, |sum u_ref - sum u_default| / |sum u_default|, and the final training loss of
both arms.

    python experiments/bias_reduction/reference_modes.py
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import scaleopt.optim as so

STEPS, M = 30, 8


def problem():
  k = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {"w1": 0.5 * jax.random.normal(k[0], (8, 16)), "b1": jnp.zeros(16),
            "w2": 0.5 * jax.random.normal(k[1], (16, 4))}

  def loss(p, mb):
    h = jnp.tanh(mb["x"] @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] - mb["y"]) ** 2), {}

  xs = jax.random.normal(k[2], (STEPS, M, 4, 8))
  ys = jnp.exp(jax.random.normal(k[3], (STEPS, M, 4, 4)))
  return params, loss, [{"x": xs[t], "y": ys[t]} for t in range(STEPS)]


def run(tx, params, loss, stream):
  st = tx.init(params)

  @jax.jit
  def step(p, st, mbs):
    stats = so.collect(loss, p, mbs, st)
    u, st = tx.update(stats.numerator, st, p, bc_stats=stats)
    return optax.apply_updates(p, u), st, stats.loss

  p = params
  for mbs in stream:
    p, st, l = step(p, st, mbs)
  total = jax.tree.map(lambda a, b: a - b, p, params)
  return total, float(l)


def main() -> int:
  params, loss, stream = problem()
  clip = lambda n=False: so.clip_by_global_norm(0.5, numerator_only=n)
  lr = optax.linear_schedule(0.0, 3e-3, 10)
  pairs = {
      "reference_post_ema (numerator-only clip both)": (
          optax.chain(clip(True), so.adamw_bc(lr, crossfit="ab")),
          optax.chain(clip(True), so.adamw_bc(lr, crossfit="ab",
                                              correction="reference_post_ema"))),
      "adaptive alpha (alpha_max 1)": (
          optax.chain(clip(), so.adamw_bc(lr, crossfit="ab")),
          optax.chain(clip(), so.adamw_bc(lr, crossfit="ab", crossfit_alpha_adaptive=True))),
      "numerator-only clip, A/B full": (
          optax.chain(clip(), so.adamw_bc(lr, crossfit="ab")),
          optax.chain(clip(True), so.adamw_bc(lr, crossfit="ab"))),
      "numerator-only clip, LOO full": (
          optax.chain(clip(), so.adamw_bc(lr)), optax.chain(clip(True), so.adamw_bc(lr))),
      "shampoo adam_b1=0.95 (fallback only)": (
          optax.chain(clip(), so.shampoo(lr, block_size=16, root_every=5)),
          optax.chain(clip(), so.shampoo(lr, block_size=16, root_every=5, adam_b1=0.95))),
  }
  print(f"initial loss {float(jnp.mean(jnp.stack([loss(params, jax.tree.map(lambda x: x[j], stream[0]))[0] for j in range(M)]))):.4f}")
  print("| mode | rel. difference of the summed updates | final loss default -> mode |")
  print("|---|---|---|")
  for name, (base, ref) in pairs.items():
    (d0, l0), (d1, l1) = run(base, params, loss, stream), run(ref, params, loss, stream)
    num = np.sqrt(sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(jax.tree.leaves(d1),
                                                                    jax.tree.leaves(d0))))
    den = np.sqrt(sum(float(jnp.sum(a ** 2)) for a in jax.tree.leaves(d0)))
    print(f"| {name} | {num / den:.3g} | {l0:.4f} -> {l1:.4f} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
