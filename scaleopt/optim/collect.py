"""Per-microbatch statistics for bias-corrected preconditioning, derived from the optimizer state.

Optax transforms see one gradient pytree, but every bias correction of Nayak et al.
(arXiv 2605.20756) needs more: the mean gradient of one group of microbatches (the
numerator), a preconditioner statistic from another, independent group, and the spread of
per-microbatch quantities (for the delta-method correction of the inverse). ``collect``
computes all of it inside a jitted step with ``lax.scan`` over the microbatches, in float32,
with memory that does not depend on the number of microbatches m.

One source of truth. A bias-corrected transform writes what it needs into its own state: a
``CollectorSpec`` (static, hashable, in the state's tree structure) and the numeric
hyperparameters the collector uses (``hp``, scalar arrays). ``collect(loss_fn, params,
microbatches, opt_state)`` walks the state tree (through ``chain``, ``partition``,
``multi_transform``, ``inject_hyperparams``, ``MultiSteps``), finds every registered BC state
and merges their specs; under ``inject_hyperparams`` the live values of its ``hyperparams``
override ``hp``. A user never passes ``b2``, ``mode``, ``k`` or ``damping`` twice.

Welford's algorithm (written once here, used by every optimizer) keeps (n, mean, M2):

    delta = x_j - mean_{j-1};  mean_j = mean_{j-1} + delta / j;  M2_j = M2_{j-1} + delta (x_j - mean_j)

and the variance of the group mean is Var(x_bar) = M2 / (m (m - 1)) (unbiased).

Layouts (who is numerator, who is preconditioner):

* ``all``: one group of all m microbatches; ``a`` and ``b`` are the same.
* ``ab``: the step's 2m microbatches in halves, A (numerator) and B (preconditioner).
* ``rolling_b``: A = ``microbatches``, B = ``b_microbatches`` (step t+1's A); the step's own
  data is A, so ``full``, ``loss`` and the clip norm come from A alone.
* ``symmetric``: the step's m microbatches in halves A and B, both with full statistics (same
  examples and compute as std).
* ``loo``: leave-one-out; the BC states' fold functions run on every g_r given g_full; the
  collector averages their terms and Welfords their denominators. One pass (the default,
  ``loo_passes=1``): the scan that accumulates g_full also stores every g_r (stacked,
  float32: m x params x 4 bytes more, ~4 GB for GPT-2 small at m = 8; ``loo_storage=
  "bfloat16"`` halves it; each stored g_r is sharded like its parameter, so FSDP over n
  devices divides it by n) and the folds scan over the stored gradients (no second
  forward/backward). Two passes (``loo_passes=2``, for
  memory): pass 1 computes g_full, pass 2 recomputes every g_r (memory independent of m).
  Both give the same statistics (bit for bit on CPU).

Microbatch gradients (``vmap_microbatches``): by default every group is a ``lax.scan`` of one
forward/backward per microbatch (memory of one microbatch). With ``vmap_microbatches=True`` a
group's m gradients come from one ``jax.vmap`` over the microbatch axis (one batched
forward/backward, the efficiency of one large batch; memory: the group's activations plus
m x params float32 gradients), and the same statistics (same order of accumulation) run over
the stacked gradients. LOO then always folds the stored gradients (one pass). Both options are
set with ``collector_options`` (an element of the chain, like ``clip_by_global_norm``).

Clipping (``clip_by_global_norm`` of this module): one factor c = min(1, max_norm / ||g_full||)
from the full-batch gradient norm, applied to every statistic (means by c, squares and
variances of gradients by c^2, variances of squares by c^4, LOO folds on c g_r), so the
preconditioned update is the one of the clipped gradient stream, as ``optax`` composes clip
and Adam. ``numerator_only=True`` reproduces the reference code: c = min(1, max_norm /
||numerator||) scales what enters the first moment (``BCStats.numerator_clip``) and nothing
else; every second-moment statistic (Adam's v, the g_A^2 of the alpha mix, Shampoo's factors
and its AdamW fallback's v, the LOO folds) comes from the unclipped gradients, which the
transforms read from ``bc_stats.numerator``. The one exception is the reference's leave-one-out
form, whose persistent m and v both take the clipped g_full (its buffers alias the clipped
gradient).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
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

PyTree = Any
LossFn = Callable[[PyTree, PyTree], tuple[jax.Array, PyTree]]
GradFn = Callable[[PyTree, PyTree], tuple[jax.Array, PyTree, PyTree]]

LAYOUTS = ("all", "ab", "rolling_b", "symmetric", "loo")
VAR_OF = (None, "grad", "sq", "post_ema")
CLIPS = ("none", "consistent", "numerator")
LOO_PASSES = (None, 1, 2)
LOO_STORAGE = (None, "float32", "bfloat16")


# ----------------------------------------------------------------------------- statistics

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
  over folds M2 / (m - 1) of the fold denominators (the reference code's estimator) and m."""
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


