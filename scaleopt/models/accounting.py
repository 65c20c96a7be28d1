"""Closed-form parameter and FLOP accounting (for MFU reporting and preset checks).

Notation: d = d_model, L = n_layers, H = n_heads, K = n_kv_heads, h = d_head, F = d_ff,
V = vocab, E = n_experts, k = top-k, F_e = expert hidden size, T = sequence length.
"""

from __future__ import annotations

import math

from scaleopt.models.config import ModelConfig

# Dense bf16 peak per card (no 2:4 sparsity), FLOP/s.
PEAK_FLOPS = {
    "H100": 989e12,  # H100 SXM
    "H200": 989e12,  # same GH100 compute as H100 SXM
    "A100": 312e12,
}


def _scale_size(shape: tuple[int, ...], reparam: str) -> int:
  """Parameters of one scale vector: gamma, or OR's alpha plus one beta per vector."""
  n = math.prod(shape)
  return n if reparam == "none" else n + math.prod(shape[:-1])


def _attention_params(cfg: ModelConfig) -> int:
  d, h, kv, dh, r = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.reparam
  n = d * (h + 2 * kv) * dh + h * dh * d
  if cfg.qkv_bias:
    n += (h + 2 * kv) * dh
  n += {"none": 0, "standard": 1, "hg": 3}[cfg.scales] * _scale_size((d,), r)
  n += sum(_scale_size((w,), r) for t, w in (("q", h * dh), ("k", kv * dh), ("v", kv * dh))
           if cfg.dual_on(t))
  if cfg.qk_norm:
    n += 2 * _scale_size((dh,), r)
  return n


def _mlp_params(cfg: ModelConfig, moe: bool) -> int:
  d, r = cfg.d_model, cfg.reparam
  e = cfg.n_experts if moe else 1
  f = cfg.expert_d_ff if moe else cfg.d_ff
  lead = (cfg.n_experts,) if moe else ()
  n = 3 * e * d * f
  if moe:
    n += d * cfg.n_experts  # router
  if cfg.scales == "standard":
    n += _scale_size((d,), r)
  elif cfg.scales == "hg":
    per = lead if cfg.moe_hg_per_expert else ()
    n += 2 * _scale_size((*per, d), r) + (_scale_size((d,), r) if moe else 0)
  n += sum(_scale_size((*lead, f), r) for t in ("gate", "up") if cfg.dual_on(t))
  return n


def count_params(cfg: ModelConfig) -> int:
  """Total parameters:

  V d (embedding) + [d V (untied head)] + [final scale] + sum over layers of
    attention  d (H + 2K) h + H h d  (+ (H + 2K) h biases, + scales)
    MLP        3 d F,  or MoE: d E (router) + 3 E d F_e  (+ scales)
    sandwich   2 d when post_norm
  where a scale of n entries costs n (or n + 1 per vector with OR reparameterization).
  """
  cfg.validate()
  d, r = cfg.d_model, cfg.reparam
  n = cfg.vocab_size * d
  if not cfg.tie_embeddings:
    n += d * cfg.vocab_size
  if cfg.scales != "none":
    n += _scale_size((d,), r)
  for layer in range(cfg.n_layers):
    moe = cfg.is_moe and (layer % cfg.period == cfg.period - 1)
    n += _attention_params(cfg) + _mlp_params(cfg, moe)
    if cfg.post_norm:
      n += 2 * _scale_size((d,), r)
  return n


def matmul_params_per_token(cfg: ModelConfig) -> int:
  """Active matmul weights N seen by one token: attention + MLP (router + top-k experts for
  MoE layers) per layer + the LM head ``d V``. Embedding lookups, norms and scales excluded."""
  d, h, kv, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head
  attn = d * (h + 2 * kv) * dh + h * dh * d
  dense_mlp = 3 * d * cfg.d_ff
  moe_mlp = d * cfg.n_experts + cfg.moe_top_k * 3 * d * cfg.expert_d_ff
  n_moe = cfg.n_moe_layers
  return (cfg.n_layers * attn + (cfg.n_layers - n_moe) * dense_mlp + n_moe * moe_mlp
          + d * cfg.vocab_size)


def flops_per_token(cfg: ModelConfig, seq_len: int | None = None, causal: bool = False) -> float:
  """Training FLOPs per token (forward + backward), PaLM-style:

      6 N + 12 L T H h        (N = matmul_params_per_token(cfg))

  The attention term counts the full T x T score and value matmuls (PaLM, nanoGPT); with
  ``causal=True`` it is halved (MaxText since 2025). MoE capacity padding is not counted.
  """
  t = cfg.max_seq_len if seq_len is None else seq_len
  attn = 12 * cfg.n_layers * t * cfg.n_heads * cfg.d_head
  return 6.0 * matmul_params_per_token(cfg) + (attn / 2 if causal else attn)


def mfu(tokens_per_s: float, cfg: ModelConfig, seq_len: int, peak_flops: float) -> float:
  """Model FLOP utilization: ``tokens/s * flops_per_token / peak``."""
  return tokens_per_s * flops_per_token(cfg, seq_len) / peak_flops
