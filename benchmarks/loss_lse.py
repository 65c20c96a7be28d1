"""One pass or two over the logits: the log-sum-exp of the fused LM head + cross-entropy.

  PYTHONPATH=. python benchmarks/loss_lse.py [--tokens 32768 --vocab 50304 --reps 20]
  PYTHONPATH=. python benchmarks/loss_lse.py --quick      # small shapes (CPU smoke run)

``scaleopt.models.loss`` reads the bf16 logits z ``[N, V]`` for lse_n = log sum_v exp(z_nv)
(the forward) and once more for the logit gradient (the backward). Variants of the forward's
log-sum-exp, each jitted alone on the same z, and the whole head + loss forward and backward
(``jax.grad`` of ``loss.head_loss`` in h and W) with each:

* ``two-pass``: m_n = max_v z_nv, then sum_v exp(z_nv - m_n) (two reductions over z);
* ``online``: one variadic reduction carrying (max, rescaled sum) pairs (two exps per element);
* ``chunked-K``: z viewed as ``[N, V / K, K]``: per chunk its max and sum of exp in one pass,
  then the ``V / K`` partial results combined.

Error: max |lse - float64 lse| over the rows. Baseline in the same run: ``two-pass``.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from scaleopt.models import loss

f32 = jnp.float32


def two_pass(z):
  m = jnp.max(z, axis=-1, keepdims=True).astype(f32)
  return jnp.log(jnp.sum(jnp.exp(z.astype(f32) - m), axis=-1)) + m[..., 0]


def online(z):
  def comb(a, b):
    (ma, sa), (mb, sb) = a, b
    m = jnp.maximum(ma, mb)
    safe = jnp.where(jnp.isfinite(m), m, 0.0)
    return m, sa * jnp.exp(ma - safe) + sb * jnp.exp(mb - safe)
  x = z.astype(f32)
  m, s = jax.lax.reduce((x, jnp.ones_like(x)), (f32(-jnp.inf), f32(0)), comb, (z.ndim - 1,))
  return m + jnp.log(s)


def chunked(k):
  def lse(z):
    v = z.shape[-1]
    zc = z.reshape(*z.shape[:-1], v // k, k)
    mc = jnp.max(zc, axis=-1).astype(f32)
    sc = jnp.sum(jnp.exp(zc.astype(f32) - mc[..., None]), axis=-1)
    m = jnp.max(mc, axis=-1)
    return m + jnp.log(jnp.sum(sc * jnp.exp(mc - m[..., None]), axis=-1))
  return lse


def time_ms(fn, *args, reps):
  """Milliseconds per call of ``fn(*args)`` over ``reps`` calls after one warm-up call."""
  out = fn(*args)
  jax.block_until_ready(out)
  t = time.perf_counter()
  for _ in range(reps):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t) / reps * 1e3


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--tokens", type=int, default=32768)
  ap.add_argument("--vocab", type=int, default=50304)
  ap.add_argument("--d", type=int, default=768)
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--quick", action="store_true")
  a = ap.parse_args(argv)
  if a.quick:
    a.tokens, a.vocab, a.d, a.reps = 256, 1536, 64, 3
  dev = jax.devices()[0]
  print(f"# {dev.device_kind} ({dev.platform}), jax {jax.__version__}, N={a.tokens} "
        f"V={a.vocab} d={a.d}, bf16 logits, {a.reps} reps")
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  h = jax.random.normal(k1, (1, a.tokens, a.d), f32).astype(jnp.bfloat16)
  w = (jax.random.normal(k2, (a.d, a.vocab), f32) * 0.1).astype(jnp.bfloat16)
  y = jax.random.randint(k3, (1, a.tokens), 0, a.vocab)
  z = jnp.einsum("btd,dv->btv", h, w)[0]
  rows = np.asarray(z[:64], np.float64)
  ref = np.log(np.exp(rows - rows.max(-1, keepdims=True)).sum(-1)) + rows.max(-1)
  variants = {"two-pass": two_pass, "online": online}
  for k in (128, 384, 1048):
    if a.vocab % k == 0:
      variants[f"chunked-{k}"] = chunked(k)
  out = ["| variant | lse ms | head + loss fwd+bwd ms | max abs error vs float64 |",
         "|---|---|---|---|"]
  orig = loss._lse_nll
  for name, fn in variants.items():
    err = float(np.abs(np.asarray(jax.jit(fn)(z[:64]), np.float64) - ref).max())
    ms = time_ms(jax.jit(fn), z, reps=a.reps)

    def lse_nll(zz, yy, fn=fn):
      lse = fn(zz)
      zy = jnp.take_along_axis(zz, yy[..., None], axis=-1)[..., 0].astype(f32)
      return lse, lse - zy
    loss._lse_nll = lse_nll
    g = jax.jit(jax.grad(lambda h, w: loss.head_loss(h, w, y), argnums=(0, 1)))
    ms_all = time_ms(g, h, w, reps=a.reps)
    loss._lse_nll = orig
    out.append(f"| {name} | {ms:.3f} | {ms_all:.3f} | {err:.2e} |")
    print(out[-1], flush=True)
  print("\n".join(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