# ----------------------------------------------------------------------------- spec + registry

@dataclasses.dataclass(frozen=True)
class CollectorSpec:
  """Which statistics a chain needs (hashable; derived from the optimizer state).

  Attributes:
    layout: one of LAYOUTS, or None for "no preference" (std transforms).
    var_of: per-microbatch quantity whose Welford variance is collected (``VAR_OF``).
    need_sq: also return the mean of per-microbatch squares.
    estimator: name of a registered estimator pass (``"gnb"``, ``"hutchinson"``,
      ``"shampoo"``) that replaces the plain collector; None otherwise.
    refresh_every: the estimator runs on steps with count % refresh_every == 0.
    needs_logits, needs_key: the estimator needs ``logits_fn`` / a PRNG key.
    estimator_options: static settings of the estimator, a tuple of (name, value) pairs.
    clip: ``"none"``, ``"consistent"`` or ``"numerator"`` (see the module docstring).
    stateful: the statistics read the optimizer state (LOO folds, post-EMA denominators).
    loo_passes: 1 or 2 sweeps for the ``loo`` layout (None: no preference, 1).
    vmap_microbatches: per-microbatch gradients of a group by ``jax.vmap`` instead of
      ``lax.scan`` (None: no preference, scan).
    loo_storage: dtype of the m gradients one-pass LOO stores, ``"float32"`` or
      ``"bfloat16"`` (None: no preference, float32); the folds compute in float32.
  """
  layout: Optional[str] = "all"
  var_of: Optional[str] = None
  need_sq: bool = False
  estimator: Optional[str] = None
  refresh_every: int = 1
  needs_logits: bool = False
  needs_key: bool = False
  estimator_options: tuple = ()
  clip: str = "none"
  stateful: bool = False
  loo_passes: Optional[int] = None
  vmap_microbatches: Optional[bool] = None
  loo_storage: Optional[str] = None

  def __post_init__(self):
    for name, allowed in (("layout", LAYOUTS + (None,)), ("var_of", VAR_OF), ("clip", CLIPS)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"CollectorSpec.{name}={getattr(self, name)!r}; allowed: {allowed}")
    if self.loo_passes not in LOO_PASSES or type(self.loo_passes) not in (int, type(None)):
      raise ValueError(f"loo_passes={self.loo_passes!r} must be 1 or 2 (None: no preference)")
    if self.loo_storage not in LOO_STORAGE:
      raise ValueError(f"loo_storage={self.loo_storage!r} must be 'float32' or 'bfloat16' "
                       "(None: no preference)")
    if not isinstance(self.vmap_microbatches, (bool, type(None))):
      raise ValueError(f"vmap_microbatches={self.vmap_microbatches!r} must be a bool "
                       "(None: no preference)")
    if not isinstance(self.refresh_every, int) or self.refresh_every < 1:
      raise ValueError(f"CollectorSpec.refresh_every={self.refresh_every!r} must be an int >= 1")

  @property
  def num_groups(self) -> int:
    """Microbatch groups per step the data pipeline delivers (``ab`` only draws two)."""
    return 2 if self.layout == "ab" else 1

  @property
  def vmap(self) -> bool:
    """Per-microbatch gradients by ``jax.vmap`` (``vmap_microbatches``; default: scan)."""
    return bool(self.vmap_microbatches)

  @property
  def loo_one_pass(self) -> bool:
    """Leave-one-out folds on stored gradients: unless ``loo_passes=2`` (the default is one
    pass; vmapped microbatches always store them)."""
    return self.loo_passes != 2 or self.vmap

  @property
  def loo_dtype(self):
    """dtype of the stored microbatch gradients of one-pass LOO (``loo_storage``)."""
    return jnp.bfloat16 if self.loo_storage == "bfloat16" else jnp.float32

  @property
  def passes_per_step(self) -> float:
    """Forward+backward sweeps per step over the step's own examples (estimator passes of
    non-rolling layouts are not counted)."""
    if self.layout == "loo":
      return 1.0 if self.loo_one_pass else 2.0
    if self.layout == "rolling_b":
      return 1.0 + (1.0 / self.refresh_every if self.estimator else 1.0)
    return 1.0


