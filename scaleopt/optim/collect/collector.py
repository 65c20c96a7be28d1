"""``collect``: every statistic the optimizer state asks for, in one jitted step (the package
docstring has the layouts, the clip and the one-pass leave-one-out)."""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp

from scaleopt.optim.collect.clip import clip_factor, scale_group
from scaleopt.optim.collect.microbatch import (MicrobatchAxis, as_float32,
                                               fold_microbatches, halves, num_microbatches,
                                               scan_group, split_axis, spreads,
                                               stored_as_float32, sum0, value_and_grad_fn,
                                               vmap_over_axis, zeros_like_output)
from scaleopt.optim.collect.spec import (CollectorSpec, Found, default_fold_chunk, estimator,
                                         find_bc_states, merge_specs, state_hooks)
from scaleopt.optim.collect.stats import BCStats, LOOStats, LossFn, PyTree


def _clip_of(found: list[Found], spec: CollectorSpec, kind: str = "consistent"):
  if spec.clip != kind:
    return None
  return next(f.hp["max_norm"] for f in found if "max_norm" in f.hp)


def _loo(grad_fn, params, mbs, found, max_norm, spec: CollectorSpec, axis) -> BCStats:
  """g_full, then per fold r the BC states' fold terms on c g_r (c: clip). Two passes recompute
  g_r in a second scan; one pass (``spec.loo_one_pass``) folds the g_r stored by the first.
  ``axis``: the ``MicrobatchAxis`` of vmapped microbatches (None: unsplit)."""
  m = num_microbatches(mbs)
  if m < 2:
    raise ValueError(f"leave-one-out needs at least 2 microbatches, got m={m}")
  one = spec.loo_one_pass
  full, loss, aux, *g_all = scan_group(grad_fn, params, mbs, vmap=spec.vmap, keep_grads=one,
                                       keep_dtype=spec.loo_dtype, axis=axis)
  c = clip_factor(full.mean, max_norm) if max_norm is not None else jnp.float32(1.0)
  g_full = jax.tree.map(lambda x: c * x, full.mean)
  folds = [state_hooks(type(f.state)).fold_fn(f.state, f.hp, g_full, m) for f in found
           if f.state.spec.value.layout == "loo"]

  def fold(g_r):
    outs = [fn(g_r) for fn in folds]
    return jax.tree.map(lambda *xs: sum(xs), *outs)

  # the denominators' variance from sums of e_r = d_r - K, K the fold at g_full: the first-order
  # parts of e_r cancel over r, so (sum e^2 - (sum e)^2 / m) loses little to cancellation, and
  # the folds are running sums, with no mean needed first
  _, shift = fold(g_full)

  def sums(g_r):  # the fold terms, e_r and e_r^2 of one stored (or recomputed) g_r
    terms, d = fold(jax.tree.map(lambda x: c * x, as_float32(stored_as_float32(g_r))))
    e = jax.tree.map(jnp.subtract, d, shift)
    return terms, e, jax.tree.map(jnp.square, e)

  add = lambda t, u: jax.tree.map(jnp.add, t, u)
  grad_of = (lambda g: g) if one else (lambda mb: as_float32(grad_fn(params, mb)[2]))
  step = lambda carry, g_r: add(carry, sums(g_r))

  carry0 = zeros_like_output(sums, g_full)
  if one and split_axis(m, axis) is None:
    # the stored g_r in order, k folds per step of the scan, unrolled: one chain of
    # elementwise work per step that XLA can fuse with the running sums (docs/optim.md)
    k = spec.loo_fold_chunk or default_fold_chunk()
    (terms, e_sum, e_sq_sum), _ = jax.lax.scan(lambda carry, g_r: (step(carry, g_r), None),
                                               carry0, g_all[0], unroll=min(k, m))
  else:  # recomputed (two passes), or split over devices: folded where they lie
    reduce = lambda carry, g_rs: add(carry, sum0(vmap_over_axis(sums, m, axis)(g_rs)))
    (terms, e_sum, e_sq_sum), _ = fold_microbatches(
        grad_of, step, carry0, g_all[0] if one else mbs,
        vmap=one and spec.vmap and not spreads(m, axis), reduce=reduce, axis=axis)
  var = lambda a, q: jnp.maximum((q - a * a / m) / (m - 1), 0.0)
  loo = LOOStats(mean=jax.tree.map(lambda s: s / m, terms),
                 var=jax.tree.map(var, e_sum, e_sq_sum), count=m)
  return BCStats(g_full, g_full, None, None, loo, loss, aux, c)


def _x_fn(found: list[Found], spec: CollectorSpec):
  """Per-microbatch quantity for ``var_of="post_ema"``: the sum over BC states of their
  post-EMA denominators (masked leaves of other states contribute zeros)."""
  if spec.var_of != "post_ema":
    return None
  fns = [state_hooks(type(f.state)).var_fn(f.state, f.hp) for f in found
         if f.state.spec.value.var_of == "post_ema"]
  return lambda g: jax.tree.map(lambda *xs: sum(xs), *[fn(g) for fn in fns])


