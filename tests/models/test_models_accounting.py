"""Closed-form parameter and FLOP counts against independent counts."""

import jax
import pytest

from scaleopt import models
from models_testlib import n_params, tiny, tiny_moe


@pytest.mark.parametrize("cfg", [
    tiny(),
    tiny(scales="none"),
    tiny(scales="hg", dual="dp", reparam="or_product", qkv_bias=True),
    tiny(scales="hg", dual="dnp", dual_targets=("v", "up"), reparam="or_normalized",
         tie_embeddings=False, post_norm=True),
    tiny(qk_norm=True, tie_embeddings=False, final_scale_role="output"),
    tiny_moe(),
    tiny_moe(scales="hg", dual="dnp", reparam="or_product"),
    tiny_moe(scales="hg", moe_hg_per_expert=False, dual="dp"),
], ids=lambda c: f"{c.scales}-{c.dual}-{c.reparam}-moe{c.n_experts}")
def test_count_params_matches_initialized_model(cfg):
  init, _ = models.functional(cfg)
  shapes = jax.eval_shape(init, jax.random.key(0))
  assert models.count_params(cfg) == n_params(shapes)


def test_preset_sizes():
  # Qwen2.5-0.5B: published size 494,032,768 parameters (0.49B, tied embeddings).
  q = models.get_preset("qwen2.5-0.5b")
  assert models.count_params(q) == 494_032_768
  init, _ = models.functional(q)
  assert n_params(jax.eval_shape(init, jax.random.key(0))) == 494_032_768
  # GPT-2 small shapes: 124M (with vocab padded to 50304 and SwiGLU d_ff 2048).
  g = models.get_preset("gpt2-small")
  d, v, l = 768, 50304, 12
  expected = v * d + l * (4 * d * d + 3 * d * 2048 + 2 * d) + d
  assert models.count_params(g) == expected
  assert 123e6 < expected < 125e6
  m = models.get_preset("moe-small")
  assert n_params(jax.eval_shape(models.functional(m)[0], jax.random.key(0))) == (
      models.count_params(m))


def test_flops_per_token_formula():
  g = models.get_preset("gpt2-small")
  d, v, l, t = 768, 50304, 12, 1024
  n = l * (4 * d * d + 3 * d * 2048) + d * v
  assert models.flops_per_token(g, t) == 6 * n + 12 * l * t * d
  assert models.flops_per_token(g, t, causal=True) == 6 * n + 6 * l * t * d
  # MoE: router + top-k experts only.
  m = tiny_moe()
  dense = 3 * 64 * 128
  moe = 64 * 4 + 2 * 3 * 64 * 64
  attn = 64 * (4 + 2 * 2) * 16 + 64 * 64
  n = 2 * attn + dense + moe + 64 * 256
  assert models.matmul_params_per_token(m) == n
  # MFU of the 478k tokens/s reference at 989 TFLOP/s is about 41 %.
  assert abs(models.mfu(478e3, g, t, 989e12) - 0.41) < 0.01