@jax.tree_util.register_pytree_node_class
class Static:
  """A leafless pytree node carrying a hashable value in the tree structure (so it survives
  ``jit``, ``eval_shape``, ``MultiSteps``' tree maps and checkpoints without being an array)."""

  def __init__(self, value):
    self.value = value

  def tree_flatten(self):
    return (), self.value

  @classmethod
  def tree_unflatten(cls, value, _):
    return cls(value)

  def __eq__(self, other):
    return isinstance(other, Static) and other.value == self.value

  def __hash__(self):
    return hash(self.value)

  def __repr__(self):
    return f"Static({self.value!r})"


class StateHooks(NamedTuple):
  """Per-state-type functions the collector calls (None: not supported by that state).

  fold_fn(state, hp) -> fn(g_r, g_full, m) -> (terms, d): LOO fold terms.
  var_fn(state, hp) -> fn(g_j) -> x_j: per-microbatch quantity for ``var_of="post_ema"``.
  """
  fold_fn: Optional[Callable] = None
  var_fn: Optional[Callable] = None


_STATE_HOOKS: dict[type, StateHooks] = {}
_ESTIMATORS: dict[str, Callable] = {}


def register_bc_state(state_type: type, hooks: StateHooks = StateHooks()) -> None:
  """Registers a state type whose ``spec`` (``Static(CollectorSpec)``) and ``hp`` (dict of
  scalar arrays) fields tell ``collect`` what to compute."""
  _STATE_HOOKS[state_type] = hooks


def register_estimator(name: str, fn: Callable) -> None:
  """Registers an estimator pass ``fn(loss_fn, params, microbatches, spec, found, *, key,
  logits_fn, b_microbatches) -> BCStats`` used when a spec names ``estimator=name``."""
  _ESTIMATORS[name] = fn


class Found(NamedTuple):
  """A BC state found in an optimizer state, its live hyperparameters and context."""
  state: Any
  hp: dict
  under_multisteps: bool


def find_bc_states(opt_state: PyTree) -> list[Found]:
  """Every registered BC state inside ``opt_state``, in tree order."""
  out: list[Found] = []
  inject = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
  stop = inject + (optax.MultiStepsState,) + tuple(_STATE_HOOKS)

  def walk(tree, over, multi):
    for node in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, stop)):
      if isinstance(node, inject):
        walk(node.inner_state, {**over, **node.hyperparams}, multi)
      elif isinstance(node, optax.MultiStepsState):
        walk(node.inner_opt_state, over, True)
      elif type(node) in _STATE_HOOKS:
        hp = {k: over.get(k, v) for k, v in node.hp.items()}
        out.append(Found(node, hp, multi))

  walk(opt_state, {}, False)
  return out


