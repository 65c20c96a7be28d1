"""Per-microbatch statistics for bias-corrected preconditioning.

Optax transforms see one gradient pytree, but every bias correction of Nayak et al.
(arXiv 2605.20756) needs more: the mean gradient of one group of microbatches (the
numerator), a preconditioner statistic from another, independent group, and the spread of
per-microbatch quantities (for the delta-method correction of the inverse). This module
computes all of it inside a jitted step with ``lax.scan`` over the microbatches, in float32,
with memory that does not depend on the number of microbatches m: the scan carries running
sums and Welford accumulators, never m gradient copies.

For a per-microbatch quantity x_j, j = 1..m, Welford's algorithm keeps (mean, M2) with

    delta = x_j - mean_{j-1};  mean_j = mean_{j-1} + delta / j;  M2_j = M2_{j-1} + delta (x_j - mean_j)

and the variance of the group mean is Var(x_bar) = M2 / (m (m - 1)).

Layouts (who is numerator, who is preconditioner):

* ``all``: one group of all m microbatches (std and inv-only modes); ``a`` and ``b`` are the same.
* ``ab``: first half A (numerator), second half B (preconditioner).
* ``rolling_b``: A = ``microbatches``, B = ``b_microbatches`` passed by the caller (the data
  pipeline gives step t's B as step t+1's A).
* ``symmetric``: halves A and B, both with full statistics (two-fold symmetrized cross-fit).
* ``loo``: leave-one-out; pass 1 computes g_full, pass 2 recomputes every g_r and feeds
  ``fold_fn(g_r, g_full)``; the scan averages its first output and Welfords its second.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

PyTree = Any
LossFn = Callable[[PyTree, PyTree], tuple[jax.Array, PyTree]]
GradFn = Callable[[PyTree, PyTree], tuple[jax.Array, PyTree, PyTree]]

LAYOUTS = ("all", "ab", "rolling_b", "symmetric", "loo")
VAR_OF = (None, "grad", "sq")
ESTIMATORS = (None, "gnb", "hutchinson", "shampoo")


class GroupStats(NamedTuple):
  """Statistics of one group of m microbatches, all float32.

  Attributes:
    mean: mean gradient g_bar = (1/m) sum_j g_j.
    sq: mean of per-microbatch squares (1/m) sum_j g_j * g_j (None when not collected).
    var: variance of the group mean of the tracked quantity x_j, M2 / (m (m - 1)):
      x_j = g_j for ``var_of="grad"``, x_j = g_j * g_j for ``var_of="sq"``, or
      ``var_fn(g_j)``. None when not collected; zeros when m < 2.
    count: m, the number of microbatches in the group (a scalar array).
  """
  mean: PyTree
  sq: Optional[PyTree]
  var: Optional[PyTree]
  count: jax.Array


class LOOStats(NamedTuple):
  """Leave-one-out fold statistics.

  Attributes:
    mean: (1/m) sum_r fold_fn(g_r, g_full)[0].
    var: sample variance over folds of fold_fn(g_r, g_full)[1], M2 / (m - 1) (the
      reference code's estimator; see docs/optim.md for why it is not divided by m).
  """
  mean: PyTree
  var: PyTree


class BCStats(NamedTuple):
  """What the collector returns and the bias-corrected transforms read (``bc_stats=``).

  Attributes:
    numerator: the gradient an Optax chain receives as ``updates``: group A's mean for the
      A/B layouts, the full-batch mean otherwise.
    full: mean gradient over every microbatch of the step (persistent moments, warm-up).
    a: numerator group (A); for layout ``all`` the single group.
    b: preconditioner group (B); for layout ``all`` the same object as ``a``.
    loo: leave-one-out fold statistics (layout ``loo`` only).
    loss: mean loss over the step's microbatches (group A and B together).
    aux: mean of the loss function's auxiliary outputs.
    precond: statistics of an optimizer-specific estimator pass, filled by
      ``sophia.sophia_collect`` (curvature) and ``shampoo.shampoo_collect`` (factor
      statistics); None from ``collect``.
  """
  numerator: PyTree
  full: PyTree
  a: Optional[GroupStats]
  b: Optional[GroupStats]
  loo: Optional[LOOStats]
  loss: jax.Array
  aux: PyTree
  precond: Any = None  # optimizer-specific estimator output (Sophia, Shampoo); None otherwise


@dataclasses.dataclass(frozen=True)
class CollectorSpec:
  """Which statistics an optimizer needs; ``build`` returns one next to its transform.

  Attributes:
    layout: one of LAYOUTS.
    var_of: which per-microbatch quantity gets a Welford variance: None (no variance),
      ``"grad"`` (g_j) or ``"sq"`` (g_j * g_j).
    need_sq: also return the mean of per-microbatch squares.
    fold_fn_factory: for ``loo``: ``opt_state -> fold_fn(g_r, g_full, m)``.
    estimator: extra pass the optimizer needs: None, ``"gnb"`` / ``"hutchinson"`` (Sophia's
      curvature, ``sophia.sophia_collect``) or ``"shampoo"`` (factor statistics,
      ``shampoo.shampoo_collect``); ``build.collect_step`` dispatches on it.
    refresh_every: the estimator pass runs on steps with count % refresh_every == 0 (under
      ``lax.cond``); other steps only need group A (and, for ``ab``, use both halves).
    needs_logits: the estimator needs ``logits_fn`` (GNB).
    needs_key: the estimator needs a PRNG key per step.
    estimator_options: static settings of the estimator pass, a tuple of (name, value) pairs.
  """
  layout: str = "all"
  var_of: Optional[str] = None
  need_sq: bool = False
  fold_fn_factory: Optional[Callable[[PyTree], Callable]] = None
  estimator: Optional[str] = None
  refresh_every: int = 1
  needs_logits: bool = False
  needs_key: bool = False
  estimator_options: tuple = ()

  def __post_init__(self):
    if self.layout not in LAYOUTS:
      raise ValueError(f"CollectorSpec.layout={self.layout!r}; allowed: {LAYOUTS}")
    if self.var_of not in VAR_OF:
      raise ValueError(f"CollectorSpec.var_of={self.var_of!r}; allowed: {VAR_OF}")
    if self.estimator not in ESTIMATORS:
      raise ValueError(f"CollectorSpec.estimator={self.estimator!r}; allowed: {ESTIMATORS}")
    if self.refresh_every < 1:
      raise ValueError(f"CollectorSpec.refresh_every={self.refresh_every!r} must be >= 1")
    if self.layout == "loo" and self.fold_fn_factory is None:
      raise ValueError("CollectorSpec(layout='loo') needs fold_fn_factory")

  @property
  def num_groups(self) -> int:
    """Microbatch groups per step the data pipeline must deliver (rolling-B counts one)."""
    return 2 if self.layout in ("ab", "symmetric") else 1


def _f32(tree: PyTree) -> PyTree:
  return jax.tree.map(lambda x: x.astype(jnp.float32), tree)


def _zeros_f32(tree: PyTree) -> PyTree:
  return jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), tree)


def value_and_grad_fn(loss_fn: LossFn) -> GradFn:
  """(params, mb) -> (loss, aux, grads) for ``loss_fn(params, mb) -> (loss, aux)``."""
  vg = jax.value_and_grad(loss_fn, has_aux=True)

  def fn(params, mb):
    (loss, aux), g = vg(params, mb)
    return loss, aux, g

  return fn


def _num_microbatches(microbatches: PyTree) -> int:
  leaves = jax.tree.leaves(microbatches)
  if not leaves:
    raise ValueError("microbatches is an empty pytree")
  m = leaves[0].shape[0]
  for x in leaves:
    if x.shape[0] != m:
      raise ValueError("every microbatch leaf needs the same leading axis (the microbatch "
                       f"count); got {[l.shape for l in leaves]}")
  return m


def _slice(tree: PyTree, start: int, stop: int) -> PyTree:
  return jax.tree.map(lambda x: x[start:stop], tree)


def _abstract_grads(grad_fn: GradFn, params: PyTree, mbs: PyTree):
  mb0 = jax.tree.map(lambda x: x[0], mbs)
  return jax.eval_shape(grad_fn, params, mb0)


def _group(grad_fn: GradFn, params: PyTree, mbs: PyTree, *, var_of: Optional[str],
           var_fn: Optional[Callable], need_sq: bool) -> tuple[GroupStats, jax.Array, PyTree]:
  """One scan over a group: returns (GroupStats, mean loss, mean aux)."""
  m = _num_microbatches(mbs)
  loss_s, aux_s, g_s = _abstract_grads(grad_fn, params, mbs)
  zeros_g = _zeros_f32(g_s)
  if var_fn is not None:
    x_s = jax.eval_shape(var_fn, g_s)
    zeros_x = _zeros_f32(x_s)
  elif var_of == "sq":
    zeros_x = zeros_g
  else:
    zeros_x = None
  track_sq = need_sq and var_of != "grad" and var_of != "sq"
  carry0 = dict(
      n=jnp.zeros((), jnp.float32),
      g=zeros_g,                            # Welford mean of g (var_of="grad") or running sum
      m2g=zeros_g if var_of == "grad" else None,
      x=zeros_x,                            # Welford mean of x_j
      m2x=zeros_x,
      sq=zeros_g if track_sq else None,     # running sum of g_j^2
      loss=jnp.zeros((), jnp.float32),
      aux=_zeros_f32(aux_s),
  )

  def welford(mean, m2, x, n):
    def one(mu, s, xi):
      delta = xi - mu
      mu = mu + delta / n
      return mu, s + delta * (xi - mu)
    pairs = jax.tree.map(one, mean, m2, x)
    is_pair = lambda t: isinstance(t, tuple)
    return (jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair),
            jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair))

  def body(c, mb):
    loss, aux, g = grad_fn(params, mb)
    g = _f32(g)
    n = c["n"] + 1.0
    c = dict(c, n=n, loss=c["loss"] + loss.astype(jnp.float32),
             aux=jax.tree.map(lambda s, a: s + a.astype(jnp.float32), c["aux"], aux))
    if var_of == "grad":
      c["g"], c["m2g"] = welford(c["g"], c["m2g"], g, n)
    else:
      c["g"] = jax.tree.map(jnp.add, c["g"], g)
    if var_fn is not None or var_of == "sq":
      x = _f32(var_fn(g)) if var_fn is not None else jax.tree.map(lambda t: t * t, g)
      c["x"], c["m2x"] = welford(c["x"], c["m2x"], x, n)
    if track_sq:
      c["sq"] = jax.tree.map(lambda s, t: s + t * t, c["sq"], g)
    return c, None

  c, _ = jax.lax.scan(body, carry0, mbs)
  inv_m = 1.0 / m
  var_den = 1.0 / (m * (m - 1)) if m > 1 else 0.0
  if var_of == "grad":
    mean = c["g"]
    var = jax.tree.map(lambda s: jnp.maximum(s * var_den, 0.0), c["m2g"]) if var_fn is None else None
    sq = (jax.tree.map(lambda s, mu: s * inv_m + mu * mu, c["m2g"], mean) if need_sq else None)
  else:
    mean = jax.tree.map(lambda s: s * inv_m, c["g"])
    var = None
    sq = jax.tree.map(lambda s: s * inv_m, c["sq"]) if track_sq else None
  if var_fn is not None or var_of == "sq":
    var = jax.tree.map(lambda s: jnp.maximum(s * var_den, 0.0), c["m2x"])
    if var_of == "sq" and var_fn is None:
      sq = c["x"]
  stats = GroupStats(mean=mean, sq=sq, var=var, count=jnp.asarray(m, jnp.int32))
  return stats, c["loss"] * inv_m, jax.tree.map(lambda s: s * inv_m, c["aux"])


def _loo(grad_fn: GradFn, params: PyTree, mbs: PyTree, fold_fn: Callable):
  """Two passes: g_full, then per fold r: fold_fn(g_r, g_full, m) -> (terms, d)."""
  m = _num_microbatches(mbs)
  if m < 2:
    raise ValueError(f"leave-one-out needs at least 2 microbatches, got m={m}")
  full, loss, aux = _group(grad_fn, params, mbs, var_of=None, var_fn=None, need_sq=False)
  g_full = full.mean
  _, _, g_s = _abstract_grads(grad_fn, params, mbs)
  terms_s, d_s = jax.eval_shape(lambda g: fold_fn(g, g, m), g_s)
  carry0 = dict(n=jnp.zeros((), jnp.float32), t=_zeros_f32(terms_s), d=_zeros_f32(d_s),
                m2=_zeros_f32(d_s))

  def body(c, mb):
    _, _, g = grad_fn(params, mb)
    terms, d = fold_fn(_f32(g), g_full, m)
    n = c["n"] + 1.0
    t = jax.tree.map(lambda s, x: s + x, c["t"], terms)
    def one(mu, s, x):
      delta = x - mu
      mu = mu + delta / n
      return mu, s + delta * (x - mu)
    pairs = jax.tree.map(one, c["d"], c["m2"], d)
    is_pair = lambda p: isinstance(p, tuple)
    return dict(n=n, t=t, d=jax.tree.map(lambda p: p[0], pairs, is_leaf=is_pair),
                m2=jax.tree.map(lambda p: p[1], pairs, is_leaf=is_pair)), None

  c, _ = jax.lax.scan(body, carry0, mbs)
  loo = LOOStats(mean=jax.tree.map(lambda s: s / m, c["t"]),
                 var=jax.tree.map(lambda s: jnp.maximum(s / (m - 1), 0.0), c["m2"]))
  return BCStats(numerator=g_full, full=g_full, a=None, b=None, loo=loo, loss=loss, aux=aux)


def collect(loss_fn: LossFn, params: PyTree, microbatches: PyTree,
            spec: CollectorSpec = CollectorSpec(), *, b_microbatches: PyTree = None,
            opt_state: PyTree = None, b_grad_fn: Optional[GradFn] = None,
            var_fn: Optional[Callable] = None) -> BCStats:
  """Scans ``loss_fn`` over microbatches and returns what the transforms need.

  Args:
    loss_fn: ``loss_fn(params, microbatch) -> (loss, aux)``; differentiated w.r.t. params.
    params: the parameters, shared by every microbatch of the step.
    microbatches: a pytree whose leaves have a leading microbatch axis m.
    spec: the layout and statistics to collect (``build`` returns one per optimizer).
    b_microbatches: group B for ``rolling_b`` (step t+1's A).
    opt_state: the optimizer state before this step; needed by ``loo`` fold functions.
    b_grad_fn: gradient function for group B, ``(params, mb) -> (loss, aux, grads)``
      (e.g. Sophia's sampled-label pass); defaults to the gradient of ``loss_fn``.
    var_fn: optional per-microbatch quantity x_j = var_fn(g_j) whose Welford variance
      replaces the one named by ``spec.var_of`` in the B statistics.

  Returns:
    BCStats, float32.
  """
  grad_fn = value_and_grad_fn(loss_fn)
  gb = b_grad_fn or grad_fn
  m = _num_microbatches(microbatches)
  lay = spec.layout
  kw = dict(var_of=spec.var_of, var_fn=var_fn, need_sq=spec.need_sq)
  if spec.var_of is not None and lay in ("all", "ab", "symmetric"):
    m_var = m if lay == "all" else m // 2
    if m_var < 2:
      raise ValueError(f"a variance correction needs at least 2 microbatches per group; layout "
                       f"{lay!r} with m={m} microbatches gives {m_var}")
  if lay == "loo":
    return _loo(grad_fn, params, microbatches, spec.fold_fn_factory(opt_state))
  if lay == "all":
    s, loss, aux = _group(gb, params, microbatches, **kw)
    return BCStats(numerator=s.mean, full=s.mean, a=s, b=s, loo=None, loss=loss, aux=aux)
  if lay == "rolling_b":
    if b_microbatches is None:
      raise ValueError("layout 'rolling_b' needs b_microbatches (next step's group A)")
    mbs_a, mbs_b = microbatches, b_microbatches
    if spec.var_of is not None and _num_microbatches(mbs_b) < 2:
      raise ValueError("a variance correction needs at least 2 microbatches in group B")
  else:
    if m % 2:
      raise ValueError(f"layout {lay!r} splits the microbatches in halves; m={m} is odd")
    mbs_a, mbs_b = _slice(microbatches, 0, m // 2), _slice(microbatches, m // 2, m)
  a_kw = kw if lay == "symmetric" else dict(var_of=None, var_fn=None, need_sq=False)
  a, loss_a, aux_a = _group(grad_fn, params, mbs_a, **a_kw)
  b, loss_b, aux_b = _group(gb, params, mbs_b, **kw)
  na, nb = a.count.astype(jnp.float32), b.count.astype(jnp.float32)
  wa, wb = na / (na + nb), nb / (na + nb)
  full = jax.tree.map(lambda x, y: wa * x + wb * y, a.mean, b.mean)
  loss = wa * loss_a + wb * loss_b
  aux = jax.tree.map(lambda x, y: wa * x + wb * y, aux_a, aux_b)
  numerator = full if lay == "symmetric" else a.mean
  return BCStats(numerator=numerator, full=full, a=a, b=b, loo=None, loss=loss, aux=aux)


def refresh_groups(loss_fn: LossFn, params: PyTree, microbatches: PyTree, layout: str,
                   refresh: jax.Array, b_microbatches: PyTree = None) -> tuple[BCStats, PyTree]:
  """Numerator statistics and preconditioner group for optimizers with periodic refreshes.

  Sophia and Shampoo recompute their preconditioner every k steps from group B. ``ab``: on
  refresh steps the numerator uses group A only (cross-fit), on the other steps all
  microbatches (``lax.cond``, so nothing is wasted); ``rolling_b``: A is ``microbatches`` and
  B is ``b_microbatches``; ``all``: both use every microbatch.

  Returns:
    (numerator BCStats from a plain ``all`` collection, group-B microbatches).
  """
  m = _num_microbatches(microbatches)
  all_spec = CollectorSpec(layout="all")
  if layout == "ab":
    if m % 2:
      raise ValueError(f"layout 'ab' splits the microbatches in halves; m={m} is odd")
    mbs_a, mbs_b = _slice(microbatches, 0, m // 2), _slice(microbatches, m // 2, m)
    num = jax.lax.cond(refresh, lambda: collect(loss_fn, params, mbs_a, all_spec),
                       lambda: collect(loss_fn, params, microbatches, all_spec))
    return num, mbs_b
  num = collect(loss_fn, params, microbatches, all_spec)
  if layout == "rolling_b":
    if b_microbatches is None:
      raise ValueError("layout 'rolling_b' needs b_microbatches (next step's group A)")
    return num, b_microbatches
  return num, microbatches
