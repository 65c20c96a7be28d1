"""Fused LM head + cross-entropy (models/loss.py) against float64 numpy and plain autodiff."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaleopt import models

from models_testlib import tiny, tokens


def _problem(seed, b=3, t=8, d=16, v=40, dtype=jnp.float32):
  k = jax.random.split(jax.random.key(seed), 4)
  h = jax.random.normal(k[0], (b, t, d), jnp.float32).astype(dtype)
  w = (0.5 * jax.random.normal(k[1], (d, v), jnp.float32)).astype(dtype)
  y = jax.random.randint(k[2], (b, t), 0, v)
  c = jax.random.normal(k[3], (b, t), jnp.float32)  # a cotangent per token
  return h, w, y, c


def _numpy_nll(h, w, y):
  z = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
  m = z.max(-1, keepdims=True)
  lse = np.log(np.exp(z - m).sum(-1)) + m[..., 0]
  return lse - np.take_along_axis(z, np.asarray(y)[..., None], -1)[..., 0]


def _plain_nll(h, w, y):  # plain autodiff reference: f32 logits, jax.nn.logsumexp
  z = jnp.einsum("btd,dv->btv", h, w).astype(jnp.float32)
  return jax.nn.logsumexp(z, -1) - jnp.take_along_axis(z, y[..., None], -1)[..., 0]


@pytest.mark.parametrize("chunks", [1, 4])
def test_per_token_values_and_gradients(chunks):
  h, w, y, c = _problem(0)
  nll, vjp = jax.vjp(jax.jit(lambda a, b: models.head_nll(a, b, y, chunks)), h, w)
  np.testing.assert_allclose(nll, _numpy_nll(h, w, y), rtol=1e-5, atol=1e-5)
  ref, ref_vjp = jax.vjp(lambda a, b: _plain_nll(a, b, y), h, w)
  for got, want in zip(vjp(c), ref_vjp(c)):  # per coordinate, random per-token cotangents
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # one token at a time: its cotangent reaches only its own row of dh
  one = jnp.zeros_like(c).at[1, 3].set(1.0)
  dh, _ = vjp(one)
  assert float(jnp.abs(dh).sum()) == float(jnp.abs(dh[1, 3]).sum()) > 0


def test_masked_mean_matches_lm_loss_and_bf16_close():
  h, w, y, _ = _problem(1)
  mask = (jax.random.uniform(jax.random.key(7), y.shape) < 0.6).astype(jnp.float32)
  plain = lambda a, b: models.lm_loss(jnp.einsum("btd,dv->btv", a, b), y, mask)
  for chunks in (1, 2):
    fused = lambda a, b: models.head_loss(a, b, y, mask, chunks)
    (lf, gf), (lp, gp) = [jax.value_and_grad(f, argnums=(0, 1))(h, w) for f in (fused, plain)]
    np.testing.assert_allclose(lf, lp, rtol=1e-6)
    for a, b in zip(gf, gp):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  # bf16 inputs: same bf16 logits and bf16 logit gradients as the plain path up to rounding
  hb, wb = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  plain_b = lambda a, b: models.lm_loss(
      jnp.einsum("btd,dv->btv", a, b).astype(jnp.float32), y, mask)
  (lf, gf), (lp, gp) = [jax.value_and_grad(f, argnums=(0, 1))(hb, wb) for f in
                        (lambda a, b: models.head_loss(a, b, y, mask), plain_b)]
  assert gf[0].dtype == jnp.bfloat16 and gf[1].dtype == jnp.bfloat16
  np.testing.assert_allclose(lf, lp, rtol=1e-6)
  for a, b in zip(gf, gp):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b)


def test_model_loss_equals_lm_loss_of_logits():
  cfg = tiny()
  init, apply = models.functional(cfg)
  params = init(jax.random.key(0))
  tok = tokens(cfg, b=2, t=16)
  x, tgt = tok[:, :-1], tok[:, 1:]
  plain = lambda p: models.lm_loss(apply(p, x)[0], tgt)
  fused = lambda p: models.functional_loss(cfg.replace(loss_chunks=3))(p, x, tgt)[0]
  (lf, gf), (lp, gp) = [jax.jit(jax.value_and_grad(f))(params) for f in (fused, plain)]
  np.testing.assert_allclose(lf, lp, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), gf, gp)
  unfused = jax.jit(models.functional_loss(cfg.replace(fused_loss=False)))(params, x, tgt)[0]
  np.testing.assert_allclose(unfused, lp, rtol=1e-7)


def test_bad_chunk_count_names_the_key():
  h, w, y, _ = _problem(2, t=8)
  with pytest.raises(ValueError, match="loss_chunks=3"):
    models.head_nll(h, w, y, chunks=3)
  with pytest.raises(ValueError, match="loss_chunks"):
    models.ModelConfig(loss_chunks=0)