def _merge(found: list[Found]) -> CollectorSpec:
  specs = [f.state.spec.value for f in found]
  pick = lambda name, skip: {getattr(s, name) for s in specs} - {skip}
  for name, skip in (("layout", None), ("var_of", None), ("estimator", None), ("clip", "none"),
                     ("loo_passes", None), ("vmap_microbatches", None),
                     ("loo_storage", None)):
    vals = pick(name, skip)
    if len(vals) > 1:
      raise ValueError(f"the optimizer chain holds bias-corrected transforms that need different "
                       f"{name}s {sorted(map(str, vals))}; one collector serves one {name}")
  est = [s for s in specs if s.estimator]
  if len({(s.refresh_every, s.estimator_options) for s in est}) > 1:
    raise ValueError("the chain holds two estimator transforms with different settings")
  one = lambda name, skip, default: next(iter(pick(name, skip)), default)
  base = est[0] if est else CollectorSpec()
  layout = one("layout", None, "all")
  out = dataclasses.replace(base, layout=layout, var_of=one("var_of", None, None),
                            need_sq=any(s.need_sq for s in specs),
                            clip=one("clip", "none", "none"),
                            stateful=any(s.stateful for s in specs),
                            loo_passes=one("loo_passes", None, None),
                            vmap_microbatches=one("vmap_microbatches", None, None),
                            loo_storage=one("loo_storage", None, None))
  if out.loo_passes is not None and layout != "loo":
    raise ValueError(f"loo_passes={out.loo_passes} applies to the leave-one-out layout; this "
                     f"chain's layout is {layout!r}")
  if out.loo_storage is not None and layout != "loo":
    raise ValueError(f"loo_storage={out.loo_storage!r} applies to the leave-one-out layout; "
                     f"this chain's layout is {layout!r}")
  if out.loo_storage is not None and not out.loo_one_pass:
    raise ValueError(f"loo_storage={out.loo_storage!r} sets how one-pass LOO stores the "
                     "microbatch gradients; loo_passes=2 stores none")
  if out.loo_passes == 2 and out.vmap:
    raise ValueError("vmap_microbatches=True stores every microbatch gradient, so the "
                     "leave-one-out folds run on the stored gradients: use loo_passes=1 (or "
                     "leave it unset) with it")
  return out


def collector_spec(tx_or_state, params: PyTree = None) -> CollectorSpec:
  """The merged ``CollectorSpec`` of an optimizer: pass its state, or the transform (then its
  state is traced abstractly from ``params``; an empty tree when None)."""
  state = tx_or_state
  if isinstance(tx_or_state, optax.GradientTransformation):
    state = jax.eval_shape(tx_or_state.init, {} if params is None else params)
  return _merge(find_bc_states(state))


# ----------------------------------------------------------------------------- scans

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


def _f32(tree: PyTree) -> PyTree:
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


def _one_slice(g: PyTree) -> PyTree:
  """One stored gradient in float32 as the fold reads it (exact: bfloat16 is float32's upper
  half)."""
  def up(x):
    if x.dtype != jnp.uint16:
      return x
    return jax.lax.bitcast_convert_type(x.astype(jnp.uint32) << 16, jnp.float32)
  return jax.tree.map(up, g)


def _zeros_like_out(fn: Callable, *args) -> PyTree:
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
  an all-reduce per parameter-sized sum (the gradient, each fold term, a Welford mean, then
  its M2).
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


_AXIS: contextvars.ContextVar[Optional[MicrobatchAxis]] = contextvars.ContextVar(
    "scaleopt_microbatch_axis", default=None)


def _split_axis(m: int) -> Optional[MicrobatchAxis]:
  """The active microbatch axis if it splits ``m`` microbatches evenly (and has > 1 device)."""
  ax = _AXIS.get()
  return ax if ax is not None and ax.size > 1 and m % ax.size == 0 else None


def _spreads(m: int) -> bool:
  """Whether the active axis splits ``m`` microbatches and spreads their outputs in slices."""
  ax = _split_axis(m)
  return ax is not None and ax.spread is not None


def _vmap(fn: Callable, m: int) -> Callable:
  ax = _split_axis(m)
  if ax is None:
    return jax.vmap(fn)

  def traced(x):
    with ax.context():
      return fn(x)

  return lambda xs: ax.pin(jax.vmap(traced, spmd_axis_name=ax.name)(ax.pin(xs)))


