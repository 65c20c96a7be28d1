"""ModelConfig validation, presets and named variants."""

import dataclasses

import pytest

from scaleopt import models
from scaleopt.models import config as C


@pytest.mark.parametrize("field,value,allowed", [
    ("scales", "shared", "standard"),
    ("dual", "both", "dnp"),
    ("reparam", "polar", "or_product"),
    ("remat", "all", "dots"),
    ("attention_impl", "flash", "cudnn"),
    ("dtype", "int8", "bfloat16"),
    ("final_scale_role", "both", "output"),
    ("dual_targets", ("q", "o"), "gate"),
])
def test_bad_choice_names_field_and_allowed_values(field, value, allowed):
  with pytest.raises(ValueError) as e:
    models.ModelConfig(**{field: value})
  msg = str(e.value)
  assert field in msg and repr(value if field != "dual_targets" else "o") in msg
  assert allowed in msg


@pytest.mark.parametrize("kw,field", [
    (dict(d_model=0), "d_model"),
    (dict(n_kv_heads=3), "n_kv_heads"),
    (dict(d_model=66, n_heads=4), "d_model"),
    (dict(n_experts=4, moe_top_k=5), "moe_top_k"),
    (dict(n_experts=4, moe_every=3), "moe_every"),
    (dict(n_experts=-1), "n_experts"),
    (dict(scan_unroll=-1), "scan_unroll"),
    (dict(qk_norm=True, dual="dnp"), "qk_norm"),
])
def test_bad_values_name_field(kw, field):
  with pytest.raises(ValueError, match=field):
    models.ModelConfig(**kw)


def test_config_is_frozen_and_replace_validates():
  cfg = models.get_preset("tiny")
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.d_model = 3
  with pytest.raises(ValueError, match="scales"):
    cfg.replace(scales="bogus")


def test_presets_and_unknown_name():
  for name in ("tiny", "gpt2-small", "qwen2.5-0.5b", "moe-small"):
    assert isinstance(models.get_preset(name), models.ModelConfig)
  with pytest.raises(ValueError, match="gpt2-small"):
    models.get_preset("gpt5")
  q = models.get_preset("qwen2.5-0.5b")
  assert (q.d_model, q.n_layers, q.n_heads, q.n_kv_heads, q.d_ff, q.vocab_size) == (
      896, 24, 14, 2, 4864, 151936)
  assert q.tie_embeddings and q.qkv_bias
  m = models.get_preset("moe-small")
  assert m.is_moe and m.n_experts == 8 and m.moe_top_k == 2


def test_variants_set_flags():
  cfg = models.get_preset("tiny")
  u = cfg.with_variant("unified")
  assert (u.scales, u.dual, u.reparam) == ("hg", "dnp", "or_product")
  assert models.VARIANTS["unified"]["wd_policy"] == "iwd"
  assert cfg.with_variant("none").scales == "none"
  with pytest.raises(ValueError, match="variant"):
    cfg.with_variant("magic")
  assert set(C.VARIANTS) >= {"none", "standard", "hg", "dp", "dnp", "or_product",
                             "or_normalized", "unified"}
