"""The collector's statistics: a group's mean and spread, the leave-one-out terms, what the
transforms receive (``BCStats``), and Welford's running mean and variance."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp


PyTree = Any
LossFn = Callable[[PyTree, PyTree], tuple[jax.Array, PyTree]]
GradFn = Callable[[PyTree, PyTree], tuple[jax.Array, PyTree, PyTree]]


class GroupStats(NamedTuple):
  """Statistics of one group of m microbatches, all float32.

  Attributes:
    mean: mean gradient g_bar = (1/m) sum_j g_j.
    sq: mean of per-microbatch squares (1/m) sum_j g_j * g_j (None when not collected).
    var: variance of the group mean of the tracked quantity x_j, M2 / (m (m - 1)):
      x_j = g_j (``var_of="grad"``), g_j * g_j (``"sq"``) or the reference post-EMA
      denominator p_j (``"post_ema"``). None when not collected.
    count: m, the number of microbatches in the group (a Python int).
  """
  mean: PyTree
  sq: Optional[PyTree]
  var: Optional[PyTree]
  count: int


class LOOStats(NamedTuple):
  """Leave-one-out fold statistics: mean over folds of the fold terms, the sample variance
  over folds (1/(m-1)) sum_r (d_r - mean d)^2 of the fold denominators (the reference code's
  estimator) and m."""
  mean: PyTree
  var: PyTree
  count: int = 0


class BCStats(NamedTuple):
  """What ``collect`` returns and the bias-corrected transforms read (``bc_stats=``).

  Attributes:
    numerator: the gradient the Optax chain receives as ``updates``: group A's mean for the
      A/B layouts, the full-batch mean otherwise.
    full: mean gradient over the step's own microbatches (every microbatch; A for rolling_b
      and, on Sophia's refresh steps of the ab layout, the numerator group A).
    a: numerator group (A); for layout ``all`` the single group.
    b: preconditioner group (B); for layout ``all`` the same object as ``a``.
    loo: leave-one-out fold statistics (layout ``loo`` only).
    loss: mean loss over the step's own microbatches (as ``full``).
    aux: mean of the loss function's auxiliary outputs (as ``loss``).
    clip_factor: the clip factor c applied to the statistics (1.0 without clipping).
    numerator_clip: the reference clip's factor min(1, max_norm / ||numerator||), applied to
      the numerator alone (``clip_by_global_norm(..., numerator_only=True)``; 1.0 otherwise).
    precond: optimizer-specific estimator output (Sophia's curvature, Shampoo's factor
      statistics); None otherwise.
  """
  numerator: PyTree
  full: PyTree
  a: Optional[GroupStats]
  b: Optional[GroupStats]
  loo: Optional[LOOStats]
  loss: jax.Array
  aux: PyTree
  clip_factor: jax.Array = 1.0
  precond: Any = None
  numerator_clip: jax.Array = 1.0


class Welford(NamedTuple):
  """Streaming mean and sum of squared deviations of a pytree quantity."""
  n: jax.Array
  mean: PyTree
  m2: PyTree


def welford_init(like: PyTree) -> Welford:
  z = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), like)
  return Welford(jnp.zeros((), jnp.float32), z, z)


def welford_add(w: Welford, x: PyTree) -> Welford:
  n = w.n + 1.0
  delta = jax.tree.map(lambda xi, mu: xi - mu, x, w.mean)
  mean = jax.tree.map(lambda mu, d: mu + d / n, w.mean, delta)
  m2 = jax.tree.map(lambda s, d, xi, mu: s + d * (xi - mu), w.m2, delta, x, mean)
  return Welford(n, mean, m2)


def welford_of(xs: PyTree) -> Welford:
  """(n, mean, M2) of the stacked values ``xs`` (leading axis n) in one reduction:
  mean = (1/n) sum_j x_j, M2 = sum_j (x_j - mean)^2 (the streaming result up to rounding)."""
  n = jax.tree.leaves(xs)[0].shape[0]
  mean = jax.tree.map(lambda x: jnp.mean(x.astype(jnp.float32), axis=0), xs)
  m2 = jax.tree.map(lambda x, mu: jnp.sum(jnp.square(x - mu), axis=0), xs, mean)
  return Welford(jnp.float32(n), mean, m2)


def welford_merge(a: Welford, b: Welford) -> Welford:
  """Chan et al.'s merge: n = n_a + n_b, d = mean_b - mean_a, mean = mean_a + d n_b / n,
  M2 = M2_a + M2_b + d^2 n_a n_b / n."""
  n = a.n + b.n
  d = jax.tree.map(lambda x, y: y - x, a.mean, b.mean)
  mean = jax.tree.map(lambda mu, di: mu + di * (b.n / n), a.mean, d)
  m2 = jax.tree.map(lambda x, y, di: x + y + di * di * (a.n * b.n / n), a.m2, b.m2, d)
  return Welford(n, mean, m2)


def welford_var_of_mean(w: Welford, m: int) -> PyTree:
  """Unbiased Var(x_bar) = M2 / (m (m - 1)); zeros for m < 2."""
  den = 1.0 / (m * (m - 1)) if m > 1 else 0.0
  return jax.tree.map(lambda s: jnp.maximum(s * den, 0.0), w.m2)
