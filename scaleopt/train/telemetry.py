"""Per-layer optimizer telemetry, computed inside the jitted train step every N steps.

``run.telemetry_every: N`` (0: off; a multiple of ``run.log_every``) adds, on every N-th step,
for each tensor group

  grad_norm/<group>     || gradient ||_2 of the group (the full-batch mean gradient, before
                        the global-norm clip, as the run's ``grad_norm``)
  update_norm/<group>   || applied update ||_2 (after clipping, lr and weight decay)
  param_norm/<group>    || parameters ||_2 after the step

and, for the bias-corrected forms (statistics with a variance: ``mode`` inv / full), per group

  bc_correction/<group> || u - u0 || / || u0 ||: the size of the variance correction relative
                        to the plug-in update u0 (the same chain on the same statistics with
                        the variance statistics set to 0, i.e. no correction; both include
                        learning rate and weight decay)
  bc_clamped/<group>    fraction of coordinates where the correction was clamped (the inverse
                        at 0 for inv/A-B forms, a sign flip zeroed for LOO): found by
                        evaluating the chain once more with every variance statistic times
                        1.01 (u'); a clamped coordinate does not move (|u' - u| <= 1e-5
                        |u - u0|, rounding), an unclamped one moves by about 1% of its
                        correction; coordinates whose correction is lost in rounding
                        (|u - u0| <= 1e-5 |u0|) do not count
  bc_rules/<rule>       coordinates a safeguard changed this step, summed over the model
                        (``scaleopt.optim.rule_counts``: LOO sign flips zeroed, corrected
                        inverses and negative variance estimates clamped at 0, corrections
                        that enlarged a step)
  bc_var_ratio/<group>  sum Var_hat(x) / sum x^2: the estimated variance of the preconditioner
                        statistic relative to its square; x is the B group's mean gradient
                        (``var_of`` grad) or mean of squares (``sq``); for LOO the fold
                        denominators d_r (Var over folds / d^2, d^2 = first / third)

The two extra chain evaluations run only on telemetry steps (under the same branch).

A group is a parameter-path prefix: one per layer and role for the stacked Transformer blocks
(``layer3.attn``, ``layer3.mlp``; the blocks' leading axis is unstacked into layers) and the
top-level name otherwise (``embed``, ``in_scale_final``, ``head``).

The values are computed in a branch on the step counter (``scaleopt.optim.phases``: a device
``lax.cond``, or a program per outcome picked by the host): other steps skip the work and
carry NaN, with ``telemetry = 0``; ``metrics.MetricsLog`` writes the groups only on rows with
``telemetry = 1`` (JSONL keys and TensorBoard tags ``<quantity>/<group>``). Nothing leaves the
device until the loop fetches the logged step's metrics.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from scaleopt.models.masks import path_names
from scaleopt.optim import phases

PyTree = Any
NORMS = ("grad_norm", "update_norm", "param_norm")
BC = ("bc_correction", "bc_clamped", "bc_var_ratio", "bc_rules")
FLAG = "telemetry"


def is_telemetry_key(key: str) -> bool:
  return "/" in key and key.split("/", 1)[0] in NORMS + BC


def _where(path) -> tuple[str, Optional[int], Optional[int]]:
  """(group, block index k, period) of one leaf; k is None for unstacked leaves."""
  names = path_names(path)
  if names[0] == "blocks" and len(names) > 2 and names[1][:1] == "b" and names[1][1:].isdigit():
    return names[2], int(names[1][1:]), None
  return names[0], None, None


def _period(params: PyTree) -> int:
  ks = {_where(p)[1] for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
  return len(ks - {None}) or 1


def group_sum(tree: PyTree, like: PyTree, fn: Callable = jnp.square) -> dict[str, jax.Array]:
  """Sum of ``fn(tree)`` per group (``like``: the parameter tree giving the paths); stacked
  block leaves are reduced over all axes but the leading layer axis."""
  period = _period(like)
  flat, _ = jax.tree_util.tree_flatten_with_path(like)
  leaves = jax.tree.leaves(tree)
  acc: dict[str, jax.Array] = {}
  for (path, _), x in zip(flat, leaves):  # trace-time grouping of a static structure
    role, k, _ = _where(path)
    x = fn(x.astype(jnp.float32))
    if k is None:
      acc[role] = acc.get(role, 0.0) + jnp.sum(x)
      continue
    per = jnp.sum(x, axis=tuple(range(1, x.ndim)))  # [n_layers / period]
    for i in range(per.shape[0]):
      g = f"layer{i * period + k}.{role}"
      acc[g] = acc.get(g, 0.0) + per[i]
  return acc


def _norms(name: str, tree: PyTree, like: PyTree) -> dict[str, jax.Array]:
  return {f"{name}/{g}": jnp.sqrt(v) for g, v in group_sum(tree, like).items()}


# ------------------------------------------------------------------------------- BC forms

def _scale_var(stats, s: float):
  """``stats`` with every variance statistic (the groups' ``var``, the folds' ``var``) times s."""
  mul = lambda tr: None if tr is None else jax.tree.map(lambda v: s * v, tr)
  grp = lambda g: g if g is None or g.var is None else g._replace(var=mul(g.var))
  a = grp(stats.a)
  b = a if stats.b is stats.a else grp(stats.b)
  loo = None if stats.loo is None else stats.loo._replace(var=mul(stats.loo.var))
  return stats._replace(a=a, b=b, loo=loo)


def _has_var(stats) -> bool:
  return any(x is not None and x.var is not None for x in (stats.a, stats.b, stats.loo))


def _var_ratio(spec, stats, like) -> dict[str, jax.Array]:
  """Per group, sum Var_hat(x) / sum x^2 of the preconditioner statistic x (see the module
  docstring); {} where the collector gives no variance of a known statistic."""
  if spec.layout == "loo" and stats.loo is not None:
    first, third = stats.loo.mean["first"], stats.loo.mean["third"]
    ref2 = jax.tree.map(lambda f, t: jnp.where(t != 0, f / jnp.where(t != 0, t, 1.0), 0.0),
                        first, third)  # d^2 ~ (m/d) / (m/d^3)
    var = stats.loo.var
  else:
    g = stats.b if stats.b is not None else stats.a
    ref = {"grad": g.mean, "sq": g.sq}.get(spec.var_of) if g is not None else None
    if ref is None or g.var is None:
      return {}
    ref2, var = jax.tree.map(jnp.square, ref), g.var
  num = group_sum(var, like, lambda x: x)
  den = group_sum(ref2, like, lambda x: x)
  return {f"bc_var_ratio/{k}": num[k] / den[k] for k in num}


def _bc(tx, opt_state, params, stats, updates) -> dict[str, jax.Array]:
  """The BC statistics from two more evaluations of the same chain with the variance
  statistics scaled by 0 (the plug-in update u0) and by 1.01 (u'): where the correction is
  clamped, a slightly larger variance leaves the update unchanged; elsewhere it moves it."""
  if not _has_var(stats):
    return {}
  from scaleopt import optim
  run = lambda s: tx.update(stats.numerator, opt_state, params,
                            bc_stats=_scale_var(stats, s))[0]
  u0, u2 = run(0.0), run(1.01)
  ident = lambda x: x
  diff = group_sum(jax.tree.map(lambda u, p: u - p, updates, u0), params)
  plug = group_sum(u0, params)
  def is_clamped(u, z, w):
    """u does not move when the variances grow by 1% (|u' - u| <= 1e-3 of the 1% growth of
    the correction), for a correction that is not itself lost in rounding (> 1e-5 |u0|)."""
    c = jnp.abs(u - z)
    return ((jnp.abs(w - u) <= 1e-5 * c) & (c > 1e-5 * jnp.abs(z))).astype(jnp.float32)

  clamped = group_sum(jax.tree.map(is_clamped, updates, u0, u2), params, ident)
  size = group_sum(params, params, jnp.ones_like)
  out = {}
  for g in plug:
    out[f"bc_correction/{g}"] = jnp.sqrt(diff[g] / plug[g])
    out[f"bc_clamped/{g}"] = clamped[g] / size[g]
  out.update(_var_ratio(optim.collector_spec(opt_state), stats, params))
  return out


def compute(tx, opt_state, params_before, stats, updates, params_after) -> dict[str, jax.Array]:
  """Every telemetry value of one step (traced inside the step, called under ``lax.cond``)."""
  pre_clip = jax.tree.map(lambda g: g / stats.clip_factor, stats.full)
  out = {**_norms("grad_norm", pre_clip, params_before),
         **_norms("update_norm", updates, params_before),
         **_norms("param_norm", params_after, params_before)}
  out.update(_bc(tx, opt_state, params_before, stats, updates))
  out.update(_rules(tx, opt_state, params_before, stats))
  return out


def _rules(tx, opt_state, params, stats) -> dict[str, jax.Array]:
  """``bc_rules/<rule>``: coordinates each safeguard changed this step (``optim.rule_counts``
  of the state the chain produces; one more evaluation of the chain's update)."""
  from scaleopt import optim
  if not optim.rule_counts(opt_state):
    return {}
  new = tx.update(stats.numerator, opt_state, params, bc_stats=stats)[1]
  return {f"bc_rules/{k}": v.astype(jnp.float32) for k, v in optim.rule_counts(new).items()}


def maybe_compute(every: int, step: jax.Array, *args) -> dict[str, jax.Array]:
  """``compute(*args)`` on the steps where ``step + 1`` is a multiple of ``every`` (a branch:
  the other steps do no telemetry work) plus ``telemetry`` = 1 there and 0 elsewhere; {} when
  ``every`` is 0."""
  if not every:
    return {}
  fn = lambda: compute(*args)
  shapes = jax.eval_shape(fn)
  nan = lambda: jax.tree.map(lambda s: jnp.full(s.shape, jnp.nan, s.dtype), shapes)
  on = phases.due(step, every, counter="step", offset=1)
  out = phases.cond(on, fn, nan)
  out[FLAG] = jnp.asarray(on, jnp.float32)
  return out
