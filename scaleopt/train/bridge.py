"""Where the trainer meets ``scaleopt.models`` and ``scaleopt.optim`` (config -> objects)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

from scaleopt import models
from scaleopt.optim.build import OptimizerConfig, build
from scaleopt.optim.collect import CollectorSpec
from scaleopt.optim.schedules import make_schedule
from scaleopt.train.config import ModelKeys, ModelSpec, model_spec

PyTree = Any
# model-section keys that are not ModelConfig fields (init_from: scaleopt.train.convert)
MODEL_KEYS = tuple(f.name for f in dataclasses.fields(ModelKeys))


def model_config(section) -> models.ModelConfig:
  """ModelConfig from the ``model`` section (a mapping, or a validated ``ModelSpec``, whose
  resolved config it returns): ``preset`` (default ``ModelKeys.preset``), optional
  ``variant`` (a scale-vector variant name) and any ModelConfig field as an override."""
  if isinstance(section, ModelSpec):
    return section.config
  fields = {f.name for f in dataclasses.fields(models.ModelConfig)}
  bad = [k for k in section if k not in fields and k not in MODEL_KEYS]
  if bad:
    raise ValueError(f"unknown key 'model.{bad[0]}'; allowed: {sorted(MODEL_KEYS)} and the "
                     f"ModelConfig fields {sorted(fields)}")
  cfg = models.get_preset(section.get("preset", ModelKeys.preset))
  if section.get("variant") is not None:
    cfg = cfg.with_variant(section["variant"])
  over = {k: v for k, v in section.items() if k in fields}
  if "dual_targets" in over and isinstance(over["dual_targets"], list):
    over["dual_targets"] = tuple(over["dual_targets"])
  return dataclasses.replace(cfg, **over) if over else cfg


def optimizer_config(section: dict) -> OptimizerConfig:
  """Validates the optimizer section (errors name the key and the allowed values)."""
  return OptimizerConfig.from_dict(section)


class Built(NamedTuple):
  """A run's optimizer: the chain, its collector spec and its learning-rate schedule (one
  schedule, which the chain steps with and the lr metric reads)."""
  tx: Any
  spec: CollectorSpec
  schedule: Callable


def build_optimizer(section, wd_mask=None, sparse_filter=None, shard_dims=None) -> Built:
  """(tx, spec, schedule) for the optimizer section (a mapping or ``OptimizerConfig``):
  the schedule is made once and passed to ``optim.build``."""
  cfg = OptimizerConfig.from_dict(section)
  schedule = make_schedule(cfg.schedule, cfg.learning_rate)
  tx, spec = build(cfg, wd_mask=wd_mask, sparse_filter=sparse_filter, shard_dims=shard_dims,
                   schedule=schedule)
  return Built(tx, spec, schedule)


def run_optimizer(section, wd_policy: str) -> Built:
  """The optimizer a training run steps with: weight decay under ``wd_policy``, embeddings
  through ``sparse_filter``, Shampoo's blocks ordered by the model's FSDP dims. Every argument
  is a function of the parameters, so it is built from the config alone (once, when the
  config is validated: ``TrainConfig.optimizer_built``)."""
  return build_optimizer(section, wd_mask=lambda p: models.weight_decay_mask(p, wd_policy),
                         sparse_filter=sparse_filter, shard_dims=models.fsdp_dims)


def sparse_filter(params: PyTree) -> PyTree:
  """True for embeddings and untied heads (trained without cross-fitting)."""
  return jax.tree_util.tree_map_with_path(lambda p, _: models.is_embedding(p), params)


def passes_per_step(spec: CollectorSpec) -> float:
  """Forward+backward sweeps per step over the step's distinct examples (for MFU); see
  ``CollectorSpec.passes_per_step``."""
  return spec.passes_per_step


@dataclasses.dataclass(frozen=True)
class Model:
  """The model's functions; with ``mesh`` set they trace under ``models.sharding.constraints``
  (FSDP / tensor-parallel activation and kernel layouts, see ``scaleopt.models.sharding``)."""
  cfg: models.ModelConfig
  init: Callable
  apply: Callable  # (params, tokens) -> (logits float32, aux)
  wd_policy: str
  init_from: str | None = None  # a parameter source (scaleopt.train.convert) for fresh runs
  mesh: Any = None
  # (params, tokens, targets) -> (mean CE, aux) without float32 logits (models.functional_loss);
  # None: lm_loss on ``apply``'s logits.
  loss_apply: Optional[Callable] = None
  # (params, tokens, targets) -> per-token CE [B, T] (models.functional_nll); None: from
  # ``apply``'s logits.
  nll_apply: Optional[Callable] = None

  def with_mesh(self, mesh) -> "Model":
    return dataclasses.replace(self, mesh=mesh)

  def loss_fn(self, params, tokens_BxT1):
    """(params, tokens [B, T+1]) -> (loss, aux): next-token CE (+ MoE aux loss)."""
    with models.sharding.constraints(self.mesh):
      return self._loss(params, tokens_BxT1)

  def _loss(self, params, tokens_BxT1):
    inputs, targets = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
    if self.loss_apply is not None:
      ce, aux = self.loss_apply(params, inputs, targets)
    else:
      logits, aux = self.apply(params, inputs)
      ce = models.lm_loss(logits, targets)
    out = {"ce": ce}
    loss = ce
    if self.cfg.is_moe and "moe_aux_loss" in aux:
      loss = ce + aux["moe_aux_loss"]
      out["moe_aux_loss"] = aux["moe_aux_loss"]
    return loss, out

  def window_ce(self, params, tokens_BxT1):
    """(params, tokens [B, T+1]) -> [B] float32: each window's mean next-token CE."""
    inputs, targets = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
    with models.sharding.constraints(self.mesh):
      if self.nll_apply is not None:
        nll = self.nll_apply(params, inputs, targets)
      else:
        nll = models.transformer.token_xent(self.apply(params, inputs)[0], targets)
    return jnp.mean(nll, axis=-1)

  def logits_fn(self, params, tokens_BxT1):
    """(params, mb) -> (logits, mask) for Sophia's sampled-label (GNB) pass."""
    with models.sharding.constraints(self.mesh):
      logits, _ = self.apply(params, tokens_BxT1[:, :-1])
    return logits, jnp.ones(tokens_BxT1[:, 1:].shape, jnp.float32)


def make_model(spec) -> Model:
  """The model of a validated ``ModelSpec`` (a raw section mapping is validated first)."""
  if not isinstance(spec, ModelSpec):
    spec = model_spec(spec)
  cfg = spec.config
  init, apply = models.functional(cfg)
  return Model(cfg=cfg, init=init, apply=apply, loss_apply=models.functional_loss(cfg),
               nll_apply=models.functional_nll(cfg), wd_policy=spec.wd_policy,
               init_from=spec.init_from)
