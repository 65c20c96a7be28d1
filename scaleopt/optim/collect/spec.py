"""What the collector computes, read from the optimizer state: ``CollectorSpec``, the registry
of bias-corrected states and estimators, and queries of the states it finds."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from scaleopt.optim.collect.stats import PyTree


LAYOUTS = ("all", "ab", "rolling_b", "symmetric", "loo")
VAR_OF = (None, "grad", "sq", "post_ema")
CLIPS = ("none", "consistent", "numerator")
LOO_PASSES = (None, 1, 2)
LOO_STORAGE = (None, "float32", "bfloat16")
# one-pass LOO's default on GPUs and TPUs: 8 stored gradients per step of the folds' scan,
# unrolled (at most m; the measurements behind it: docs/optim.md, "Fold blocks")
FOLD_CHUNK = 8


def default_fold_chunk(backend: Optional[str] = None) -> int:
  """Folds per scan step when ``loo_fold_chunk`` is unset: ``FOLD_CHUNK`` on accelerators, 1 on
  CPU, where the unrolled folds lengthen the step's XLA compile and the runs that use CPUs
  (tests, small models) spend more time compiling than folding."""
  return 1 if (backend or jax.default_backend()) == "cpu" else FOLD_CHUNK


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
    loo_fold_chunk: one-pass LOO folds this many stored gradients per step of its scan over
      the folds (the scan's ``unroll``; None: no preference, ``default_fold_chunk()``). It
      does not apply to microbatches split over devices (``MicrobatchAxis``), folded where
      they lie.
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
  loo_fold_chunk: Optional[int] = None

  def __post_init__(self):
    for name, allowed in (("layout", LAYOUTS + (None,)), ("var_of", VAR_OF), ("clip", CLIPS)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"CollectorSpec.{name}={getattr(self, name)!r}; allowed: {allowed}")
    if self.loo_passes not in LOO_PASSES or type(self.loo_passes) not in (int, type(None)):
      raise ValueError(f"loo_passes={self.loo_passes!r} must be 1 or 2 (None: no preference)")
    if self.loo_storage not in LOO_STORAGE:
      raise ValueError(f"loo_storage={self.loo_storage!r} must be 'float32' or 'bfloat16' "
                       "(None: no preference)")
    c = self.loo_fold_chunk
    if c is not None and (type(c) is not int or c < 1):
      raise ValueError(f"loo_fold_chunk={c!r} must be an integer >= 1 (None: no preference)")
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

  fold_fn(state, hp, g_full, m) -> fn(g_r) -> (terms, d): LOO fold terms. Work that needs only
    g_full (e.g. rotating it into a basis) belongs in fold_fn, outside the m folds' loop.
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
  logits_fn, b_microbatches, max_norm[, microbatch_axis]) -> BCStats`` used when a spec names
  ``estimator=name``. ``microbatch_axis`` (a ``MicrobatchAxis``) is passed only where
  ``collect`` got one for vmapped microbatches; the estimator hands it to the scans it runs
  (``scan_group``, ``fold_microbatches``, ``refresh_groups``: their ``axis``)."""
  _ESTIMATORS[name] = fn


def state_hooks(state_type: type) -> StateHooks:
  """The ``StateHooks`` a BC state type was registered with."""
  return _STATE_HOOKS[state_type]


def estimator(name: str) -> Callable:
  """The estimator pass registered under ``name`` (``register_estimator``)."""
  return _ESTIMATORS[name]


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


def merge_specs(found: list[Found]) -> CollectorSpec:
  """One ``CollectorSpec`` serving every BC state found (an error where two need different
  layouts, variances, estimators or microbatching options)."""
  specs = [f.state.spec.value for f in found]
  pick = lambda name, skip: {getattr(s, name) for s in specs} - {skip}
  for name, skip in (("layout", None), ("var_of", None), ("estimator", None), ("clip", "none"),
                     ("loo_passes", None), ("vmap_microbatches", None),
                     ("loo_storage", None), ("loo_fold_chunk", None)):
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
                            loo_storage=one("loo_storage", None, None),
                            loo_fold_chunk=one("loo_fold_chunk", None, None))
  if out.loo_passes is not None and layout != "loo":
    raise ValueError(f"loo_passes={out.loo_passes} applies to the leave-one-out layout; this "
                     f"chain's layout is {layout!r}")
  if out.loo_storage is not None and not out.loo_one_pass:
    raise ValueError(f"loo_storage={out.loo_storage!r} sets how one-pass LOO stores the "
                     "microbatch gradients; loo_passes=2 stores none")
  for name in ("loo_storage", "loo_fold_chunk"):
    if getattr(out, name) is not None and layout != "loo":
      raise ValueError(f"{name}={getattr(out, name)!r} applies to the leave-one-out layout; "
                       f"this chain's layout is {layout!r}")
  if out.loo_fold_chunk is not None and not out.loo_one_pass:
    raise ValueError(f"loo_fold_chunk={out.loo_fold_chunk} folds the stored microbatch "
                     "gradients; loo_passes=2 stores none")
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
  return merge_specs(find_bc_states(state))


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