def fold_microbatches(fn: Callable, step: Callable, carry0, xs: PyTree, *, vmap: bool = False,
                      keep: Optional[Callable] = None, reduce: Optional[Callable] = None):
  """carry_m of carry_j = step(carry_{j-1}, fn(x_j)) over the leading axis of ``xs``.

  Scan (default): ``fn`` runs inside a ``lax.scan``, one microbatch at a time (memory of one
  microbatch). ``vmap=True``: ``jax.vmap(fn)`` over all of ``xs`` at once (one batched call),
  then the scan runs ``step`` over its stacked outputs in the same order, so both give the same
  carry up to the rounding of the batched ``fn``. Where a ``MicrobatchAxis`` splits the
  microbatches over devices, its ``spread`` reshards the stacked outputs into slices that hold
  every microbatch (the scan then runs locally on each slice; ``kept`` is in that layout);
  without ``spread``, ``reduce(carry0, stacked outputs)`` (the same carry by sums over the
  split axis) replaces that scan, which would gather every device's outputs.

  Returns:
    (carry, kept): ``kept`` stacks ``keep(fn(x_j))`` over j (None without ``keep``).
  """
  if vmap:
    m = num_microbatches(xs)
    ys = _vmap(fn, m)(xs)
    ax = _split_axis(m)
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
               keep_grads: bool = False, keep_dtype=jnp.float32):
  """One pass over a group: (GroupStats, mean loss, mean aux), float32.

  ``x_fn(g_j)`` gives the per-microbatch quantity whose variance ``var_of`` asks for;
  ``vmap``: see ``fold_microbatches``. ``keep_grads=True`` also returns the stacked
  microbatch gradients (m x params, in ``keep_dtype``) as a fourth output.
  """
  m = num_microbatches(mbs)
  mb0 = jax.tree.map(lambda x: x[0], mbs)
  loss_s, aux_s, g_s = _zeros_like_out(grad_fn, params, mb0)
  if var_of == "sq":
    x_fn = lambda g: jax.tree.map(lambda t: t * t, g)
  elif var_of == "grad":
    x_fn = lambda g: g
  carry0 = dict(g=g_s, sq=g_s if need_sq else None, loss=loss_s, aux=aux_s,
                w=welford_init(jax.eval_shape(x_fn, g_s)) if var_of else None)

  def fn(mb):
    loss, aux, g = grad_fn(params, mb)
    return loss, _f32(aux), _f32(g)

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

  c, kept = fold_microbatches(fn, step, carry0, mbs, vmap=vmap, reduce=reduce,
                              keep=(lambda y: _stored(_like(y[2], params), keep_dtype))
                              if keep_grads else None)
  mean = lambda t: jax.tree.map(lambda s: s / m, t)
  var = welford_var_of_mean(c["w"], m) if var_of else None
  stats = GroupStats(mean=mean(c["g"]), sq=mean(c["sq"]) if need_sq else None, var=var, count=m)
  out = (stats, c["loss"] / m, mean(c["aux"]))
  return out + (kept,) if keep_grads else out


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


def _clip_of(found: list[Found], spec: CollectorSpec, kind: str = "consistent"):
  if spec.clip != kind:
    return None
  return next(f.hp["max_norm"] for f in found if "max_norm" in f.hp)


