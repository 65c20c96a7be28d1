"""The formulas and per-tensor update forms of ``scale_by_adam_bc`` (equations in
``scaleopt.optim.adam_bc``'s module docstring).

``directions`` picks the form of the chosen ``mode``/``crossfit`` and maps its per-tensor
function (``std_leaf``, ``ab_leaf``, ``symmetric_leaf``, ``loo_leaf``) over the tensors; each
returns (u, new m, new v, counts of ``RULES``). The transform itself (state, collector hooks,
the safeguards around these forms) is in ``scaleopt.optim.adam_bc``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from scaleopt.optim import delta
from scaleopt.optim.collect import align
from scaleopt.optim.tree_utils import tmap, unzip

PyTree = Any

# Coordinates a rule changed at the last update (``ScaleByAdamBCState.rules``), in this order.
RULES = ("sign_flips_zeroed", "inverse_clamped", "enlarging", "variance_clamped")


# ----------------------------------------------------------------------------- formulas

def var_sq_of_mean(g_bar, var_g, m):
  """Unbiased Var(g_bar^2) from the same m microbatches: 4 g^2 V - 2 V^2 (m-1)/(m+1)."""
  return 4.0 * g_bar * g_bar * var_g - 2.0 * (m - 1.0) / (m + 1.0) * var_g * var_g


def corrected_inverse(v_hat, var_x, b, eps, correction, scale=1.0, reference_pre_ema=False):
  """1 / (sqrt(v_hat) + eps), minus the delta-method term of ``correction`` (see module doc).

  ``var_x`` is Var(x) of the statistic entering v this step, or Var(p_bar) of the reference
  per-microbatch denominators for ``reference_post_ema``. Clamped at 0.
  """
  d = jnp.sqrt(v_hat) + eps
  if correction == "none":
    return 1.0 / d
  if correction == "reference_post_ema":
    return delta.inv_corrected(d, var_x, scale=scale)
  u = jnp.maximum(v_hat, 1e-12)
  bv = (b * b) * var_x  # first, so that zero variance gives exactly zero correction
  if correction == "post_ema":
    return delta.inv_corrected(d, bv / (4.0 * u), scale=scale)
  k2 = 3.0 / 8.0 if reference_pre_ema else 1.0 / 8.0
  corr = bv * (1.0 / (4.0 * u * d * d * d) + k2 / (u * jnp.sqrt(u) * d * d))
  return jnp.maximum(1.0 / d - scale * corr, 0.0)


def adaptive_alpha(g_a: jax.Array, x_b: jax.Array, alpha_max) -> jax.Array:
  """The reference's adaptive cross-fit weight of one tensor: alpha_max clip(cos(s_A, s_B), 0, 1)
  with s_A = g_A^2 and s_B the B statistic."""
  s_a = (g_a * g_a).ravel()
  s_b = x_b.ravel()
  cos = jnp.dot(s_a, s_b) / jnp.maximum(jnp.linalg.norm(s_a) * jnp.linalg.norm(s_b), 1e-30)
  return alpha_max * jnp.clip(cos, 0.0, 1.0)


def b1_mix(b1, mu, g):
  """The first moment's EMA step b1 m + (1 - b1) g."""
  return b1 * mu + (1 - b1) * g


class AdamBCHyper(NamedTuple):
  """The settings of ``scale_by_adam_bc`` that the per-tensor forms read."""
  b1: Any
  b2: Any
  eps: Any
  correction: str
  v_source: str
  correction_scale: Any
  reference_pre_ema: bool
  crossfit_alpha: Any
  adaptive: bool
  loo_variance: str


class BiasCorrection(NamedTuple):
  """This step's Adam bias corrections: m_hat = m / m_denom, v_hat = v / v_denom, and
  x_weight = (1 - b2) / (1 - b2^t), the weight b of this step's statistic x in v_hat."""
  m_denom: Any
  v_denom: Any
  x_weight: Any


def bias_correction(b1, b2, count_inc) -> BiasCorrection:
  """The corrections of update ``count_inc`` (1 for the first update)."""
  v_denom = 1 - b2 ** count_inc
  return BiasCorrection(1 - b1 ** count_inc, v_denom, (1 - b2) / v_denom)


# ----------------------------------------------------------------------------- rule counts

def rule_dict(counts: jax.Array) -> dict:
  """{name in ``RULES``: count} of a count vector."""
  return {name: counts[i] for i, name in enumerate(RULES)}


