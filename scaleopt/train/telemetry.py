"""Per-layer optimizer telemetry, computed inside the jitted train step every N steps.

``run.telemetry_every: N`` (0: off; a multiple of ``run.log_every``) adds, on every N-th step,
for each tensor group

  grad_norm/<group>     || gradient ||_2 of the group (the full-batch mean gradient)
  update_norm/<group>   || applied update ||_2 (after clipping, lr and weight decay)
  param_norm/<group>    || parameters ||_2 after the step

and, for the bias-corrected forms (an optimizer state with a registered hook, see
``bc_hook``), per group

  bc_correction/<group> || u - u_plugin || / || u_plugin ||: the size of the variance
                        correction relative to the plug-in update (same statistics, no
                        correction)
  bc_clamped/<group>    fraction of coordinates whose corrected inverse was clamped at 0
  bc_var_ratio/<group>  sum Var_hat(x) / sum x^2 over the group: the estimated variance of the
                        preconditioner statistic x relative to its square

A group is a parameter-path prefix: one per layer and role for the stacked Transformer blocks
(``layer3.attn``, ``layer3.mlp``; the blocks' leading axis is unstacked into layers) and the
top-level name otherwise (``embed``, ``in_scale_final``, ``head``).

The values are computed under ``lax.cond`` on the step counter: other steps skip the work and
carry NaN, with ``telemetry = 0``; ``metrics.MetricsLog`` writes the groups only on rows with
``telemetry = 1`` (JSONL keys and TensorBoard tags ``<quantity>/<group>``). Nothing leaves the
device until the loop fetches the logged step's metrics.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from scaleopt.models.masks import path_names

PyTree = Any
NORMS = ("grad_norm", "update_norm", "param_norm")
BC = ("bc_correction", "bc_clamped", "bc_var_ratio")
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


# ------------------------------------------------------------------------------- BC hooks
# A hook computes, from what the train step has, the per-leaf trees the BC telemetry needs:
#   hook(tx, opt_state, params, stats) -> {"plugin": u_plugin, "clamped": 0/1 per coordinate,
#                                          "var": Var_hat(x), "x2": x^2}  (or None)
_BC_HOOKS: list[Callable] = []


def register_bc_hook(fn: Callable) -> Callable:
  """Adds a BC-telemetry hook (see above); the first one that returns a dict is used."""
  _BC_HOOKS.append(fn)
  return fn


def _bc(tx, opt_state, params, stats, updates) -> dict[str, jax.Array]:
  for hook in _BC_HOOKS:
    out = hook(tx, opt_state, params, stats)
    if out is None:
      continue
    ident = lambda x: x
    diff = group_sum(jax.tree.map(lambda u, p: u - p, updates, out["plugin"]), params)
    plug = group_sum(out["plugin"], params)
    clamped = group_sum(out["clamped"], params, ident)
    size = group_sum(params, params, jnp.ones_like)
    var = group_sum(out["var"], params, ident)
    x2 = group_sum(out["x2"], params, ident)
    res = {}
    for g in plug:
      res[f"bc_correction/{g}"] = jnp.sqrt(diff[g] / plug[g])
      res[f"bc_clamped/{g}"] = clamped[g] / size[g]
      res[f"bc_var_ratio/{g}"] = var[g] / x2[g]
    return res
  return {}


def compute(tx, opt_state, params_before, stats, updates, params_after) -> dict[str, jax.Array]:
  """Every telemetry value of one step (traced inside the step, called under ``lax.cond``)."""
  out = {**_norms("grad_norm", stats.full, params_before),
         **_norms("update_norm", updates, params_before),
         **_norms("param_norm", params_after, params_before)}
  out.update(_bc(tx, opt_state, params_before, stats, updates))
  return out


def maybe_compute(every: int, step: jax.Array, *args) -> dict[str, jax.Array]:
  """``compute(*args)`` on the steps where ``step + 1`` is a multiple of ``every`` (lax.cond:
  the other steps do no telemetry work) plus ``telemetry`` = 1 there and 0 elsewhere; {} when
  ``every`` is 0."""
  if not every:
    return {}
  fn = lambda: compute(*args)
  shapes = jax.eval_shape(fn)
  nan = lambda: jax.tree.map(lambda s: jnp.full(s.shape, jnp.nan, s.dtype), shapes)
  on = (step + 1) % every == 0
  out = jax.lax.cond(on, fn, nan)
  out[FLAG] = on.astype(jnp.float32)
  return out