def _loo(grad_fn, params, mbs, found, max_norm, spec: CollectorSpec) -> BCStats:
  """g_full, then per fold r the BC states' fold terms on c g_r (c: clip). Two passes recompute
  g_r in a second scan; one pass (``spec.loo_one_pass``) folds the g_r stored by the first."""
  m = num_microbatches(mbs)
  if m < 2:
    raise ValueError(f"leave-one-out needs at least 2 microbatches, got m={m}")
  one = spec.loo_one_pass
  full, loss, aux, *g_all = scan_group(grad_fn, params, mbs, vmap=spec.vmap, keep_grads=one,
                                       keep_dtype=spec.loo_dtype)
  c = clip_factor(full.mean, max_norm) if max_norm is not None else jnp.float32(1.0)
  g_full = jax.tree.map(lambda x: c * x, full.mean)
  folds = [_STATE_HOOKS[type(f.state)].fold_fn(f.state, f.hp) for f in found
           if f.state.spec.value.layout == "loo"]

  def fold(g_r):
    outs = [fn(g_r, g_full, m) for fn in folds]
    return jax.tree.map(lambda *xs: sum(xs), *outs)

  terms0, d0 = _zeros_like_out(fold, g_full)
  grad_of = (lambda g: g) if one else (lambda mb: _f32(grad_fn(params, mb)[2]))

  def step(carry, g_r):
    t, w = carry
    terms, d = fold(jax.tree.map(lambda x: c * x, _f32(_one_slice(g_r))))
    return jax.tree.map(jnp.add, t, terms), welford_add(w, d)

  def reduce(carry, g_rs):  # the folds of microbatches split over devices: sums, no scan
    t, w = carry
    terms, d = _vmap(lambda g_r: fold(jax.tree.map(lambda x: c * x, _f32(_one_slice(g_r)))),
                     m)(g_rs)
    return jax.tree.map(jnp.add, t, sum0(terms)), welford_merge(w, welford_of(d))

  # stored gradients already in slices: the plain scan folds them where they are
  (t, w), _ = fold_microbatches(grad_of, step, (terms0, welford_init(d0)),
                                g_all[0] if one else mbs,
                                vmap=one and spec.vmap and not _spreads(m), reduce=reduce)
  loo = LOOStats(mean=jax.tree.map(lambda s: s / m, t),
                 var=jax.tree.map(lambda s: jnp.maximum(s / (m - 1), 0.0), w.m2), count=m)
  return BCStats(g_full, g_full, None, None, loo, loss, aux, c)


def _x_fn(found: list[Found], spec: CollectorSpec):
  """Per-microbatch quantity for ``var_of="post_ema"``: the sum over BC states of their
  post-EMA denominators (masked leaves of other states contribute zeros)."""
  if spec.var_of != "post_ema":
    return None
  fns = [_STATE_HOOKS[type(f.state)].var_fn(f.state, f.hp) for f in found
         if f.state.spec.value.var_of == "post_ema"]
  return lambda g: jax.tree.map(lambda *xs: sum(xs), *[fn(g) for fn in fns])


def _layout(grad_fn, params, mbs, spec, found, b_mbs, max_norm) -> BCStats:
  lay = spec.layout
  kw = dict(var_of=spec.var_of, x_fn=_x_fn(found, spec), need_sq=spec.need_sq)
  vm = dict(vmap=spec.vmap)
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
  spec = _merge(found)
  needy = [f for f in found if f.under_multisteps and (
      f.state.spec.value.layout not in (None, "all") or f.state.spec.value.var_of
      or f.state.spec.value.estimator)]
  if needy:
    raise ValueError("optax.MultiSteps around a bias-corrected transform would update it with "
                     "the k-step mean gradient and one mini-step's statistics; pass all k*m "
                     "microbatches of the step to collect instead (they are accumulated there)")
  max_norm = _clip_of(found, spec)
  token = _AXIS.set(microbatch_axis if spec.vmap else None)
  try:
    stats = _collect(loss_fn, params, microbatches, spec, found, max_norm, key, logits_fn,
                     b_microbatches)
  finally:
    _AXIS.reset(token)
  num_norm = _clip_of(found, spec, "numerator")
  if num_norm is None:
    return stats
  return stats._replace(numerator_clip=clip_factor(stats.numerator, num_norm))


def _collect(loss_fn, params, microbatches, spec, found, max_norm, key, logits_fn,
             b_microbatches) -> BCStats:
  if spec.estimator is not None:
    return _ESTIMATORS[spec.estimator](loss_fn, params, microbatches, spec, found, key=key,
                                       logits_fn=logits_fn, b_microbatches=b_microbatches,
                                       max_norm=max_norm)
  grad_fn = value_and_grad_fn(loss_fn)
  if spec.layout == "loo":
    return _loo(grad_fn, params, microbatches, found, max_norm, spec)
  return _layout(grad_fn, params, microbatches, spec, found, b_microbatches, max_norm)


# ----------------------------------------------------------------------------- clipping

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


# ----------------------------------------------------------------------------- options

class CollectorOptionsState(NamedTuple):
  """State of ``collector_options``: a spec with only the microbatching options set."""
  spec: Static
  hp: dict


register_bc_state(CollectorOptionsState)