def _counts(flips=0, clamped=0, enlarged=0):
  """The per-leaf count vector of ``RULES`` (variance clamps are counted per statistic)."""
  c = lambda x: jnp.sum(jnp.asarray(x, jnp.int32))
  return jnp.stack([c(flips), c(clamped), c(enlarged), jnp.int32(0)])


def _inv_counts(inv, v_hat, eps):
  """Coordinates whose corrected inverse was clamped at 0, and those the correction enlarged."""
  plain = 1.0 / (jnp.sqrt(v_hat) + eps)
  return (inv <= 0) & (plain > 0), inv > plain


# ----------------------------------------------------------------------------- per-tensor forms

def _statistic(hyper: AdamBCHyper, group, m) -> tuple[PyTree, PyTree]:
  """(x, Var(x)) trees of a group: x = g_bar^2 or the mean of squares."""
  if hyper.v_source == "mean_sq":
    return group.sq, group.var
  x = jax.tree.map(lambda g: g * g, group.mean)
  if group.var is None:
    return x, None
  if hyper.correction == "reference_post_ema":
    return x, group.var
  return x, jax.tree.map(lambda g, v: jnp.maximum(var_sq_of_mean(g, v, m), 0.0), group.mean,
                         group.var)


def ab_leaf(hyper: AdamBCHyper, bc: BiasCorrection, g, unclipped, mu, nu, x, var_x):
  """One tensor of the A/B (and inv) forms: m <- g_A, v <- x_B, u = m_hat inv(v_hat);
  ``unclipped`` is g_A before a numerator-only clip (the alpha mix's g_A^2)."""
  if hyper.adaptive:
    alpha = adaptive_alpha(unclipped, x, hyper.crossfit_alpha)
  else:
    alpha = hyper.crossfit_alpha
  x = (1 - alpha) * (unclipped * unclipped) + alpha * x  # alpha = 1 leaves x bit-identical
  if var_x is not None and hyper.correction != "reference_post_ema":
    var_x = (alpha * alpha) * var_x  # Var of the mixed statistic's B part: alpha^2 Var(x_B)
  m_new = b1_mix(hyper.b1, mu, g)
  v_new = hyper.b2 * nu + (1 - hyper.b2) * x
  v_hat = jnp.maximum(v_new / bc.v_denom, 0.0)
  inv = corrected_inverse(v_hat, var_x, bc.x_weight, hyper.eps, hyper.correction,
                          hyper.correction_scale, hyper.reference_pre_ema)
  return (m_new / bc.m_denom) * inv, m_new, v_new, _counts(0, *_inv_counts(inv, v_hat, hyper.eps))


def symmetric_leaf(hyper: AdamBCHyper, bc: BiasCorrection, g, mu, nu, g_a, x_a, var_a, g_b, x_b,
                   var_b):
  """Persistent m, v from g_full; u = (m_hat_A inv_B + m_hat_B inv_A) / 2 (candidates)."""

  def side(g_side, x_side, var_side):
    v_hat = jnp.maximum((hyper.b2 * nu + (1 - hyper.b2) * x_side) / bc.v_denom, 0.0)
    inv = corrected_inverse(v_hat, var_side, bc.x_weight, hyper.eps, hyper.correction,
                            hyper.correction_scale, hyper.reference_pre_ema)
    return b1_mix(hyper.b1, mu, g_side) / bc.m_denom, inv, _inv_counts(inv, v_hat, hyper.eps)

  m_a, inv_a, (clamped_a, enlarged_a) = side(g_a, x_a, var_a)
  m_b, inv_b, (clamped_b, enlarged_b) = side(g_b, x_b, var_b)
  return (0.5 * (m_a * inv_b + m_b * inv_a), b1_mix(hyper.b1, mu, g),
          hyper.b2 * nu + (1 - hyper.b2) * g * g,
          _counts(0, clamped_a | clamped_b, enlarged_a | enlarged_b))


def loo_leaf(hyper: AdamBCHyper, g, mu, nu, first, third, fold_var):
  """u = mean_r m_hat_r/d_r - scale V mean_r m_hat_r/d_r^3 (sign flips zeroed); ``fold_var``
  is V (see ``scale_by_adam_bc``'s ``loo_variance``)."""
  u, counts = first, _counts()
  if hyper.correction != "none":
    u = first - hyper.correction_scale * fold_var * third
    flip = jnp.sign(u) != jnp.sign(first)
    counts = _counts(flip, 0, ~flip & (jnp.abs(u) > jnp.abs(first)))
    u = jnp.where(flip, 0.0, u)
  return u, b1_mix(hyper.b1, mu, g), hyper.b2 * nu + (1 - hyper.b2) * g * g, counts