def _layout(grad_fn, params, mbs, spec, found, b_mbs, max_norm, axis) -> BCStats:
  lay = spec.layout
  kw = dict(var_of=spec.var_of, x_fn=_x_fn(found, spec), need_sq=spec.need_sq)
  vm = dict(vmap=spec.vmap, axis=axis)
  if spec.var_of == "post_ema" and spec.clip == "consistent":
    raise ValueError("the reference post-EMA variance reads per-microbatch denominators before "
                     "the step's clip factor is known; use clip_by_global_norm(..., "
                     "numerator_only=True) with it, as the reference code does")
  if lay == "all":
    s, loss, aux = scan_group(grad_fn, params, mbs, **kw, **vm)
    c = clip_factor(s.mean, max_norm) if max_norm is not None else jnp.float32(1.0)
    s = scale_group(s, c, spec.var_of)
    return BCStats(s.mean, s.mean, s, s, None, loss, aux, c)
  if lay == "rolling_b":
    if b_mbs is None:
      raise ValueError("layout 'rolling_b' needs b_microbatches (next step's group A)")
    mbs_a, mbs_b = mbs, b_mbs
  else:
    mbs_a, mbs_b = halves(mbs, f"layout {lay!r}")
  if spec.var_of and min(num_microbatches(mbs_a), num_microbatches(mbs_b)) < 2:
    raise ValueError(f"a variance correction needs at least 2 microbatches per group; layout "
                     f"{lay!r} got {num_microbatches(mbs_a)} and {num_microbatches(mbs_b)}")
  a, loss_a, aux_a = scan_group(grad_fn, params, mbs_a, **(kw if lay == "symmetric" else {}),
                                **vm)
  b, loss_b, aux_b = scan_group(grad_fn, params, mbs_b, **kw, **vm)
  if lay == "rolling_b":
    full, loss, aux = a.mean, loss_a, aux_a
  else:
    wa = a.count / (a.count + b.count)
    avg = lambda x, y: jax.tree.map(lambda p, q: wa * p + (1 - wa) * q, x, y)
    full, loss, aux = avg(a.mean, b.mean), wa * loss_a + (1 - wa) * loss_b, avg(aux_a, aux_b)
  c = clip_factor(full, max_norm) if max_norm is not None else jnp.float32(1.0)
  a = scale_group(a, c, spec.var_of if lay == "symmetric" else None)
  b = scale_group(b, c, spec.var_of)
  full = jax.tree.map(lambda x: c * x, full)
  numerator = full if lay == "symmetric" else a.mean
  return BCStats(numerator, full, a, b, None, loss, aux, c)


def collect(loss_fn: LossFn, params: PyTree, microbatches: PyTree, opt_state: PyTree, *,
            key: Optional[jax.Array] = None, logits_fn: Optional[Callable] = None,
            b_microbatches: PyTree = None,
            microbatch_axis: Optional[MicrobatchAxis] = None) -> BCStats:
  """Scans ``loss_fn`` over microbatches and returns what the chain's transforms need.

  Args:
    loss_fn: ``loss_fn(params, microbatch) -> (loss, aux)``; differentiated w.r.t. params.
    params: the parameters, shared by every microbatch of the step.
    microbatches: a pytree whose leaves have a leading microbatch axis m.
    opt_state: the optimizer state before this step; what to collect is read from it.
    key: PRNG key (Sophia's sampled labels or Rademacher vectors).
    logits_fn: ``(params, mb) -> (logits, mask)`` for Sophia's GNB estimator.
    b_microbatches: group B for ``rolling_b`` layouts (step t+1's group A).
    microbatch_axis: with ``vmap_microbatches``, the mesh axis that splits the microbatches
      over devices (``MicrobatchAxis``); ignored by the scan.

  Returns:
    BCStats, float32. Call ``tx.update(stats.numerator, opt_state, params, bc_stats=stats)``.
  """
  found = find_bc_states(opt_state)
  spec = merge_specs(found)
  needy = [f for f in found if f.under_multisteps and (
      f.state.spec.value.layout not in (None, "all") or f.state.spec.value.var_of
      or f.state.spec.value.estimator)]
  if needy:
    raise ValueError("optax.MultiSteps around a bias-corrected transform would update it with "
                     "the k-step mean gradient and one mini-step's statistics; pass all k*m "
                     "microbatches of the step to collect instead (they are accumulated there)")
  max_norm = _clip_of(found, spec)
  stats = _collect(loss_fn, params, microbatches, spec, found, max_norm, key, logits_fn,
                   b_microbatches, microbatch_axis if spec.vmap else None)
  num_norm = _clip_of(found, spec, "numerator")
  if num_norm is None:
    return stats
  return stats._replace(numerator_clip=clip_factor(stats.numerator, num_norm))


def _collect(loss_fn, params, microbatches, spec, found, max_norm, key, logits_fn,
             b_microbatches, axis) -> BCStats:
  if spec.estimator is not None:  # the axis goes only to estimators of split microbatches
    split = {"microbatch_axis": axis} if axis is not None else {}
    return estimator(spec.estimator)(loss_fn, params, microbatches, spec, found, key=key,
                                     logits_fn=logits_fn, b_microbatches=b_microbatches,
                                     max_norm=max_norm, **split)
  grad_fn = value_and_grad_fn(loss_fn)
  if spec.layout == "loo":
    return _loo(grad_fn, params, microbatches, found, max_norm, spec, axis)
  return _layout(grad_fn, params, microbatches, spec, found, b_microbatches, max_norm, axis)
