"""Scale-vector variants: equality at init, folding, and the Theorem 2.2 preconditioner."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaleopt import models
from models_testlib import init_params, jit_apply, randomize_scales, tiny, tiny_moe, tokens

# Variants that add no normalization: identical functions at init (all scales = 1).
NO_NEW_NORM = [
    dict(scales="none"),
    dict(scales="hg"),
    dict(dual="dp"),
    dict(reparam="or_product"),
    dict(reparam="or_normalized"),
    dict(scales="hg", dual="dp", reparam="or_normalized", dual_targets=("q", "v", "up")),
]


@pytest.mark.parametrize("base", [tiny(qkv_bias=True, tie_embeddings=False),
                                  pytest.param(tiny_moe(moe_capacity_factor=0.0),
                                               marks=pytest.mark.integration)],
                         ids=["dense", "moe"])
def test_variants_equal_standard_at_init(base):
  toks = tokens(base)
  ref = jit_apply(base)(init_params(base), toks)[0]
  for kw in (NO_NEW_NORM if not base.is_moe else NO_NEW_NORM[:1] + NO_NEW_NORM[-1:]):
    cfg = base.replace(**kw)
    out = jit_apply(cfg)(init_params(cfg), toks)[0]
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-6,
                               err_msg=str(kw))


def test_dnp_adds_a_norm_and_changes_the_function():
  base = tiny()
  toks = tokens(base)
  ref = jit_apply(base)(init_params(base), toks)[0]
  for v in ("dnp", "unified"):
    cfg = base.with_variant(v)
    out = jit_apply(cfg)(init_params(cfg), toks)[0]
    assert float(jnp.max(jnp.abs(out - ref))) > 1e-3


def test_theorem_2_2_preconditioner_first_order():
  """One plain GD step on (gamma, W) moves V = diag(gamma) W by -eta (gamma_j^2 + w_j w_j^T) g_j.

  Kernel layout [in, out]: row j of the kernel is the paper's column w_j; g_j = dL/dV[j, :] is
  taken from the *folded* model (an independent parameterization with V as its kernel).
  """
  cfg = tiny(scales="hg", init_std=0.3)
  params = randomize_scales(init_params(cfg), seed=5, spread=0.4)
  toks = tokens(cfg, b=2, t=16)

  def loss(p, c=cfg):
    return models.lm_loss(models.functional(c)[1](p, toks[:, :-1])[0], toks[:, 1:])

  grads = jax.jit(jax.grad(loss))(params)
  f64 = lambda a: np.asarray(a, np.float64)
  attn, gattn = params["blocks"]["b0"]["attn"], grads["blocks"]["b0"]["attn"]
  gamma, w = f64(attn["in_scale_q"]["gamma"][0]), f64(attn["wq"]["kernel"][0])
  eta = 1e-3
  gamma_new = gamma - eta * f64(gattn["in_scale_q"]["gamma"][0])
  w_new = w - eta * f64(gattn["wq"]["kernel"][0])
  dv = gamma_new[:, None] * w_new - gamma[:, None] * w

  cfg_f, params_f = models.fold_scales(cfg, params)
  g_f = jax.jit(jax.grad(lambda p: loss(p, cfg_f)))(params_f)
  g = f64(g_f["blocks"]["b0"]["attn"]["wq"]["kernel"][0])
  v = f64(params_f["blocks"]["b0"]["attn"]["wq"]["kernel"][0])
  np.testing.assert_allclose(gamma[:, None] * w, v, rtol=1e-6)
  wg = np.sum(w * g, axis=1, keepdims=True)  # w_j^T g_j
  predicted = -eta * (gamma[:, None] ** 2 * g + w * wg)
  rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)
  assert rel(dv, predicted) < 2e-3
  # The rank-one term matters, and plain GD on V (P = I) is far off.
  assert rel(dv, -eta * gamma[:, None] ** 2 * g) > 0.05
  assert rel(dv, -eta * g) > 0.2
  # Eigenvalue bound: lambda_min(gamma_j^2 I + w_j w_j^T) = gamma_j^2.
  j = 3
  p_j = gamma[j] ** 2 * np.eye(w.shape[1]) + np.outer(w[j], w[j])
  np.testing.assert_allclose(np.linalg.eigvalsh(p_j)[0], gamma[j] ** 2, rtol=1e-8)


def test_or_reparam_values():
  from scaleopt.models.layers import scale_value
  a = jnp.array([[1.0, 2.0, 2.0, 4.0]])
  b = jnp.array([3.0])
  np.testing.assert_allclose(scale_value({"beta": b, "alpha": a}, "or_product"), 3 * a)
  rms = np.sqrt(np.mean(np.square(a)))
  np.testing.assert_allclose(scale_value({"beta": b, "alpha": a}, "or_normalized"),
                             3 * a / rms, rtol=1e-6)
  # Both start at gamma = 1.
  for r in ("or_product", "or_normalized"):
    np.testing.assert_allclose(
        scale_value({"beta": jnp.ones(()), "alpha": jnp.ones(5)}, r), np.ones(5))
  assert dataclasses.is_dataclass(tiny())
