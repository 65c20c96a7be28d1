"""Optimizers from config through a registry: ``build(config) -> (tx, spec)``.

``tx`` is a ready Optax chain

    clip_by_global_norm(clip_norm)  ->  the registered optimizer (scaling, decoupled weight
                                        decay under ``wd_mask``, learning-rate schedule)

and ``spec`` the ``CollectorSpec`` derived from ``tx``'s state (``collector_spec``), which
tells the train step's data pipeline its layout. The train step calls
``collect(loss_fn, params, microbatches, opt_state, ...)`` and
``tx.update(stats.numerator, opt_state, params, bc_stats=stats)``.

Registry (levanter's registered optimizer configs are the model): ``register_optimizer(name,
factory, config=Dataclass)`` with ``factory(cfg: OptimizerConfig, learning_rate: schedule, *,
wd_mask, sparse_filter) -> GradientTransformation``; ``config`` is the optimizer's own typed
config, a dataclass of its hyperparameters (its ``extra`` keys) and their defaults
(``config_class(name)``; ``cfg.hyperparameters()`` is the filled-in instance). A factory that
also takes a ``shard_dims`` keyword gets the model's FSDP dims (``build``'s argument). The
shipped names register the same way below (Muon's transform is ``scaleopt.optim.muon``).

Config: a plain dict or an ``OptimizerConfig``. Keys: ``name``, ``learning_rate``,
``schedule`` (see ``scaleopt.optim.schedules``), ``clip_norm`` (0 = off), ``clip_numerator_only``
(the reference code's clip), ``all_dense`` (no embedding branch: ``build`` drops the
``sparse_filter``, as the paper's ``--all_dense``), ``weight_decay``, ``b1``, ``b2``, ``eps``
(None = the optimizer's own default) and ``extra``: the optimizer's own hyperparameters, the
fields of its registered config class (keyword arguments of its alias: ``adamw_bc``,
``sophia``, ``shampoo``, ...); an unknown one is an error naming it and the allowed keys.
The bias-corrected names also take the collector's microbatching options ``loo_passes``,
``vmap_microbatches``, ``loo_storage`` and ``loo_fold_chunk`` (``COLLECTOR_KEYS``), which
``build`` puts into the chain as ``collector_options``.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from scaleopt.optim import adam_bc, baselines, shampoo_lib, soap_lib, sophia_lib
from scaleopt.optim.muon import muon
from scaleopt.optim.collect import (CollectorSpec, clip_by_global_norm, collector_options,
                                    collector_spec)
from scaleopt.optim.schedules import ScheduleConfig, make_schedule

PyTree = Any
Factory = Callable[..., optax.GradientTransformation]
# ``extra`` keys of the bias-corrected names that go to ``collector_options``, not the alias
COLLECTOR_KEYS = ("loo_passes", "vmap_microbatches", "loo_storage", "loo_fold_chunk")


@dataclasses.dataclass(frozen=True)
class Recommended:
  """An optimizer's recommended learning rate and schedule keys (``ScheduleConfig`` fields,
  e.g. ``{"kind": "constant"}``), which a training config takes where its optimizer section
  sets none (``with_recommended``). docs/optim.md lists them and how they were chosen."""
  learning_rate: float
  schedule: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class Registered(NamedTuple):
  factory: Factory
  config: Optional[type]  # the dataclass of ``extra``'s keys; None: any key (the factory checks)
  finite_updates: Union[bool, Callable[["OptimizerConfig"], bool]]
  recommended: Optional[Recommended] = None


_REGISTRY: dict[str, Registered] = {}
_SHARED = ("learning_rate", "lr", "b1", "b2", "eps", "weight_decay", "mask", "wd_mask",
           "sparse_filter")


def extra_config(cls_name: str, *fns: Callable, drop: tuple = (), keep: Optional[tuple] = None,
                 also: Optional[Mapping[str, Any]] = None) -> type:
  """A frozen dataclass of an optimizer's own hyperparameters (its ``optimizer.extra`` keys):
  the keyword arguments of ``fns`` (its alias, and ``collector_options`` for the bias-corrected
  names) with their defaults, less the keys every optimizer shares (learning rate, betas,
  weight decay, mask) and ``drop`` (or only ``keep``), plus ``also`` {key: default}. The alias's
  signature stays the one place each default is written."""
  fields, seen = [], set()
  for fn in fns:  # the first function that names a key gives its default
    for p in inspect.signature(fn).parameters.values():
      if (p.name in _SHARED or p.name in drop or (keep is not None and p.name not in keep)
          or p.default is inspect.Parameter.empty or p.kind is p.VAR_KEYWORD
          or p.name in seen):
        continue
      seen.add(p.name)
      d = p.default
      f = (dataclasses.field(default_factory=lambda d=d: type(d)(d))
           if isinstance(d, (list, dict, set)) else dataclasses.field(default=d))
      fields.append((p.name, Any, f))
  fields += [(k, Any, dataclasses.field(default=v)) for k, v in (also or {}).items()]
  return dataclasses.make_dataclass(cls_name, fields, frozen=True)


def register_optimizer(name: str, factory: Optional[Factory] = None, *,
                       config: Optional[type] = None,
                       finite_updates: Union[bool, Callable[["OptimizerConfig"], bool]] = False,
                       recommended: Optional[Recommended] = None):
  """Registers ``factory`` under ``name`` (usable as a decorator).

  ``factory(cfg, learning_rate, *, wd_mask, sparse_filter)`` returns the transform without
  clipping (``build`` adds it); ``cfg.betas()`` gives the config's b1, b2, eps that are set,
  ``cfg.extra`` the ``optimizer.extra`` keys the user set and ``cfg.hyperparameters()`` all of
  them typed, defaults filled in.
  ``config``: a dataclass whose fields are the optimizer's own hyperparameters (the allowed
  ``optimizer.extra`` keys) with their defaults (``extra_config`` derives one from an alias's
  signature); None allows any key (the factory validates).
  ``finite_updates``: True, or a predicate of the config, when the update is finite whenever
  the gradient (with a finite global norm), the parameters and the state are. The train step
  then decides a skip from the loss and gradient alone, before the update, and applies the
  update in one pass over the state; leave it False unless that is proven: the step then
  also checks the update's norm.
  ``recommended``: the ``Recommended`` learning rate and schedule keys a training config takes
  where it sets none (None: ``OptimizerConfig``'s defaults).
  """
  if config is not None and not dataclasses.is_dataclass(config):
    raise TypeError(f"register_optimizer({name!r}): config must be a dataclass, got {config!r}")

  def deco(f):
    _REGISTRY[name] = Registered(f, config, finite_updates, recommended)
    return f
  return deco(factory) if factory is not None else deco


def unregister_optimizer(name: str) -> None:
  """Removes a registered name (a name registered for a session or a test); KeyError when it
  is not registered."""
  del _REGISTRY[name]


def config_class(name: str) -> Optional[type]:
  """The dataclass of a registered optimizer's own hyperparameters (its ``extra`` keys)."""
  return _REGISTRY[name].config


def names() -> tuple[str, ...]:
  """Registered optimizer names."""
  return tuple(_REGISTRY)


def recommended(name: str) -> Optional[Recommended]:
  """The recommended learning rate and schedule keys of a registered optimizer (None when it
  was registered without them)."""
  return _REGISTRY[name].recommended


def with_recommended(section: Mapping[str, Any]) -> dict:
  """An optimizer section (a mapping with a registered ``name``) with its optimizer's
  ``recommended`` learning rate where it sets no ``learning_rate``, and its recommended
  schedule keys where ``schedule`` sets none of them; every key the section sets is kept."""
  out = dict(section)
  rec = _REGISTRY[out["name"]].recommended if out.get("name") in _REGISTRY else None
  if rec is None:
    return out
  out.setdefault("learning_rate", rec.learning_rate)
  schedule = out.get("schedule")
  if rec.schedule and (schedule is None or isinstance(schedule, Mapping)):
    out["schedule"] = {**rec.schedule, **(schedule or {})}
  return out


def finite_updates(config: Union[Mapping[str, Any], "OptimizerConfig"]) -> bool:
  """Whether the optimizer of ``config`` is registered as giving a finite update whenever the
  gradient, parameters and state are finite (``register_optimizer``)."""
  cfg = OptimizerConfig.from_dict(config)
  rule = _REGISTRY[cfg.name].finite_updates
  return bool(rule(cfg) if callable(rule) else rule)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
  """Optimizer settings (YAML section ``optimizer``); see the module docstring."""
  name: str = "adamw"
  learning_rate: float = 6e-4
  schedule: Any = dataclasses.field(default_factory=ScheduleConfig)
  clip_norm: float = 1.0
  clip_numerator_only: bool = False
  all_dense: bool = False
  weight_decay: float = 0.1
  b1: Optional[float] = None
  b2: Optional[float] = None
  eps: Optional[float] = None
  extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.name not in _REGISTRY:
      raise ValueError(f"optimizer.name={self.name!r} is not registered; choose one of "
                       f"{names()} or register_optimizer() it")
    object.__setattr__(self, "schedule", ScheduleConfig.from_dict(self.schedule))
    _num("learning_rate", self.learning_rate, lo=0.0)
    _num("clip_norm", self.clip_norm, lo=0.0)
    _num("weight_decay", self.weight_decay, lo=0.0)
    for k in ("b1", "b2"):
      if getattr(self, k) is not None:
        _num(k, getattr(self, k), lo=0.0, hi=1.0, hi_open=True)
    if self.eps is not None:
      _num("eps", self.eps, lo=0.0)
    for k in ("clip_numerator_only", "all_dense"):
      if not isinstance(getattr(self, k), bool):
        raise ValueError(f"optimizer.{k}={getattr(self, k)!r} must be true or false")
    if not isinstance(self.extra, Mapping):
      raise ValueError(f"optimizer.extra must be a mapping, got {type(self.extra).__name__}")
    if self.all_dense and self.extra.get("sparse_lr_ratio", 1.0) != 1.0:
      raise ValueError(f"optimizer.extra.sparse_lr_ratio={self.extra['sparse_lr_ratio']!r} "
                       "sets the embedding branch's learning rate; optimizer.all_dense=true "
                       "has no embedding branch (remove one of the two)")
    own = _REGISTRY[self.name].config
    allowed = None if own is None else tuple(f.name for f in dataclasses.fields(own))
    for k in self.extra:
      if allowed is not None and k not in allowed:
        raise ValueError(f"optimizer.extra.{k} is not a known key for name={self.name!r}; "
                         f"allowed keys: {allowed or '(none)'}")

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

  def hyperparameters(self) -> Any:
    """The optimizer's own hyperparameters typed by its registered config class, every key
    that ``extra`` leaves out at its default (the ``extra`` mapping when none is registered)."""
    own = _REGISTRY[self.name].config
    return dict(self.extra) if own is None else own(**self.extra)

  def betas(self) -> dict[str, float]:
    """The b1, b2, eps the config sets (the optimizer's own defaults apply to the others)."""
    return {k: float(getattr(self, k)) for k in ("b1", "b2", "eps")
            if getattr(self, k) is not None}


def _num(name, v, lo=None, hi=None, hi_open=False):
  ok = isinstance(v, (int, float)) and not isinstance(v, bool)
  if ok and lo is not None and v < lo:
    ok = False
  if ok and hi is not None and (v >= hi if hi_open else v > hi):
    ok = False
  if not ok:
    rng = f"[{lo}, {hi}{')' if hi_open else ']'}" if hi is not None else f">= {lo}"
    raise ValueError(f"optimizer.{name}={v!r} must be a number in {rng}")


def build(config: Union[Mapping[str, Any], OptimizerConfig], *,
          wd_mask: Optional[Union[PyTree, Callable[[PyTree], PyTree]]] = None,
          sparse_filter: Optional[Callable[[PyTree], PyTree]] = None,
          shard_dims: Optional[Callable[[PyTree], PyTree]] = None,
          schedule: Optional[optax.Schedule] = None,
          ) -> tuple[optax.GradientTransformationExtraArgs, CollectorSpec]:
  """(tx, spec) for an optimizer config.

  Args:
    config: dict or ``OptimizerConfig``.
    wd_mask: weight-decay mask, a pytree of bools or a callable params -> pytree of bools
      (True = decay); None decays every parameter (as the paper's code does).
    sparse_filter: callable params -> pytree of bools marking sparse-support tensors
      (embeddings). ``adamw_bc`` trains them with full-batch AdamW (no cross-fit); Shampoo
      keeps them on its AdamW fallback; Muon on Adam; Sophia ignores it. Dropped with
      ``all_dense``; ``adamw_bc``'s ``sparse_lr_ratio`` without one is an error.
    shard_dims: callable params -> pytree giving per tensor the dim a mesh's ``fsdp`` axis
      splits, or None (``scaleopt.models.fsdp_dims``); passed to factories that take a
      ``shard_dims`` keyword (Shampoo orders its blocks by it unless ``extra.block_major`` is
      ``layers``).
    schedule: the learning-rate schedule of ``config`` when the caller has made it already
      (``make_schedule(config.schedule, config.learning_rate)``); None makes it here.

  Returns:
    tx: ``optax.GradientTransformationExtraArgs``; spec: ``collector_spec(tx)``.
  """
  cfg = OptimizerConfig.from_dict(config)
  lr = make_schedule(cfg.schedule, cfg.learning_rate) if schedule is None else schedule
  if cfg.all_dense:
    sparse_filter = None

  opts = {k: v for k, v in cfg.extra.items() if k in COLLECTOR_KEYS}
  alias_cfg = dataclasses.replace(cfg, extra={k: v for k, v in cfg.extra.items()
                                              if k not in COLLECTOR_KEYS})

  factory = _REGISTRY[cfg.name].factory
  layout = ({"shard_dims": shard_dims}
            if "shard_dims" in inspect.signature(factory).parameters else {})

  def make(wd_mask, sparse_filter):
    try:
      inner = factory(alias_cfg, lr, wd_mask=wd_mask, sparse_filter=sparse_filter, **layout)
    except TypeError as e:  # an ``extra`` key the alias does not take
      raise ValueError(f"optimizer.extra for name={cfg.name!r}: {e}") from None
    if opts:
      try:
        inner = optax.chain(collector_options(**opts), inner)
      except ValueError as e:
        raise ValueError(f"optimizer.extra: {e}") from None
    if cfg.clip_norm > 0:
      clip = clip_by_global_norm(cfg.clip_norm, numerator_only=cfg.clip_numerator_only)
      return optax.chain(clip, inner)
    return inner

  # The spec is read from the state of an unmasked copy traced on an empty tree (masks and
  # filters only route tensors; they do not change what is collected: a filter that marks
  # nothing stands in for the caller's).
  tx = make(wd_mask, sparse_filter)
  no_sparse = lambda params: jax.tree.map(lambda _: False, params)
  return tx, collector_spec(make(None, sparse_filter and no_sparse))


def resolved_numerics(config: Union[Mapping[str, Any], OptimizerConfig],
                      backend: Optional[str] = None) -> dict[str, Any]:
  """The numerics a run of ``config`` executes on ``backend`` (default: JAX's), for the run's
  summary: Shampoo's resolved ``root_method`` (``auto`` is eigh on CPU and for inv/full, Newton
  on accelerators) and its matmul, statistics and Newton precisions; {} for other names."""
  cfg = OptimizerConfig.from_dict(config)
  if not cfg.name.startswith("shampoo"):
    return {}
  hp = cfg.hyperparameters()
  out = {k: getattr(hp, k) for k in ("matmul_precision", "stats_precision", "newton_precision",
                                     "eigh_implementation")}
  out["root_method"] = shampoo_lib.resolve_root_method(
      hp.root_method, hp.mode, backend, hp.d_max, hp.eigh_implementation)
  return out


# ----------------------------------------------------------------------------- shipped names

# The recommended learning rate (and schedule keys where one is needed) of each shipped name:
# the rate of a short learning-rate sweep on the ``tiny`` config (docs/optim.md, "Recommended
# learning rates", lists them with the loss they reach and the command that measures it).
RECOMMENDED = {
    "adamw": Recommended(3e-3),
    "adamw_bc": Recommended(3e-3),
    "sophia": Recommended(3e-3),
    "sophia_bc": Recommended(1e-2),
    "shampoo": Recommended(3e-3),
    "shampoo_bc": Recommended(3e-3),
    "muon": Recommended(5e-2),
    "lion": Recommended(3e-3),
    "adafactor": Recommended(1e-1),
    "schedule_free_adamw": Recommended(3e-3, {"kind": "constant"}),
    "soap": Recommended(1e-2),
    "soap_bc": Recommended(3e-2),
}

_ADAMW_BETAS = {"b1": 0.9, "b2": 0.95, "eps": 1e-8}  # the paper's pretraining betas


def _adamw_betas(cfg) -> dict[str, float]:
  return {**_ADAMW_BETAS, **cfg.betas()}


def _adam_is_finite(cfg) -> bool:
  """AdamW's update is finite when the gradient's global norm is (so every g^2 is): the
  moments stay finite, eps > 0 keeps the denominator positive, and m_hat / (sqrt(v_hat) + eps)
  is bounded. A float16 first moment (largest value 65504) can overflow; bfloat16 cannot."""
  mu_dtype = cfg.extra.get("mu_dtype")
  wide = mu_dtype is None or jnp.finfo(mu_dtype).maxexp >= 128
  return _adamw_betas(cfg)["eps"] > 0 and wide


@register_optimizer("adamw", config=extra_config("AdamWConfig", optax.adamw, keep=("mu_dtype",)),
                    finite_updates=_adam_is_finite,
                    recommended=RECOMMENDED["adamw"])
def _adamw(cfg, lr, *, wd_mask, sparse_filter):
  """optax.adamw with the paper's pretraining betas (0.9, 0.95, 1e-8) unless set; extra
  ``mu_dtype`` (e.g. ``bfloat16``) is optax's first-moment dtype."""
  del sparse_filter
  return optax.adamw(lr, **_adamw_betas(cfg), weight_decay=cfg.weight_decay, mask=wd_mask,
                     **cfg.extra)


@register_optimizer("adamw_bc", config=extra_config(
    "AdamWBCConfig", adam_bc.adamw_bc, collector_options, drop=("sparse_learning_rate",),
    also={"sparse_lr_ratio": 1.0}), recommended=RECOMMENDED["adamw_bc"])
def _adamw_bc(cfg, lr, *, wd_mask, sparse_filter):
  ex = dict(cfg.extra)
  ratio = ex.pop("sparse_lr_ratio", 1.0)
  sparse_lr = None
  if ratio != 1.0:
    if sparse_filter is None:
      raise ValueError(f"optimizer.extra.sparse_lr_ratio={ratio!r} needs an embedding branch, "
                       "and this build has no sparse_filter (pass one, or drop the ratio)")
    sparse_lr = make_schedule(cfg.schedule, cfg.learning_rate * ratio)
  return adam_bc.adamw_bc(lr, **cfg.betas(), weight_decay=cfg.weight_decay, mask=wd_mask,
                          sparse_filter=sparse_filter, sparse_learning_rate=sparse_lr, **ex)


def _sophia_factory(alias):
  def factory(cfg, lr, *, wd_mask, sparse_filter):
    del sparse_filter
    return alias(lr, **cfg.betas(), weight_decay=cfg.weight_decay, mask=wd_mask, **cfg.extra)
  return factory


register_optimizer("sophia", _sophia_factory(sophia_lib.sophia), config=extra_config(
    "SophiaConfig", sophia_lib.sophia, sophia_lib.scale_by_sophia),
    recommended=RECOMMENDED["sophia"])
register_optimizer("sophia_bc", _sophia_factory(sophia_lib.sophia_bc), config=extra_config(
    "SophiaBCConfig", sophia_lib.sophia_bc, sophia_lib.scale_by_sophia, collector_options),
    recommended=RECOMMENDED["sophia_bc"])


def _shampoo_factory(alias):
  def factory(cfg, lr, *, wd_mask, sparse_filter, shard_dims=None):
    ex = dict(cfg.extra)
    if sparse_filter is not None:
      ex.setdefault("exclude", sparse_filter)
    if shard_dims is not None and ex.get("block_major") is None:  # null: as if not given
      ex["block_major"] = shard_dims
    return alias(lr, **cfg.betas(), weight_decay=cfg.weight_decay, mask=wd_mask, **ex)
  return factory


register_optimizer("shampoo", _shampoo_factory(shampoo_lib.shampoo), config=extra_config(
    "ShampooConfig", shampoo_lib.shampoo, shampoo_lib.scale_by_shampoo, drop=("exclude",)),
    recommended=RECOMMENDED["shampoo"])
register_optimizer("shampoo_bc", _shampoo_factory(shampoo_lib.shampoo_bc), config=extra_config(
    "ShampooBCConfig", shampoo_lib.shampoo_bc, shampoo_lib.scale_by_shampoo, collector_options,
    drop=("exclude",)), recommended=RECOMMENDED["shampoo_bc"])


@register_optimizer("muon", config=extra_config("MuonConfig", muon, drop=("beta",)),
                    recommended=RECOMMENDED["muon"])
def _muon_factory(cfg, lr, *, wd_mask, sparse_filter):
  b = {"b1": 0.95, "eps": 1e-8, **cfg.betas()}
  return muon(lr, b["b1"], b["eps"], cfg.weight_decay, wd_mask, sparse_filter, **cfg.extra)


# optax's own Lion, Adafactor and schedule-free AdamW (``scaleopt.optim.baselines``)
register_optimizer("lion", baselines.lion,
                   config=extra_config("LionConfig", optax.lion, keep=("mu_dtype",)),
                   recommended=RECOMMENDED["lion"])
register_optimizer("adafactor", baselines.adafactor, config=extra_config(
    "AdafactorConfig", optax.adafactor,
    drop=("momentum", "weight_decay_rate", "weight_decay_mask")),
    recommended=RECOMMENDED["adafactor"])
register_optimizer("schedule_free_adamw", baselines.schedule_free_adamw,
                   config=extra_config("ScheduleFreeAdamWConfig", optax.contrib.schedule_free,
                                       keep=("weight_lr_power", "state_dtype")),
                   recommended=RECOMMENDED["schedule_free_adamw"])


def _soap_factory(alias):
  def factory(cfg, lr, *, wd_mask, sparse_filter, shard_dims=None):
    """SOAP on every matrix, embeddings included, as in the paper (one-sided beyond
    ``max_precond_dim``); the paper's betas (0.95, 0.95) and eps 1e-8 unless set."""
    del sparse_filter
    ex = dict(cfg.extra)
    if shard_dims is not None and ex.get("block_major") is None:
      ex["block_major"] = shard_dims
    b = {"b1": 0.95, "b2": 0.95, "eps": 1e-8, **cfg.betas()}
    return alias(lr, **b, weight_decay=cfg.weight_decay, mask=wd_mask, **ex)
  return factory


register_optimizer("soap", _soap_factory(soap_lib.soap), config=extra_config(
    "SoapConfig", soap_lib.soap, soap_lib.scale_by_soap), recommended=RECOMMENDED["soap"])
register_optimizer("soap_bc", _soap_factory(soap_lib.soap_bc), config=extra_config(
    "SoapBCConfig", soap_lib.soap_bc, soap_lib.scale_by_soap, collector_options),
    recommended=RECOMMENDED["soap_bc"])
