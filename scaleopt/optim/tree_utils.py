"""Pytree helpers shared by the optimizers: trees under ``optax.partition`` (whose masked-out
branches hold ``optax.MaskedNode`` leaves), option checks and the per-tensor finite guard."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

PyTree = Any


def is_masked(x) -> bool:
  """Whether ``x`` is a leaf that ``optax.partition`` masked out (``optax.MaskedNode``)."""
  return isinstance(x, optax.MaskedNode)


def tmap(fn: Callable, *trees):
  """``jax.tree.map`` that passes MaskedNode leaves of the first tree through."""
  return jax.tree.map(lambda x, *r: x if is_masked(x) else fn(x, *r), *trees, is_leaf=is_masked)


def unzip(out: PyTree, like: PyTree, n: int) -> tuple:
  """n trees from a tree of n-tuples (built by ``tmap`` over ``like``)."""
  return tuple(jax.tree.map(lambda u, o: u if is_masked(u) else o[i], like, out,
                            is_leaf=is_masked)
               for i in range(n))


def check_choice(name: str, value, allowed):
  """A ValueError naming ``name``, ``value`` and the allowed values unless ``value`` is one."""
  if value not in allowed:
    raise ValueError(f"{name}={value!r} is not allowed; choose one of {allowed}")


def keep_finite(u, pairs, also=None):
  """Per tensor: where u (or ``also``) is not finite, zero u and keep the old state leaves.

  ``pairs``: ((new, old), ...) state trees. Returns (u, [new trees], number of skipped tensors).
  """
  ok = tmap(lambda x: jnp.all(jnp.isfinite(x)), u)
  if also is not None:
    ok = tmap(lambda o, a: o & jnp.all(jnp.isfinite(a)), ok, also)
  pick = lambda new, old: tmap(lambda o, n, p: jnp.where(o, n, p), ok, new, old)
  skipped = jnp.asarray(sum(jnp.sum(~o) for o in jax.tree.leaves(ok)), jnp.int32)
  return pick(u, tmap(jnp.zeros_like, u)), [pick(n, o) for n, o in pairs], skipped
