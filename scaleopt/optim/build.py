"""Optimizers from config: ``build(config) -> (tx, spec)``.

``tx`` is a ready Optax chain

    clip_by_global_norm(clip_norm)  ->  optimizer scaling  ->  add_decayed_weights(wd, wd_mask)
                                    ->  scale_by_learning_rate(schedule)

(Muon applies its own weight decay and learning rate inside ``optax.contrib.muon``) and
``spec`` is the ``CollectorSpec`` that tells the train step which microbatch layout and extra
estimator passes the optimizer needs. Every transform takes ``update(numerator, state, params,
bc_stats=stats)``; transforms that need no statistics ignore ``bc_stats``. The train step gets
``stats`` from ``collect_step(loss_fn, params, microbatches, spec, ...)``, which dispatches on
``spec`` (plain collector, Sophia's curvature pass, Shampoo's two-pass factor statistics).

Config: a plain dict or an ``OptimizerConfig``. Keys (defaults in ``OptimizerConfig``):
``name``, ``learning_rate``, ``schedule`` (see ``scaleopt.optim.schedules``), ``clip_norm``
(0 = off), ``weight_decay``, ``b1``, ``b2``, ``eps`` (None = the optimizer's default) and
``extra``, a dict of per-optimizer settings whose allowed keys are listed in ``EXTRA_KEYS``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Union

import jax
import optax

from scaleopt.optim import adam_bc, shampoo, sophia
from scaleopt.optim.collect import BCStats, CollectorSpec, collect
from scaleopt.optim.schedules import ScheduleConfig, make_schedule

PyTree = Any

NAMES = ("adamw", "adamw_bc", "sophia", "sophia_bc", "shampoo", "shampoo_bc", "muon")

# Per-optimizer defaults of b1, b2, eps (None in the config picks these).
_BETAS = {
    "adamw": (0.9, 0.95, 1e-8),
    "adamw_bc": (0.9, 0.95, 1e-8),
    "sophia": (0.965, 0.99, 1e-12),
    "sophia_bc": (0.965, 0.99, 1e-12),
    "shampoo": (0.9, 0.95, 1e-8),
    "shampoo_bc": (0.9, 0.95, 1e-8),
    "muon": (0.95, 0.95, 1e-8),
}

# Allowed ``extra`` keys and their defaults, per optimizer. ``None`` means "the transform's
# default". Values are validated by the transforms themselves (they name key and choices).
_ADAM_BC_EXTRA = dict(mode="full", crossfit="loo", correction=None, v_source="sq_of_mean",
                      rolling_b=False, correction_scale=1.0, reference_pre_ema=False,
                      crossfit_alpha=1.0, update_clip=0.0, support_clip_tau=0.0,
                      std_warmup_steps=0, sparse_lr_ratio=1.0)
_SOPHIA_EXTRA = dict(estimator="gnb", rho=0.05, k=10, clip=1.0, denominator_scale="matched",
                     count_unit="tokens", statistic=None, bs=None,
                     bias_correct_momentum=False, hessian_first=True)
_SOPHIA_BC_EXTRA = dict(_SOPHIA_EXTRA, mode="full", crossfit="ab", correction=None,
                        rolling_b=False, correction_scale=1.0)
_SHAMPOO_EXTRA = dict(block_size=1024, max_dim=8192, min_dim=2, stats_every=1, root_every=10,
                      damping=1e-6, eig_floor_ratio=1e-3, root_method="eigh",
                      newton_iters=30, graft="none", adam_b2=None, update_clip_fro=0.0,
                      d_max=0.0, stacked="auto")
_SHAMPOO_BC_EXTRA = dict(_SHAMPOO_EXTRA, mode="full", crossfit="ab", rolling_b=False,
                         correction_scale=1.0)
_MUON_EXTRA = dict(ns_steps=5, nesterov=True, adam_b1=0.9, adam_b2=0.95, adam_lr_ratio=1.0,
                   consistent_rms=None)

EXTRA_KEYS: dict[str, dict[str, Any]] = {
    "adamw": {},
    "adamw_bc": _ADAM_BC_EXTRA,
    "sophia": _SOPHIA_EXTRA,
    "sophia_bc": _SOPHIA_BC_EXTRA,
    "shampoo": _SHAMPOO_EXTRA,
    "shampoo_bc": _SHAMPOO_BC_EXTRA,
    "muon": _MUON_EXTRA,
}


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """Optimizer settings (YAML section ``optimizer``); see the module docstring."""
  name: str = "adamw"
  learning_rate: float = 6e-4
  schedule: Any = dataclasses.field(default_factory=ScheduleConfig)
  clip_norm: float = 1.0
  weight_decay: float = 0.1
  b1: Optional[float] = None
  b2: Optional[float] = None
  eps: Optional[float] = None
  extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.name not in NAMES:
      raise ValueError(f"optimizer.name={self.name!r} is not allowed; choose one of {NAMES}")
    object.__setattr__(self, "schedule", ScheduleConfig.from_dict(self.schedule))
    _num("learning_rate", self.learning_rate, lo=0.0)
    _num("clip_norm", self.clip_norm, lo=0.0)
    _num("weight_decay", self.weight_decay, lo=0.0)
    for k in ("b1", "b2"):
      v = getattr(self, k)
      if v is not None:
        _num(k, v, lo=0.0, hi=1.0, hi_open=True)
    if self.eps is not None:
      _num("eps", self.eps, lo=0.0)
    if not isinstance(self.extra, Mapping):
      raise ValueError(f"optimizer.extra must be a mapping, got {type(self.extra).__name__}")
    allowed = EXTRA_KEYS[self.name]
    for k in self.extra:
      if k not in allowed:
        raise ValueError(f"optimizer.extra.{k} is not a known key for name={self.name!r}; "
                         f"allowed keys: {tuple(allowed) or '(none)'}")

  @classmethod
  def from_dict(cls, d: Union[Mapping[str, Any], "OptimizerConfig"]) -> "OptimizerConfig":
    if isinstance(d, OptimizerConfig):
      return d
    if not isinstance(d, Mapping):
      raise ValueError(f"optimizer config must be a mapping or OptimizerConfig, got "
                       f"{type(d).__name__}")
    allowed = tuple(f.name for f in dataclasses.fields(cls))
    for k in d:
      if k not in allowed:
        raise ValueError(f"optimizer.{k} is not a known key; allowed keys: {allowed}")
    return cls(**dict(d))

  def resolved_extra(self) -> dict[str, Any]:
    """``extra`` with every allowed key, defaults filled in."""
    return {**EXTRA_KEYS[self.name], **dict(self.extra)}

  def betas(self) -> tuple[float, float, float]:
    d1, d2, de = _BETAS[self.name]
    pick = lambda v, d: d if v is None else float(v)
    return pick(self.b1, d1), pick(self.b2, d2), pick(self.eps, de)


def _num(name, v, lo=None, hi=None, hi_open=False):
  ok = isinstance(v, (int, float)) and not isinstance(v, bool)
  if ok and lo is not None and v < lo:
    ok = False
  if ok and hi is not None and (v >= hi if hi_open else v > hi):
    ok = False
  if not ok:
    rng = f"[{lo}, {hi}{')' if hi_open else ']'}" if hi is not None else f">= {lo}"
    raise ValueError(f"optimizer.{name}={v!r} must be a number in {rng}")


def _chain(*parts) -> optax.GradientTransformationExtraArgs:
  return optax.chain(*[p for p in parts if p is not None])


def build(config: Union[Mapping[str, Any], OptimizerConfig], *,
          wd_mask: Optional[Union[PyTree, Callable[[PyTree], PyTree]]] = None,
          sparse_filter: Optional[Callable[[PyTree], PyTree]] = None,
          ) -> tuple[optax.GradientTransformationExtraArgs, CollectorSpec]:
  """(tx, spec) for an optimizer config.

  Args:
    config: dict or ``OptimizerConfig``.
    wd_mask: weight-decay mask, a pytree of bools or a callable params -> pytree of bools
      (True = decay); None decays every parameter (as the paper's code does).
    sparse_filter: callable params -> pytree of bools marking sparse-support tensors
      (embeddings). ``adamw_bc`` trains them with full-batch AdamW (no cross-fit); Shampoo
      keeps them on its AdamW fallback (``exclude``); Sophia ignores it.

  Returns:
    tx: ``optax.GradientTransformationExtraArgs``; call
      ``tx.update(stats.numerator, opt_state, params, bc_stats=stats)``.
    spec: ``CollectorSpec`` for ``collect_step``.
  """
  cfg = OptimizerConfig.from_dict(config)
  b1, b2, eps = cfg.betas()
  ex = cfg.resolved_extra()
  lr = make_schedule(cfg.schedule, cfg.learning_rate)
  clip = optax.clip_by_global_norm(cfg.clip_norm) if cfg.clip_norm > 0 else None
  wd = cfg.weight_decay
  name = cfg.name

  if name == "adamw":
    tx = _chain(clip, optax.scale_by_adam(b1, b2, eps),
                optax.add_decayed_weights(wd, wd_mask), optax.scale_by_learning_rate(lr))
    return tx, CollectorSpec(layout="all")

  if name == "adamw_bc":
    ratio = ex.pop("sparse_lr_ratio")
    rolling_b = ex.pop("rolling_b")
    sparse_lr = None
    if sparse_filter is not None and ratio != 1.0:
      sparse_lr = make_schedule(cfg.schedule, cfg.learning_rate * ratio)
    spec = adam_bc.adam_bc_spec(ex["mode"], ex["crossfit"], ex["correction"], ex["v_source"],
                                rolling_b=rolling_b, b1=b1, b2=b2, eps=eps)
    inner = adam_bc.adamw_bc(lr, b1, b2, eps, wd, mask=wd_mask, sparse_filter=sparse_filter,
                             sparse_learning_rate=sparse_lr, **ex)
    return _chain(clip, inner), spec

  if name in ("sophia", "sophia_bc"):
    kw = dict(ex)
    if name == "sophia":
      kw.update(mode="std")
    rolling_b = kw.pop("rolling_b", False)
    crossfit = kw.pop("crossfit", "ab")
    spec = sophia.sophia_spec(crossfit=crossfit, rolling_b=rolling_b, **kw)
    inner = sophia.sophia(lr, b1, b2, eps, wd, mask=wd_mask, **kw)
    return _chain(clip, inner), spec

  if name in ("shampoo", "shampoo_bc"):
    kw = dict(ex)
    if name == "shampoo":
      kw.update(mode="std")
    rolling_b = kw.pop("rolling_b", False)
    crossfit = kw.pop("crossfit", "ab")
    spec = shampoo.shampoo_spec(crossfit=crossfit, rolling_b=rolling_b, b2=b2, **kw)
    if sparse_filter is not None:
      kw["exclude"] = sparse_filter
    inner = shampoo.shampoo(lr, b1, b2, eps, wd, mask=wd_mask, **kw)
    return _chain(clip, inner), spec

  # muon: optax.contrib's Newton-Schulz orthogonalised momentum for matrices, Adam otherwise.
  return _chain(clip, _muon(lr, b1, eps, wd, wd_mask, sparse_filter, **ex)), CollectorSpec("all")


def _muon(lr, beta, eps, wd, wd_mask, sparse_filter, *, ns_steps, nesterov, adam_b1, adam_b2,
          adam_lr_ratio, consistent_rms) -> optax.GradientTransformation:
  """optax.contrib.muon's parts with decoupled weight decay under ``wd_mask`` for all tensors.

  Matrices (rank >= 2; leading axes of rank >= 3 tensors are stacked layers, and a rank-2
  tensor whose first dim is such a stack size is a stack of vectors) take Muon, except
  ``sparse_filter`` tensors (embeddings), which take Adam with lr * ``adam_lr_ratio``.
  """
  from optax.contrib import MuonDimensionNumbers, scale_by_muon
  from optax.contrib._muon import scale_by_shape

  def labels(params):
    leaves, td = jax.tree.flatten(params)
    sparse = (td.flatten_up_to(sparse_filter(params)) if sparse_filter is not None
              else [False] * len(leaves))
    stacks = {x.shape[0] for x in leaves if x.ndim >= 3}
    lab = ["muon" if (x.ndim >= 3 or (x.ndim == 2 and x.shape[0] not in stacks)) and not sp
           else "adam" for x, sp in zip(leaves, sparse)]
    return jax.tree.unflatten(td, lab)

  def dims(masked):
    return jax.tree.map(
        lambda x: x if isinstance(x, optax.MaskedNode) else MuonDimensionNumbers(
            reduction_axis=x.ndim - 2, output_axis=x.ndim - 1),
        masked, is_leaf=lambda x: isinstance(x, optax.MaskedNode))

  muon = optax.chain(
      scale_by_muon(ns_steps=ns_steps, beta=beta, eps=eps, nesterov=nesterov,
                    weight_dimension_numbers=dims),
      scale_by_shape(weight_dimension_numbers=dims, consistent_rms=consistent_rms))
  adam = optax.chain(optax.scale_by_adam(adam_b1, adam_b2, eps, nesterov=nesterov),
                     optax.scale(adam_lr_ratio))
  return optax.chain(optax.partition({"muon": muon, "adam": adam}, labels),
                     optax.add_decayed_weights(wd, wd_mask),
                     optax.scale_by_learning_rate(lr))


def collect_step(loss_fn, params: PyTree, microbatches: PyTree, spec: CollectorSpec, *,
                 opt_state: PyTree = None, key: Optional[jax.Array] = None,
                 logits_fn=None, b_microbatches: PyTree = None) -> BCStats:
  """The statistics for one step of the optimizer that ``spec`` came from.

  Dispatches on ``spec.estimator``: None -> ``collect``; ``"gnb"``/``"hutchinson"`` ->
  ``sophia.sophia_collect``; ``"shampoo"`` -> ``shampoo.shampoo_collect``. Call inside the
  jitted train step; see docs/optim_sophia_shampoo.md for the whole sequence.

  Args:
    loss_fn: ``(params, mb) -> (loss, aux)``.
    params, microbatches: as for ``collect``.
    spec: from ``build``.
    opt_state: the optimizer state before this step (Sophia/Shampoo read their step count,
      curvature/factor EMAs from it; LOO reads Adam's moments).
    key: PRNG key for the step (Sophia's label sampling or Rademacher vectors).
    logits_fn: ``(params, mb) -> (logits [..., V], mask [...])`` for the GNB estimator.
    b_microbatches: group B for ``rolling_b`` layouts.
  """
  if spec.estimator in ("gnb", "hutchinson"):
    return sophia.sophia_collect(loss_fn, params, microbatches, spec, opt_state=opt_state,
                                 key=key, logits_fn=logits_fn, b_microbatches=b_microbatches)
  if spec.estimator == "shampoo":
    return shampoo.shampoo_collect(loss_fn, params, microbatches, spec, opt_state=opt_state,
                                   b_microbatches=b_microbatches)
  return collect(loss_fn, params, microbatches, spec, b_microbatches=b_microbatches,
                 opt_state=opt_state)
