"""Shampoo-BC's estimator: the B-side factor statistics and (two-pass form) eigenvalue variances."""

from __future__ import annotations

import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from scaleopt.optim import phases
from scaleopt.optim.collect import (BCStats, CollectorSpec, clip_factor, refresh_groups,
                                    register_estimator, value_and_grad_fn, welford_add,
                                    welford_init)
from scaleopt.optim.shampoo_lib.blocking import blockings_of, blocks_of, block_grams
from scaleopt.optim.shampoo_lib.options import AB_NUMERATORS, CROSSFITS, MODES
from scaleopt.optim.shampoo_lib.placement import batched_by_size, to_device
from scaleopt.optim.shampoo_lib.roots import eigh_damped
from scaleopt.optim.shampoo_lib.state import PyTree, ScaleByShampooState, ShampooPrecond
from scaleopt.optim.tree_utils import check_choice


def shampoo_collector_spec(mode: str, crossfit: str, root_every: int, block_size: int,
                           stats_precision: str = "highest",
                           eigh_implementation: Optional[str] = None,
                           block_major: Optional[Callable] = None,
                           block_shards: int = 1,
                           ab_numerator: str = "all_off_refresh") -> CollectorSpec:
  """The estimator pass these settings need (``std``: the plain collector); the B-side
  statistics G_j G_j^T, G_j^T G_j take ``stats_precision``, the two-pass eigendecomposition
  ``eigh_implementation``, the blocks ``block_major``'s order and ``block_shards``' cut."""
  check_choice("mode", mode, MODES)
  check_choice("crossfit", crossfit, CROSSFITS)
  check_choice("ab_numerator", ab_numerator, AB_NUMERATORS)
  if mode == "std":
    return CollectorSpec(layout=None)
  layout = "all" if mode == "inv" else crossfit
  opts = (("two_pass", mode in ("inv", "full")), ("block_size", block_size),
          ("stats_precision", stats_precision), ("eigh_implementation", eigh_implementation),
          ("block_major", block_major), ("block_shards", block_shards),
          ("a_every_step", ab_numerator == "a"))
  return CollectorSpec(layout=layout, estimator="shampoo", refresh_every=root_every,
                       estimator_options=opts, stateful=True)


def _eig_variances(grad_fn, params, mbs_b, keys, blk, eig_l, eig_r, b2, c):
  """Pass 2: Var_k of the projections of c G_j on the new eigenbases (Welford over B)."""
  hp = jax.lax.Precision.HIGHEST
  m_b = jax.tree.leaves(mbs_b)[0].shape[0]

  def proj(gb):  # ||(Q_L^T G)_{k,:}||^2 and ||(G Q_R)_{:,k}||^2 per block
    pl = {k: jnp.sum(jnp.einsum("nik,nij->nkj", eig_l[k][1], gb[k], precision=hp) ** 2, -1)
          for k in keys}
    pr = {k: jnp.sum(jnp.einsum("nij,njk->nik", gb[k], eig_r[k][1], precision=hp) ** 2, -2)
          for k in keys}
    return pl, pr

  w0 = welford_init(jax.tree.map(lambda lam_q: lam_q[0], (eig_l, eig_r),
                                 is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2
                                 and not isinstance(x[0], dict)))
  body = lambda w, mb: (welford_add(w, proj(blocks_of(grad_fn(params, mb)[2], blk, c))),
                        None)
  w, _ = jax.lax.scan(body, w0, mbs_b)
  den = (1 - b2) ** 2 / (m_b * (m_b - 1))
  return tuple({k: jnp.maximum(v * den, 0.0) for k, v in side.items()} for side in w.m2)