def std_leaf(hyper: AdamBCHyper, bc: BiasCorrection, g, unclipped, mu, nu):
  """Adam: m <- g, v <- unclipped^2 (g before a numerator-only clip, else g)."""
  m_new = b1_mix(hyper.b1, mu, g)
  v_new = hyper.b2 * nu + (1 - hyper.b2) * unclipped * unclipped
  return ((m_new / bc.m_denom) / (jnp.sqrt(v_new / bc.v_denom) + hyper.eps), m_new, v_new,
          _counts())


def per_leaf(leaf, g, *trees):
  """(u, m, v, counts of ``RULES`` summed over the tensors) of ``leaf`` mapped over tensors."""
  u, m, v, c = unzip(tmap(leaf, g, *trees), g, 4)
  return u, m, v, sum(jax.tree.leaves(c), _counts())


def _negative_var(hyper: AdamBCHyper, group, like) -> jax.Array:
  """Coordinates whose unbiased Var(g_bar^2) estimate was negative (clamped at 0)."""
  if (hyper.v_source == "mean_sq" or hyper.correction == "reference_post_ema"
      or group.var is None):
    return jnp.int32(0)
  neg = jax.tree.map(lambda g, v: jnp.sum(var_sq_of_mean(g, v, group.count) < 0),
                     align(group.mean, like), align(group.var, like))
  return sum(jax.tree.leaves(neg), jnp.int32(0)).astype(jnp.int32)


def directions(hyper: AdamBCHyper, mode, crossfit, bc: BiasCorrection, g, unclipped, state,
               stats):
  """(u, m, v, rule counts) of the chosen form; ``g`` is the float32 numerator, ``unclipped``
  the same before a numerator-only clip (second-moment statistics; see
  ``collect.clip_by_global_norm``); ``stats`` the step's ``BCStats``."""
  mu, nu = state.mu, state.nu
  if mode == "std":
    return per_leaf(lambda *a: std_leaf(hyper, bc, *a), g, unclipped, mu, nu)
  if mode in ("cf", "full") and crossfit == "loo":
    if stats.loo is None:
      raise ValueError("crossfit='loo' needs bc_stats from the 'loo' layout")
    var = stats.loo.var
    if hyper.loo_variance == "per_fold":  # (m - 1) x the spread over folds (scale_by_adam_bc)
      var = jax.tree.map(lambda v: (stats.loo.count - 1) * v, var)
    loo_terms = [align(x, g) for x in (stats.loo.mean["first"], stats.loo.mean["third"], var)]
    return per_leaf(lambda *a: loo_leaf(hyper, *a), g, mu, nu, *loo_terms)
  zeros = lambda tr: tr if tr is not None else jax.tree.map(lambda _: jnp.zeros(()), g)
  var_rule = jnp.zeros(4, jnp.int32).at[3]
  if mode in ("cf", "full") and crossfit == "symmetric":
    x_a, var_a = _statistic(hyper, stats.a, stats.a.count)
    x_b, var_b = _statistic(hyper, stats.b, stats.b.count)
    trees = [align(zeros(x), g) for x in (stats.a.mean, x_a, var_a, stats.b.mean, x_b, var_b)]
    u, m, v, c = per_leaf(lambda *a: symmetric_leaf(hyper, bc, *a), g, mu, nu, *trees)
    return u, m, v, c + var_rule.set(_negative_var(hyper, stats.a, g)
                                     + _negative_var(hyper, stats.b, g))
  x, var_x = _statistic(hyper, stats.b, stats.b.count)
  if hyper.correction != "none" and var_x is None:
    raise ValueError("a variance correction needs group variances in bc_stats; collect them "
                     "with scaleopt.optim.collect from this transform's state")
  x, var_x = align(x, g), align(zeros(var_x), g)
  u, m, v, c = per_leaf(lambda *a: ab_leaf(hyper, bc, *a), g, unclipped, mu, nu, x, var_x)
  return u, m, v, c + var_rule.set(_negative_var(hyper, stats.b, g))


def support_clip(u, g, stats, v_source, tau):
  """u_k <- u_k min(1, sqrt(tau (x_k + 1e-12) / (g_Ak^2 + 1e-12))), x the B statistic."""
  x_b = align(stats.b.sq if v_source == "mean_sq"
              else jax.tree.map(lambda t: t * t, stats.b.mean), g)
  return tmap(lambda u_, x, ga: jnp.where(tau > 0, u_ * jnp.minimum(1.0, jnp.sqrt(
      tau * (x + 1e-12) / (ga * ga + 1e-12))), u_), u, x_b, g)
