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
from scaleopt.train import convert
from scaleopt.train.config import (ConfigError, ModelSpec, TrainConfig, model_spec,
                                   resolve_model_config)

PyTree = Any


def with_source_architecture(cfg: TrainConfig) -> TrainConfig:
  """``cfg`` with its model resolved: where ``model.init_from`` names a source and the section
  leaves architecture fields to it, the source's config is read (no tensors) and those fields
  taken from it (``convert.with_architecture``), so the run's recorded config names the whole
  architecture and resumes without the source. Called when the trainer starts."""
  return dataclasses.replace(cfg, model=resolve_model(cfg.model))


def resolve_model(spec: ModelSpec) -> ModelSpec:
  """A model spec whose ``config`` is set (``with_source_architecture``)."""
  if spec.config is not None:
    return spec
  resolved = model_spec(convert.with_architecture(spec.section))
  if resolved.config is None:
    raise ConfigError(f"model.init_from={spec.init_from!r} leaves architecture fields unset")
  return resolved


def model_config(section) -> models.ModelConfig:
  """ModelConfig from the ``model`` section: a mapping (``config.resolve_model_config``), or a
  validated ``ModelSpec``, whose resolved config it returns (a source's architecture read by
  ``resolve_model``)."""
  if isinstance(section, ModelSpec):
    return resolve_model(section).config
  return resolve_model_config(section)


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


def run_optimizer(cfg: TrainConfig) -> Built:
  """The optimizer a training run steps with, built once by the trainer's setup (and by the
  study, once per group of cells) from the typed sections: weight decay under
  ``model.wd_policy``, embeddings through ``sparse_filter``, Shampoo's blocks ordered by the
  model's FSDP dims. Every argument is a function of the parameters, so the config alone
  builds it. A value ``scaleopt.optim`` refuses is a ConfigError."""
  wd_policy = cfg.model.wd_policy
  try:
    return build_optimizer(cfg.optimizer,
                           wd_mask=lambda p: models.weight_decay_mask(p, wd_policy),
                           sparse_filter=sparse_filter, shard_dims=models.fsdp_dims)
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config section 'optimizer': {e}") from None


def sparse_filter(params: PyTree) -> PyTree:
  """True for embeddings and untied heads (trained without cross-fitting)."""
  return jax.tree_util.tree_map_with_path(lambda p, _: models.is_embedding(p), params)


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
  """The model of a validated ``ModelSpec`` (a raw section mapping is validated first; a
  ``model.init_from`` source's architecture is read where the section leaves it open)."""
  if not isinstance(spec, ModelSpec):
    spec = model_spec(spec)
  spec = resolve_model(spec)
  cfg = spec.config
  init, apply = models.functional(cfg)
  return Model(cfg=cfg, init=init, apply=apply, loss_apply=models.functional_loss(cfg),
               nll_apply=models.functional_nll(cfg), wd_policy=spec.wd_policy,
               init_from=spec.init_from)
