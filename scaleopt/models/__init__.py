"""scaleopt.models: Flax NNX language models with normalization scale-vector variants.

Public API (see docs/models.md):
  ModelConfig, VARIANTS, PRESETS, get_preset          configuration
  Transformer(cfg, rngs=nnx.Rngs(seed))(tokens)       -> (logits float32, aux)
  functional(cfg) -> (init_fn, apply_fn)              pure form over nested dicts of arrays
  lm_loss(logits, targets, mask)                      mean CE over supervised positions
  functional_loss(cfg) -> loss_fn(params, tokens, targets, mask)   fused head + CE (no f32 logits)
  functional_nll(cfg) -> nll_fn(params, tokens, targets)   per-token CE [B, T] (evaluation)
  head_loss(h, w, targets, mask, chunks), head_nll    the fused head + cross-entropy
  param_roles, role_of, is_embedding, weight_decay_mask(params, policy)
  partition_rules(cfg), logical_specs(cfg, params)    logical sharding axes per parameter
  count_params(cfg), flops_per_token(cfg, seq_len), mfu(...)
  fold_scales(cfg, params) -> (cfg_inference, params_folded)
  kernel_choices(cfg, mesh), kernel_problem(cfg)     the kernels each op runs; why one can't
  sharding.constraints(mesh)                          FSDP / tensor-parallel layouts in the model
"""

from scaleopt.models import sharding
from scaleopt.models.accounting import (PEAK_FLOPS, count_params, flops_per_token,
                                        matmul_params_per_token, mfu)
from scaleopt.models.config import VARIANTS, ModelConfig
from scaleopt.models.fold import fold_scales
from scaleopt.models.masks import (POLICIES, ROLES, fsdp_dims, is_embedding, logical_specs,
                                   param_roles, partition_rules, role_of, weight_decay_mask)
from scaleopt.models.presets import PRESETS, get_preset
from scaleopt.models.loss import head_loss, head_nll
from scaleopt.models.transformer import (Transformer, functional, functional_loss, functional_nll,
                                         kernel_choices, kernel_problem, lm_loss)

__all__ = [
    "ModelConfig", "VARIANTS", "PRESETS", "get_preset", "Transformer", "functional", "lm_loss",
    "functional_loss", "functional_nll", "head_loss", "head_nll",
    "param_roles", "role_of", "is_embedding", "weight_decay_mask", "POLICIES", "ROLES",
    "partition_rules", "logical_specs", "fsdp_dims", "count_params", "flops_per_token",
    "matmul_params_per_token", "mfu", "PEAK_FLOPS", "fold_scales", "sharding",
    "kernel_choices", "kernel_problem",
]