def collector_options(*, loo_passes: Optional[int] = None,
                      vmap_microbatches: Optional[bool] = None,
                      loo_storage: Optional[str] = None
                      ) -> optax.GradientTransformationExtraArgs:
  """How ``collect`` computes the per-microbatch gradients (an identity transform whose state
  carries the choice; chain it with a bias-corrected optimizer).

  Args:
    loo_passes: 1 (default): the first sweep stores the m gradients (m x params x 4 bytes
      more) and the leave-one-out folds run on them (half the forward/backward work of two
      passes); 2: the folds recompute every g_r in a second sweep (memory independent of m).
    vmap_microbatches: True: each group's m gradients from one ``jax.vmap`` over the
      microbatch axis (memory: the whole group's activations plus m x params x 4 bytes);
      False (default): a ``lax.scan``, one microbatch at a time.
    loo_storage: dtype of the gradients one-pass LOO stores: ``"float32"`` (default; the
      statistics equal the two-pass form's) or ``"bfloat16"`` (half the memory; each stored
      g_r is rounded to bfloat16, relative error <= 2^-8, before the float32 folds).

  None leaves a setting to the default (or to another element of the chain).
  """
  spec = CollectorSpec(layout=None, loo_passes=loo_passes, vmap_microbatches=vmap_microbatches,
                       loo_storage=loo_storage)

  def init_fn(params):
    del params
    return CollectorOptionsState(Static(spec), {})

  def update_fn(updates, state, params=None, **_):
    del params
    return updates, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def align(tree: PyTree, like: PyTree) -> PyTree:
  """``tree`` with MaskedNode wherever ``like`` (an updates tree under partition) has one."""
  masked = lambda x: isinstance(x, optax.MaskedNode)
  return jax.tree.map(lambda u, t: u if masked(u) else t, like, tree, is_leaf=masked)


def refresh_groups(grad_fn: GradFn, params: PyTree, microbatches: PyTree, layout: str,
                   refresh: jax.Array, b_microbatches: PyTree = None, *, vmap: bool = False,
                   a_every_step: bool = False):
  """Numerator group statistics and the preconditioner group for periodic refreshes.

  ``ab``: on refresh steps the numerator uses group A only (cross-fit), on the other steps
  all microbatches (``phases.cond``), or group A on every step with ``a_every_step`` (the
  authors' code: the momentum's noise level is then the same on every step); ``rolling_b``:
  A is ``microbatches``, B ``b_microbatches``; ``all``: both use every microbatch. ``vmap``: see ``fold_microbatches``.

  Returns:
    ((mean gradient, loss, aux) of the numerator group, group-B microbatches).
  """
  def num_of(mbs):
    s, loss, aux = scan_group(grad_fn, params, mbs, vmap=vmap)
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


# ----------------------------------------------------------------------------- state queries

def skipped_tensors(opt_state: PyTree) -> jax.Array:
  """Tensors whose non-finite update a BC transform zeroed in the update that produced
  ``opt_state`` (summed over the BC states; 0 when none skips per tensor)."""
  counts = [f.state.skipped for f in find_bc_states(opt_state) if hasattr(f.state, "skipped")]
  return sum(counts, jnp.zeros((), jnp.int32))


def rule_counts(opt_state: PyTree) -> dict[str, jax.Array]:
  """{rule: coordinates (or blocks) it changed in the update that produced ``opt_state``},
  summed over the BC states that keep a ``rules`` dict (LOO sign flips zeroed, inverses and
  variances clamped at 0, enlarging corrections, Newton roots that stopped unconverged,
  non-finite roots replaced by the previous root)."""
  out: dict[str, jax.Array] = {}
  for f in find_bc_states(opt_state):
    for k, v in (getattr(f.state, "rules", None) or {}).items():
      out[k] = out.get(k, jnp.zeros((), jnp.int32)) + v
  return out


def schedule_count(opt_state: PyTree) -> Optional[jax.Array]:
  """The step count of the first ``optax.scale_by_schedule`` (learning-rate schedule) state:
  the step the schedule evaluates next (it does not advance on skipped steps). None if the
  chain has no schedule state."""
  is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_sched) if is_sched(x)]
  return found[0].count if found else None
