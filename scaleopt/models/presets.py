"""Named model configurations (all with ``scales='standard'``; use ``with_variant``).

The GPU-size dense presets unroll the whole layer scan (``scan_unroll=0``): the faster form on
GPUs (docs/models.md, Performance); set ``scan_unroll=1`` for a rolled loop
when compile time matters more."""

from __future__ import annotations

from scaleopt.models.config import ModelConfig

PRESETS: dict[str, ModelConfig] = {
    # CPU tests: 2 layers, GQA 4/2 heads of 16.
    "tiny": ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=128, max_seq_len=64),
    # Tiny MoE for CPU tests: layer 1 of 2 is MoE (4 experts, top-2).
    "tiny-moe": ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
                            d_ff=128, n_experts=4, moe_top_k=2, moe_every=2, moe_d_ff=64,
                            max_seq_len=64),
    # GPT-2 small shapes (12 x 768, 12 heads, tied) with RMSNorm/RoPE/SwiGLU; d_ff = 2048 keeps
    # the MLP at GPT-2's 2 * 768 * 3072 weights; vocab 50257 padded to 50304 (multiple of 128).
    # 123.6M parameters.
    "gpt2-small": ModelConfig(vocab_size=50304, d_model=768, n_layers=12, n_heads=12,
                              n_kv_heads=12, d_ff=2048, max_seq_len=1024, scan_unroll=0),
    # Qwen2.5-0.5B shapes: 494,032,768 parameters (the published size).
    "qwen2.5-0.5b": ModelConfig(vocab_size=151936, d_model=896, n_layers=24, n_heads=14,
                                n_kv_heads=2, d_ff=4864, qkv_bias=True, rope_theta=1e6,
                                norm_eps=1e-6, max_seq_len=4096, scan_unroll=0),
    # Small MoE: 8 x 512, 8 experts top-2, MoE every other layer.
    "moe-small": ModelConfig(vocab_size=50304, d_model=512, n_layers=8, n_heads=8,
                             n_kv_heads=8, d_ff=1536, n_experts=8, moe_top_k=2, moe_every=2,
                             moe_d_ff=1024, max_seq_len=1024),
}


def get_preset(name: str) -> ModelConfig:
  """The preset ``name``; raises ValueError listing the known names."""
  if name not in PRESETS:
    raise ValueError(f"model preset {name!r} is unknown; choose one of {tuple(PRESETS)}")
  return PRESETS[name]
