"""Parameter roles, weight-decay masks and logical sharding specs."""

import jax
import numpy as np
import optax
import pytest

from scaleopt import models
from models_testlib import tiny, tiny_moe


def _shapes(cfg):
  return jax.eval_shape(models.functional(cfg)[0], jax.random.key(0))


def _count(params, pred):
  return sum(int(np.prod(x.shape)) for (p, x) in jax.tree_util.tree_leaves_with_path(params)
             if pred(p))


def test_roles_and_counts_per_label_unified_moe():
  cfg = tiny_moe(post_norm=True, tie_embeddings=False).with_variant("unified")
  params = _shapes(cfg)
  roles = models.param_roles(params)
  assert set(jax.tree.leaves(roles)) <= set(models.ROLES)
  # Independent closed-form counts per role (d=64, L=2 -> one unit of b0 dense + b1 MoE).
  d, f, fe, e, v, h, kv, dh = 64, 128, 64, 4, 256, 4, 2, 16
  or_ = lambda n, k=1: n + k  # OR: alpha (n) + one beta per vector (k)
  want = {
      "embedding": v * d,
      "head": d * v,
      "router": d * e,
      "matrix": 2 * (d * (h + 2 * kv) * dh + h * dh * d) + 3 * d * f + 3 * e * d * fe,
      "input_norm_scale": (
          2 * 3 * or_(d)                      # HG q, k, v per layer
          + 2 * or_(d)                        # dense gate, up
          + 2 * or_(e * d, e) + or_(d)        # per-expert gate, up; router
          + 2 * or_(kv * dh)                  # DNP on v (absorbed by W_o) per layer
          + or_(f) + or_(e * fe, e)           # DNP on up (absorbed by W_down)
          + or_(d)),                          # final (untied head)
      "output_norm_scale": (
          2 * (or_(h * dh) + or_(kv * dh))    # DNP on q, k
          + or_(f) + or_(e * fe, e)           # DNP on gate (SiLU follows)
          + 2 * 2 * or_(d)),                  # sandwich norms
  }
  for role, n in want.items():
    got = sum(int(np.prod(x.shape)) for x, r in zip(jax.tree.leaves(params), jax.tree.leaves(roles))
              if r == role)
    assert got == n, role
  assert sum(want.values()) == models.count_params(cfg)


@pytest.mark.parametrize("cfg", [
    tiny(qk_norm=True, post_norm=True, qkv_bias=True),
    tiny(tie_embeddings=True, final_scale_role="output", dual="dp"),
    tiny().with_variant("unified"),
    tiny_moe().with_variant("unified"),
], ids=["qknorm-post-bias", "tied-output-final-dp", "unified", "moe-unified"])
def test_iwd_never_decays_output_norm_scales(cfg):
  params = _shapes(cfg)
  roles = jax.tree.leaves(models.param_roles(params))
  iwd = jax.tree.leaves(models.weight_decay_mask(params, "iwd"))
  alls = jax.tree.leaves(models.weight_decay_mask(params, "all"))
  mat = jax.tree.leaves(models.weight_decay_mask(params, "matrices-only"))
  names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
  assert any(r == "output_norm_scale" for r in roles)
  for name, r, a, b, c in zip(names, roles, iwd, alls, mat):
    assert b, name  # "all" decays everything
    if r == "output_norm_scale":
      assert not a and "out_scale" in name, name
    if r in ("input_norm_scale", "row_scale"):
      assert a and not c, name
    if r in ("matrix", "embedding", "head", "router"):
      assert a and c, name
    if r == "bias":
      assert not a and not c, name


def test_policy_parameter_counts_standard_tiny():
  cfg = tiny(tie_embeddings=False, qkv_bias=True)
  params = _shapes(cfg)
  d, f, v, h, kv, dh, l = 64, 128, 256, 4, 2, 16, 2
  matrices = v * d + d * v + l * (d * (h + 2 * kv) * dh + h * dh * d + 3 * d * f)
  scales = l * 2 * d + d
  biases = l * (h + 2 * kv) * dh
  count = lambda pol: sum(int(np.prod(x.shape)) for x, m in zip(
      jax.tree.leaves(params), jax.tree.leaves(models.weight_decay_mask(params, pol))) if m)
  assert count("all") == matrices + scales + biases == models.count_params(cfg)
  assert count("matrices-only") == matrices
  assert count("iwd") == matrices + scales
  with pytest.raises(ValueError, match="iwd"):
    models.weight_decay_mask(params, "none-of-these")


def test_is_embedding_and_role_of_paths():
  assert models.is_embedding("embed/embedding")
  assert models.is_embedding("head/kernel")
  assert not models.is_embedding("blocks/b0/attn/wq/kernel")
  assert models.role_of("blocks/b0/attn/in_scale_q/gamma") == "input_norm_scale"
  assert models.role_of("blocks/b0/attn/dnp_out_scale_q/beta") == "output_norm_scale"
  assert models.role_of("blocks/b0/mlp/row_scale_up/alpha") == "row_scale"
  assert models.role_of("blocks/b0/mlp/experts/wgate/kernel") == "matrix"
  with pytest.raises(ValueError, match="role"):
    models.role_of("blocks/b0/mystery")


@pytest.mark.integration  # an optax training step on the model: second tier
def test_masks_work_with_optax_and_pure_dict_params():
  cfg = tiny()
  params = models.functional(cfg)[0](jax.random.key(0))
  mask = models.weight_decay_mask(params, "iwd")
  tx = optax.add_decayed_weights(1.0, mask=mask)
  upd, _ = tx.update(jax.tree.map(lambda x: 0 * x, params), tx.init(params), params)
  for u, p, m in zip(jax.tree.leaves(upd), jax.tree.leaves(params), jax.tree.leaves(mask)):
    np.testing.assert_array_equal(u, p if m else 0 * p)


def test_partition_rules():
  cfg = tiny_moe(qkv_bias=True)
  params = _shapes(cfg)
  specs = models.logical_specs(cfg, params)
  flat = jax.tree_util.tree_leaves_with_path(params)
  spec_of = models.partition_rules(cfg)
  for path, x in flat:
    s = spec_of(path, x.shape)
    assert len(s) == len(x.shape)
    name = jax.tree_util.keystr(path)
    if "scale" in name or "bias" in name:
      assert all(a is None for a in s), name
  b0 = specs["blocks"]["b0"]
  assert b0["attn"]["wq"]["kernel"] == (None, "fsdp", "tensor")
  assert b0["attn"]["wo"]["kernel"] == (None, "tensor", "fsdp")
  assert specs["blocks"]["b1"]["mlp"]["experts"]["wgate"]["kernel"] == (
      None, "expert", "fsdp", "tensor")
  assert specs["embed"]["embedding"] == ("tensor", "fsdp")