def _factor_pass(grad_fn, params, mbs_b, st, keys, blk, hp, num, clip_of, two_pass,
                 stats_precision, eigh_implementation):
  """Pass 1 over B (factor statistics, B's mean gradient and loss), then for the two-pass
  form the eigendecomposition of the new factors and pass 2. Statistics are of c G_j."""
  m_b = jax.tree.leaves(mbs_b)[0].shape[0]
  zero = lambda: {k: (jnp.zeros(st.factors[k].L.shape, jnp.float32),
                      jnp.zeros(st.factors[k].R.shape, jnp.float32)) for k in keys}

  def pass1(carry, mb):
    s, g_sum, l_sum, a_sum = carry
    loss, aux, g = grad_fn(params, mb)
    gb = blocks_of(g, blk)
    s = {k: tuple(x + y for x, y in zip(s[k], block_grams(gb[k], stats_precision))) for k in keys}
    g_sum = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_sum, g)
    return (s, g_sum, l_sum + loss, jax.tree.map(jnp.add, a_sum, aux)), None

  mb0 = jax.tree.map(lambda x: x[0], mbs_b)
  _, aux_s, g_s = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32),
                               jax.eval_shape(grad_fn, params, mb0))
  (s, g_sum, l_sum, a_sum), _ = jax.lax.scan(pass1, (zero(), g_s, jnp.float32(0.0), aux_s),
                                             mbs_b)
  g_b = jax.tree.map(lambda x: x / m_b, g_sum)
  c = clip_of(g_b)
  sl = {k: (c * c) * s[k][0] / m_b for k in keys}
  sr = {k: (c * c) * s[k][1] / m_b for k in keys}
  extra = (g_b, l_sum / m_b, jax.tree.map(lambda x: x / m_b, a_sum))
  if not two_pass:
    return ShampooPrecond(sl, sr, None, None, None, None, jnp.bool_(True)), extra
  b2, damping = hp["b2"], hp["damping"]
  mats = {**{("L", k): b2 * to_device(st.factors[k].L) + (1 - b2) * sl[k] for k in keys},
          **{("R", k): b2 * to_device(st.factors[k].R) + (1 - b2) * sr[k] for k in keys}}
  floor = hp["eig_floor_ratio"] * damping
  eig = batched_by_size(mats, lambda f: eigh_damped(f, damping, floor, eigh_implementation))
  eig_l, eig_r = ({k: eig[(side, k)] for k in keys} for side in ("L", "R"))
  var_l, var_r = _eig_variances(grad_fn, params, mbs_b, keys, blk, eig_l, eig_r, b2, c)
  return ShampooPrecond(sl, sr, eig_l, eig_r, var_l, var_r, jnp.bool_(True)), extra


def shampoo_collect(loss_fn, params: PyTree, microbatches: PyTree, spec: CollectorSpec, found,
                    *, key=None, logits_fn=None, b_microbatches: PyTree = None,
                    max_norm=None, microbatch_axis=None) -> BCStats:
  """Numerator gradient plus, on root steps (count % root_every == 0, ``phases.cond``),
  the B-side factor statistics and (``inv``/``full``) the two-pass eigenvalue variances.

  On root steps of the ``ab`` layout ``full`` and ``loss`` cover A and B (pass 1 over B
  computes B's gradients anyway). A consistent clip uses c from ``full``'s norm and scales
  the numerator by c, the factor statistics by c^2 and their variances by c^4.
  """
  del key, logits_fn
  f = next(f for f in found if isinstance(f.state, ScaleByShampooState))
  st, hp, opts = f.state, f.hp, dict(spec.estimator_options)
  root = phases.due(st.count, spec.refresh_every)
  grad_fn = value_and_grad_fn(loss_fn)
  (num, loss, aux), mbs_b = refresh_groups(grad_fn, params, microbatches, spec.layout, root,
                                           b_microbatches, vmap=spec.vmap, axis=microbatch_axis,
                                           a_every_step=opts.get("a_every_step", False))
  m_b = jax.tree.leaves(mbs_b)[0].shape[0]
  if opts["two_pass"] and m_b < 2:
    raise ValueError(f"the eigenvalue-variance correction needs >= 2 microbatches in group B, "
                     f"got {m_b}")
  keys = sorted(st.factors)
  blk = blockings_of(params, keys, opts["block_size"], opts["block_major"], opts["block_shards"])
  for k in keys:
    shape, b = jax.tree.leaves(params)[int(k)].shape, blk[k]
    if st.factors[k].L.shape != (math.prod(shape[:-2]) * b.nb1 * b.nb2, b.bs1, b.bs1):
      raise ValueError("shampoo_collect: the optimizer state's blocks do not match the "
                       "parameters; build the state with tx.init(params)")
  both = spec.layout == "ab"
  avg = lambda x, y: jax.tree.map(lambda p, q: 0.5 * (p + q), x, y)
  full_of = lambda g_b: avg(num, g_b) if both else num
  clip_of = lambda g_b: (clip_factor(full_of(g_b), max_norm) if max_norm is not None
                         else jnp.float32(1.0))
  run = lambda: _factor_pass(grad_fn, params, mbs_b, st, keys, blk, hp, num, clip_of,
                             opts["two_pass"], opts["stats_precision"],
                             opts["eigh_implementation"])
  skip = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(run))
  pre, (g_b, loss_b, aux_b) = phases.cond(root, run, skip)
  pre = pre._replace(root=root)
  use_b = root & both
  full = jax.tree.map(lambda p, q: jnp.where(use_b, p, q), full_of(g_b), num)
  loss = jnp.where(use_b, 0.5 * (loss + loss_b), loss)
  aux = jax.tree.map(lambda p, q: jnp.where(use_b, 0.5 * (p + q), p), aux, aux_b)
  c = clip_factor(full, max_norm) if max_norm is not None else jnp.float32(1.0)
  scale = lambda t: jax.tree.map(lambda x: c * x, t)
  return BCStats(scale(num), scale(full), None, None, None, loss, aux, c, pre)


register_estimator("shampoo", shampoo_collect)
