"""The global-norm clip: ``clip_by_global_norm``, the chain element whose factor the
collector applies to every statistic (``numerator_only``: to the first moment only), and the
factor's helpers."""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from scaleopt.optim.collect.microbatch import align
from scaleopt.optim.collect.spec import CollectorSpec, Static, register_bc_state
from scaleopt.optim.collect.stats import BCStats, GroupStats, PyTree


def unclipped_numerator(bc_stats: Optional[BCStats], updates: PyTree) -> PyTree:
  """The numerator before a numerator-only clip, for the second-moment statistics: ``updates``
  itself unless the collector set a numerator-only clip factor (then ``bc_stats.numerator``,
  aligned with ``updates``' masked leaves)."""
  if bc_stats is None or (isinstance(bc_stats.numerator_clip, (int, float))
                          and bc_stats.numerator_clip == 1.0):
    return updates
  return jax.tree.map(lambda u, n: u if isinstance(u, optax.MaskedNode) else n.astype(u.dtype),
                      updates, align(bc_stats.numerator, updates),
                      is_leaf=lambda x: isinstance(x, optax.MaskedNode))


def check_numerator(updates: PyTree, bc_stats: Optional[BCStats], transform: str) -> None:
  """Trace-time guard of a bias-corrected transform: its ``updates`` must be the very arrays
  ``bc_stats.numerator`` holds (masked leaves aside), as ``tx.update(stats.numerator, ...,
  bc_stats=stats)`` passes them through ``so.clip_by_global_norm``, ``collector_options``,
  ``optax.partition`` and ``inject_hyperparams``. An element before the transform that
  computes new updates, such as ``optax.clip_by_global_norm``, would feed it a numerator that
  no longer matches the statistics ``collect`` gathered (clipped numerator, unclipped
  statistics): a ValueError naming ``so.clip_by_global_norm``. Skipped without ``bc_stats``
  and under a numerator-only clip (whose numerator is scaled on purpose).

  The check compares Python objects, so it also refuses a numerator passed apart from its
  ``bc_stats`` (a copy, or a separate argument of a jitted ``tx.update``): call ``collect``
  and ``tx.update`` in one trace.
  """
  clip = None if bc_stats is None else bc_stats.numerator_clip
  if bc_stats is None or not (isinstance(clip, (int, float)) and clip == 1.0):
    return
  masked = lambda x: isinstance(x, optax.MaskedNode)
  fed = jax.tree.leaves(updates, is_leaf=masked)
  collected = jax.tree.leaves(align(bc_stats.numerator, updates), is_leaf=masked)
  if any(u is not n for u, n in zip(fed, collected) if not masked(u)):
    raise ValueError(
        f"{transform} was given updates that are not bc_stats.numerator: an element before it "
        "in the chain changed them (optax.clip_by_global_norm clips the numerator but not the "
        "statistics that collect gathered); clip with scaleopt.optim.clip_by_global_norm "
        "(so.clip_by_global_norm) instead, and call tx.update(stats.numerator, ..., "
        "bc_stats=stats) in the same trace as collect")


def clip_factor(g: PyTree, max_norm) -> jax.Array:
  """min(1, max_norm / ||g||), as ``optax.clip_by_global_norm``."""
  norm = optax.tree.norm(g)
  return jnp.where(norm < max_norm, 1.0, max_norm / jnp.maximum(norm, 1e-30))


def scale_group(s: Optional[GroupStats], c, var_of: Optional[str]) -> Optional[GroupStats]:
  """The statistics of the gradients c g_j: mean c, squares c^2, Var c^2 (grad) or c^4 (sq)."""
  if s is None:
    return None
  sc = lambda t, k: None if t is None else jax.tree.map(lambda x: x * k, t)
  kv = {"grad": c * c, "sq": c ** 4}.get(var_of, 1.0)
  return GroupStats(sc(s.mean, c), sc(s.sq, c * c), sc(s.var, kv), s.count)


class ClipState(NamedTuple):
  """State of ``clip_by_global_norm``: the collector spec and the live ``max_norm``."""
  spec: Static
  hp: dict


register_bc_state(ClipState)


def clip_by_global_norm(max_norm: float, *, numerator_only: bool = False
                        ) -> optax.GradientTransformationExtraArgs:
  """Global-norm clipping that composes with bias-corrected transforms.

  With ``bc_stats`` (from ``collect``) the collector has already scaled every statistic by
  c = min(1, max_norm / ||g_full||) and this transform passes the updates through. Without
  ``bc_stats`` it is ``optax.clip_by_global_norm``. ``numerator_only=True`` (the reference
  code's behaviour) leaves the statistics alone and scales only the numerator by
  c = min(1, max_norm / ||numerator||) (``bc_stats.numerator_clip``); the transforms take
  their second-moment statistics from the unclipped ``bc_stats.numerator``.
  """
  spec = CollectorSpec(layout=None, clip="numerator" if numerator_only else "consistent")

  def init_fn(params):
    del params
    return ClipState(Static(spec), {"max_norm": jnp.asarray(max_norm, jnp.float32)})

  def update_fn(updates, state, params=None, *, bc_stats: Optional[BCStats] = None, **_):
    del params
    if bc_stats is None:
      updates, _ = optax.clip_by_global_norm(max_norm).update(updates, optax.EmptyState())
    elif numerator_only:
      c = bc_stats.numerator_clip
      updates = jax.tree.map(lambda u: (u * c).astype(u.dtype), updates)
    return updates, ClipState(state.spec, {"max_norm": jnp.asarray(max_norm, jnp.float32)})

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
