"""Inference export: folding random scale vectors into kernels preserves the logits."""

import jax
import numpy as np
import pytest

from scaleopt import models
from models_testlib import init_params, jit_apply, randomize_scales, tiny, tiny_moe, tokens

slow = pytest.mark.slow
FOLD_CASES = [
    pytest.param(tiny(dual="dp", qkv_bias=True, tie_embeddings=False),
                 marks=pytest.mark.integration),  # the two heaviest: second tier
    tiny(qk_norm=True, final_scale_role="output", reparam="or_product"),
    tiny(dual="dnp", reparam="or_normalized", post_norm=True),
    tiny(n_kv_heads=1).with_variant("unified"),
    pytest.param(tiny_moe(moe_capacity_factor=0.0).with_variant("unified"),
                 marks=pytest.mark.integration),
    pytest.param(tiny(), marks=slow),
    pytest.param(tiny(scales="hg", qkv_bias=True), marks=slow),
    pytest.param(tiny(scales="hg", dual="dp", reparam="or_product"), marks=slow),
    pytest.param(tiny().with_variant("unified"), marks=slow),
    pytest.param(tiny_moe(moe_capacity_factor=0.0, scales="hg", moe_hg_per_expert=False,
                          dual="dp"), marks=slow),
]


def _id(c):
  return f"{c.scales}-{c.dual}-{c.reparam}-kv{c.n_kv_heads}-moe{c.n_experts}-tie{c.tie_embeddings}"


@pytest.mark.parametrize("cfg", FOLD_CASES, ids=_id)
def test_fold_random_scales_gives_same_logits(cfg):
  params = randomize_scales(init_params(cfg), seed=3, spread=0.5)
  toks = tokens(cfg)
  ref = jit_apply(cfg)(params, toks)[0]
  cfg_i, params_i = models.fold_scales(cfg, params)
  assert cfg_i.scales == "none" and cfg_i.reparam == "none" and cfg_i.dual != "dp"
  # The folded tree has exactly the structure of a fresh inference model.
  shapes = jax.eval_shape(models.functional(cfg_i)[0], jax.random.key(0))
  assert jax.tree.structure(shapes) == jax.tree.structure(params_i)
  jax.tree.map(lambda s, p: np.testing.assert_equal(s.shape, p.shape), shapes, params_i)
  # Nothing foldable is left: only Output-Norm scales and DNP in-scales reset to one.
  roles = models.param_roles(params_i)
  for (path, role), leaf in zip(jax.tree_util.tree_leaves_with_path(roles),
                                jax.tree.leaves(params_i)):
    if role in ("input_norm_scale", "row_scale"):
      assert "dnp_in_scale" in jax.tree_util.keystr(path)
      np.testing.assert_array_equal(np.asarray(leaf), 1.0)
  out = jit_apply(cfg_i)(params_i, toks)[0]
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-4, atol=2e-5)


