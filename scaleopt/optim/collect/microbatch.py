"""Microbatch gradients: ``lax.scan`` (or ``vmap``) over microbatches, split over a mesh axis
where one is set, with each group's statistics; the refresh steps' group statistics."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax
try:  # the module moved across jax releases; without it the stack shards by propagation alone
  from jax.experimental.shard_alike import shard_alike
except ImportError:
  shard_alike = getattr(jax.lax, "shard_alike", None) or getattr(jax.sharding, "shard_alike", None)
from jax.sharding import NamedSharding, PartitionSpec as P

from scaleopt.optim import phases
from scaleopt.optim.collect.stats import (GradFn, GroupStats, LossFn, PyTree, welford_add,
                                          welford_init, welford_merge, welford_of,
                                          welford_var_of_mean)


def value_and_grad_fn(loss_fn: LossFn) -> GradFn:
  """(params, mb) -> (loss, aux, grads) for ``loss_fn(params, mb) -> (loss, aux)``."""
  vg = jax.value_and_grad(loss_fn, has_aux=True)

  def fn(params, mb):
    (loss, aux), g = vg(params, mb)
    return loss, aux, g

  return fn


def num_microbatches(microbatches: PyTree) -> int:
  leaves = jax.tree.leaves(microbatches)
  if not leaves:
    raise ValueError("microbatches is an empty pytree")
  m = leaves[0].shape[0]
  if any(x.shape[0] != m for x in leaves):
    raise ValueError("every microbatch leaf needs the same leading axis (the microbatch "
                     f"count); got {[x.shape for x in leaves]}")
  return m


def halves(microbatches: PyTree, what: str) -> tuple[PyTree, PyTree]:
  m = num_microbatches(microbatches)
  if m % 2:
    raise ValueError(f"{what} splits the microbatches in halves; m={m} is odd")
  return (jax.tree.map(lambda x: x[:m // 2], microbatches),
          jax.tree.map(lambda x: x[m // 2:], microbatches))


def as_float32(tree: PyTree) -> PyTree:
  return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def _like(g: PyTree, params: PyTree) -> PyTree:
  """Each gradient leaf sharded as its parameter (``shard_alike``: no mesh needed); the
  stacked [m, ...] buffer of one-pass LOO then splits its parameter axes over the devices
  that split the parameter (FSDP) instead of being left to propagation, which can
  replicate it."""
  if shard_alike is None:
    return g
  return jax.tree.map(lambda x, p: shard_alike(x, p)[0] if jnp.shape(x) == jnp.shape(p) else x,
                      g, params)


def _stored(g: PyTree, dtype) -> PyTree:
  """A microbatch gradient as one-pass LOO stores it: in ``dtype`` (round to nearest). bfloat16
  is kept as its bits (uint16), which XLA's float normalization leaves alone (a bfloat16 stack
  would be widened to float32 as a whole on backends without bfloat16 arithmetic)."""
  if dtype == jnp.bfloat16:
    return jax.tree.map(
        lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16), g)
  return jax.tree.map(lambda x: x.astype(dtype), g)


def stored_as_float32(g: PyTree) -> PyTree:
  """One stored gradient in float32 as the fold reads it (exact: bfloat16 is float32's upper
  half)."""
  def up(x):
    if x.dtype != jnp.uint16:
      return x
    return jax.lax.bitcast_convert_type(x.astype(jnp.uint32) << 16, jnp.float32)
  return jax.tree.map(up, g)


def zeros_like_output(fn: Callable, *args) -> PyTree:
  return jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), jax.eval_shape(fn, *args))


class MicrobatchAxis(NamedTuple):
  """Where vmapped microbatches live on a device mesh (``collect(..., microbatch_axis=)``).

  With ``vmap_microbatches`` and m divisible by ``size``, the microbatch axis is split over the
  mesh axis ``name`` (``jax.vmap``'s ``spmd_axis_name``): each device computes the gradients
  of its own m / size microbatches, and the forward and backward passes communicate nothing
  but the token ids' move to their devices. ``context()`` is entered while the microbatch
  function traces (the model's own constraints then leave ``name`` to the microbatch axis).
  Where m is not divisible the microbatches are vmapped unsplit.

  ``spread`` reshards the stacked per-microbatch outputs ``[m, ...]`` so that every device
  holds all m microbatches of its slice of each leaf (an all-to-all); the statistics are then
  folded on the slices with the ordinary scan, locally, and the optimizer can update its
  slice in place (ZeRO-1). Without ``spread`` the statistics are sums over the split axis:
  an all-reduce per parameter-sized sum (the gradient, each fold term, the LOO variance's two
  sums; a Welford variance's mean, then its M2).
  """
  name: str
  size: int
  context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
  mesh: Any = None  # with a mesh, the stacked outputs are pinned to the split axis
  spread: Optional[Callable[[PyTree], PyTree]] = None

  def pin(self, tree: PyTree) -> PyTree:
    """Stacked per-microbatch outputs with their leading axis on ``name`` (other axes free)."""
    if self.mesh is None:
      return tree
    sh = lambda x: NamedSharding(self.mesh, P(self.name, *[P.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sh(x)), tree)


def split_axis(m: int, axis: Optional[MicrobatchAxis]) -> Optional[MicrobatchAxis]:
  """``axis`` if it splits ``m`` microbatches evenly (and has > 1 device), else None."""
  return axis if axis is not None and axis.size > 1 and m % axis.size == 0 else None


def spreads(m: int, axis: Optional[MicrobatchAxis]) -> bool:
  """Whether ``axis`` splits ``m`` microbatches and spreads their outputs in slices."""
  ax = split_axis(m, axis)
  return ax is not None and ax.spread is not None


def vmap_over_axis(fn: Callable, m: int, axis: Optional[MicrobatchAxis]) -> Callable:
  """``jax.vmap(fn)`` over m microbatches, split over ``axis`` where it divides m."""
  ax = split_axis(m, axis)
  if ax is None:
    return jax.vmap(fn)

  def traced(x):
    with ax.context():
      return fn(x)

  return lambda xs: ax.pin(jax.vmap(traced, spmd_axis_name=ax.name)(ax.pin(xs)))


def fold_microbatches(fn: Callable, step: Callable, carry0, xs: PyTree, *, vmap: bool = False,
                      keep: Optional[Callable] = None, reduce: Optional[Callable] = None,
                      axis: Optional[MicrobatchAxis] = None):
  """carry_m of carry_j = step(carry_{j-1}, fn(x_j)) over the leading axis of ``xs``.

  Scan (default): ``fn`` runs inside a ``lax.scan``, one microbatch at a time (memory of one
  microbatch). ``vmap=True``: ``jax.vmap(fn)`` over all of ``xs`` at once (one batched call),
  then the scan runs ``step`` over its stacked outputs in the same order, so both give the same
  carry up to the rounding of the batched ``fn``. Where ``axis`` (a ``MicrobatchAxis``) splits the
  microbatches over devices, its ``spread`` reshards the stacked outputs into slices that hold
  every microbatch (the scan then runs locally on each slice; ``kept`` is in that layout);
  without ``spread``, ``reduce(carry0, stacked outputs)`` (the same carry by sums over the
  split axis) replaces that scan, which would gather every device's outputs.

  Returns:
    (carry, kept): ``kept`` stacks ``keep(fn(x_j))`` over j (None without ``keep``).
  """
  if vmap:
    m = num_microbatches(xs)
    ys = vmap_over_axis(fn, m, axis)(xs)
    ax = split_axis(m, axis)
    if ax is not None and ax.spread is not None:
      ys = ax.spread(ys)
    elif ax is not None and reduce is not None:
      return reduce(carry0, ys), (keep(ys) if keep else None)
    carry, _ = jax.lax.scan(lambda c, y: (step(c, y), None), carry0, ys)
    return carry, (keep(ys) if keep else None)

  def body(c, x):
    y = fn(x)
    return step(c, y), (keep(y) if keep else None)

  return jax.lax.scan(body, carry0, xs)


def sum0(t: PyTree) -> PyTree:
  """Sum over the leading (microbatch) axis of every leaf."""
  return jax.tree.map(lambda x: jnp.sum(x, axis=0), t)


def scan_group(grad_fn: GradFn, params: PyTree, mbs: PyTree, *, var_of: Optional[str] = None,
               x_fn: Optional[Callable] = None, need_sq: bool = False, vmap: bool = False,
               keep_grads: bool = False, keep_dtype=jnp.float32,
               axis: Optional[MicrobatchAxis] = None):
  """One pass over a group: (GroupStats, mean loss, mean aux), float32.

  ``x_fn(g_j)`` gives the per-microbatch quantity whose variance ``var_of`` asks for;
  ``vmap``, ``axis``: see ``fold_microbatches``. ``keep_grads=True`` also returns the stacked
  microbatch gradients (m x params, in ``keep_dtype``) as a fourth output.
  """
  m = num_microbatches(mbs)
  mb0 = jax.tree.map(lambda x: x[0], mbs)
  loss_s, aux_s, g_s = zeros_like_output(grad_fn, params, mb0)
  if var_of == "sq":
    x_fn = lambda g: jax.tree.map(lambda t: t * t, g)
  elif var_of == "grad":
    x_fn = lambda g: g
  carry0 = dict(g=g_s, sq=g_s if need_sq else None, loss=loss_s, aux=aux_s,
                w=welford_init(jax.eval_shape(x_fn, g_s)) if var_of else None)

  def fn(mb):
    loss, aux, g = grad_fn(params, mb)
    return loss, as_float32(aux), as_float32(g)

  def step(c, y):
    loss, aux, g = y
    c = dict(c, g=jax.tree.map(jnp.add, c["g"], g), loss=c["loss"] + loss,
             aux=jax.tree.map(jnp.add, c["aux"], aux))
    if need_sq:
      c["sq"] = jax.tree.map(lambda s, t: s + t * t, c["sq"], g)
    if var_of:
      c["w"] = welford_add(c["w"], x_fn(g))
    return c

  def reduce(c, ys):  # ``step`` over the stacked outputs, as sums over the microbatch axis
    loss, aux, g = ys
    add = lambda t, u: jax.tree.map(jnp.add, t, u)
    c = dict(c, g=add(c["g"], sum0(g)), loss=c["loss"] + jnp.sum(loss),
             aux=add(c["aux"], sum0(aux)))
    if need_sq:
      c["sq"] = add(c["sq"], sum0(jax.tree.map(jnp.square, g)))
    if var_of:
      c["w"] = welford_merge(c["w"], welford_of(jax.vmap(x_fn)(g)))
    return c

  c, kept = fold_microbatches(fn, step, carry0, mbs, vmap=vmap, reduce=reduce, axis=axis,
                              keep=(lambda y: _stored(_like(y[2], params), keep_dtype))
                              if keep_grads else None)
  mean = lambda t: jax.tree.map(lambda s: s / m, t)
  var = welford_var_of_mean(c["w"], m) if var_of else None
  stats = GroupStats(mean=mean(c["g"]), sq=mean(c["sq"]) if need_sq else None, var=var, count=m)
  out = (stats, c["loss"] / m, mean(c["aux"]))
  return out + (kept,) if keep_grads else out


def align(tree: PyTree, like: PyTree) -> PyTree:
  """``tree`` with MaskedNode wherever ``like`` (an updates tree under partition) has one."""
  masked = lambda x: isinstance(x, optax.MaskedNode)
  return jax.tree.map(lambda u, t: u if masked(u) else t, like, tree, is_leaf=masked)


def refresh_groups(grad_fn: GradFn, params: PyTree, microbatches: PyTree, layout: str,
                   refresh: jax.Array, b_microbatches: PyTree = None, *, vmap: bool = False,
                   a_every_step: bool = False, axis: Optional[MicrobatchAxis] = None):
  """Numerator group statistics and the preconditioner group for periodic refreshes.

  ``ab``: on refresh steps the numerator uses group A only (cross-fit), on the other steps
  all microbatches (``phases.cond``), or group A on every step with ``a_every_step`` (the
  authors' code: the momentum's noise level is then the same on every step); ``rolling_b``:
  A is ``microbatches``, B ``b_microbatches``; ``all``: both use every microbatch. ``vmap``,
  ``axis``: see ``fold_microbatches``.

  Returns:
    ((mean gradient, loss, aux) of the numerator group, group-B microbatches).
  """
  def num_of(mbs):
    s, loss, aux = scan_group(grad_fn, params, mbs, vmap=vmap, axis=axis)
    return s.mean, loss, aux

  if layout == "ab":
    mbs_a, mbs_b = halves(microbatches, "layout 'ab'")
    if a_every_step:
      return num_of(mbs_a), mbs_b
    num = phases.cond(refresh, lambda: num_of(mbs_a), lambda: num_of(microbatches))
    return num, mbs_b
  num = num_of(microbatches)
  if layout == "rolling_b":
    if b_microbatches is None:
      raise ValueError("layout 'rolling_b' needs b_microbatches (next step's group A)")
    return num, b_microbatches
  return num, microbatches
