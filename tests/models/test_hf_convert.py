"""Hugging Face checkpoints: logits against transformers' own, round trips, fine-tuning.

The fixtures (tests/models/fixtures/{qwen2,llama}) are tiny random models written by
scripts/make_hf_fixture.py with transformers, together with the logits transformers computed
for fixed tokens; nothing here needs torch.
"""

import json
import pathlib

import jax
import numpy as np
import pytest
import yaml

pytest.importorskip("safetensors")
from safetensors.numpy import load_file, save_file

from scaleopt import models
from scaleopt.models import hf
from scaleopt.train import data as D
from scaleopt.train.convert import convert_main
from scaleopt.train.main import train_main

FIX = pathlib.Path(__file__).parent / "fixtures"


def _logits(cfg, params, tokens):
  _, apply = models.functional(cfg.replace(dtype="float32", logits_dot_in_fp32=True))
  return np.asarray(apply(jax.tree.map(np.asarray, params), tokens)[0])


@pytest.mark.parametrize("name, arch", [("qwen2", dict(qkv_bias=True, tie_embeddings=False,
                                                       rope_theta=1e6, norm_eps=1e-6)),
                                        ("llama", dict(qkv_bias=False, tie_embeddings=True,
                                                       rope_theta=1e4, norm_eps=1e-5))])
def test_logits_match_transformers(name, arch):
  cfg, params = hf.load_hf(FIX / name)
  for k, v in arch.items():
    assert getattr(cfg, k) == v, k
  ref = np.load(FIX / name / "reference.npz")
  got = _logits(cfg, params, ref["tokens"])
  assert np.abs(ref["logits"]).max() > 1.0  # random weights: logits of order one, not ~0
  np.testing.assert_allclose(got, ref["logits"], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["qwen2", "llama"])
def test_import_export_round_trip_is_exact(tmp_path, name):
  assert convert_main("import", str(FIX / name), str(tmp_path / "conv")) == 0
  assert convert_main("export", str(tmp_path / "conv"), str(tmp_path / "out")) == 0
  a, b = load_file(str(FIX / name / "model.safetensors")), load_file(
      str(tmp_path / "out" / "model.safetensors"))
  assert sorted(a) == sorted(b)
  for k in a:
    assert b[k].dtype == np.float32 and np.array_equal(a[k], b[k]), k
  orig = json.loads((FIX / name / "config.json").read_text())
  back = json.loads((tmp_path / "out" / "config.json").read_text())
  assert hf.config_from_hf(back) == hf.config_from_hf(orig)
  assert back["architectures"] == orig["architectures"]


def test_bfloat16_export_rounds_each_tensor(tmp_path):
  assert convert_main("export", str(FIX / "qwen2"), str(tmp_path / "o"), dtype="bfloat16") == 0
  import ml_dtypes
  a, b = load_file(str(FIX / "qwen2" / "model.safetensors")), load_file(
      str(tmp_path / "o" / "model.safetensors"))
  for k in a:
    assert b[k].dtype == ml_dtypes.bfloat16
    assert np.array_equal(b[k], a[k].astype(ml_dtypes.bfloat16)), k


def test_folded_scale_variants_export_to_the_same_function():
  cfg, params = hf.load_hf(FIX / "qwen2")
  ref = np.load(FIX / "qwen2" / "reference.npz")
  # the same function written as an OR-reparameterized HG model: gamma = beta * alpha
  hg = cfg.with_variant("hg").replace(reparam="or_product")
  p = jax.tree.map(np.array, params)
  for blk, names in (("attn", "qkv"), ("mlp", ("gate", "up"))):
    g = p["blocks"]["b0"][blk].pop("in_scale")["gamma"]
    for n in names:
      p["blocks"]["b0"][blk][f"in_scale_{n}"] = {"beta": np.full(g.shape[:-1], 2.0, np.float32),
                                                 "alpha": g / 2}
  g = p.pop("in_scale_final")["gamma"]
  p["in_scale_final"] = {"beta": np.array(0.5, np.float32), "alpha": 2 * g}
  cfg_out, tensors = hf.params_to_hf(hg, p)
  back = hf.params_from_hf(cfg_out, tensors)
  np.testing.assert_allclose(_logits(cfg_out, back, ref["tokens"]), ref["logits"], atol=1e-4)


def test_unconvertible_inputs_are_one_line_errors(tmp_path, capsys):
  bad = tmp_path / "gpt2"
  bad.mkdir()
  (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
  save_file({"x": np.zeros(2, np.float32)}, str(bad / "model.safetensors"))
  assert convert_main("import", str(bad), str(tmp_path / "o")) == 2
  err = capsys.readouterr().err.strip()
  assert "GPT2LMHeadModel" in err and "\n" not in err
  t = load_file(str(FIX / "qwen2" / "model.safetensors"))
  del t["model.layers.1.self_attn.k_proj.bias"]
  miss = tmp_path / "miss"
  miss.mkdir()
  (miss / "config.json").write_text((FIX / "qwen2" / "config.json").read_text())
  save_file(t, str(miss / "model.safetensors"))
  assert convert_main("import", str(miss), str(tmp_path / "o2")) == 2
  assert "model.layers.1.self_attn.k_proj.bias" in capsys.readouterr().err
  with pytest.raises(hf.ConversionError, match="dual"):
    hf.params_to_hf(models.get_preset("tiny").with_variant("dnp"), {})
  with pytest.raises(hf.ConversionError, match="n_experts"):
    hf.config_to_hf(models.get_preset("tiny-moe"))


@pytest.mark.integration
def test_fine_tune_from_hf_weights_with_adamw_bc_then_export(tmp_path, capsys):
  shards = tmp_path / "shards"
  shards.mkdir()
  rng = np.random.default_rng(0)
  for split, n in (("train", 20_000), ("val", 2_000)):
    D.write_shard(shards / f"{split}_000", rng.integers(0, 96, n), 96, "test", separator=7)
  tok = FIX / "qwen2_tokenizer" / "tokenizer.json"  # the shards' tokenizer (any file will do)
  (shards / "tokenizer.json").write_bytes(tok.read_bytes())
  run = tmp_path / "run"
  cfg = tmp_path / "ft.yaml"
  body = {
      "run": {"steps": 3, "log_every": 1, "eval_every": 0, "eval_tokens": 256,
              "checkpoint_every": 0, "progress": False, "plot": False},
      "model": {"preset": "tiny", "vocab_size": 96, "d_model": 32, "n_layers": 2,
                "n_heads": 4, "n_kv_heads": 2, "d_ff": 64, "qkv_bias": True,
                "tie_embeddings": False, "rope_theta": 1e6, "norm_eps": 1e-6,
                "dtype": "float32"},
      "data": {"source": "shards", "path": str(shards), "seq_len": 16, "batch_size": 8,
               "microbatches": 2},
      "optimizer": {"name": "adamw_bc", "learning_rate": 1e-3, "weight_decay": 0.0,
                    "extra": {"mode": "full", "crossfit": "loo"},
                    "schedule": {"kind": "constant"}}}
  cfg.write_text(yaml.safe_dump(body))
  init = [f"model.init_from={FIX / 'qwen2'}"]
  assert train_main(str(cfg), str(tmp_path / "bad"), init + ["model.rope_theta=10000"]) == 2
  err = capsys.readouterr().err
  assert "model.rope_theta=10000" in err and "but model.init_from" in err
  assert train_main(str(cfg), str(run), init) == 0
  assert convert_main("export", str(run), str(tmp_path / "hf_out")) == 0
  a, b = load_file(str(FIX / "qwen2" / "model.safetensors")), load_file(
      str(tmp_path / "hf_out" / "model.safetensors"))
  assert sorted(a) == sorted(b)
  # the run started from a Hugging Face directory: its config.json is the base of the export
  assert "transformers_version" in json.loads((tmp_path / "hf_out" / "config.json").read_text())
  delta = max(float(np.abs(a[k] - b[k]).max()) for k in a)
  # started from the checkpoint (a fresh init would be O(1) away) and moved by ~lr per step
  assert 0 < delta < 3 * 10 * 1e-3, delta
  # the run's tokenizer, its document separator as bos/eos and the trained context length
  out = json.loads((tmp_path / "hf_out" / "config.json").read_text())
  assert (out["bos_token_id"], out["eos_token_id"], out["max_position_embeddings"]) == (7, 7, 16)
  assert (tmp_path / "hf_out" / "tokenizer.json").read_bytes() == tok.read_bytes()


def test_a_byte_level_run_exports_a_tokenizer_note(tmp_path):
  from scaleopt.train import convert
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.yaml").write_text(yaml.safe_dump({"data": {"source": "embedded",
                                                            "seq_len": 48}}))
  assert convert._run_tokenizer(run, tmp_path / "out") == {"bos_token_id": 0, "eos_token_id": 0}
  note = (tmp_path / "out" / "TOKENIZER.md").read_text()
  assert "UTF-8 bytes" in note and "Id 0 separates documents" in note
  assert not (tmp_path / "out" / "tokenizer.json").exists()
  assert convert._trained_seq_len(run) == 48


def test_tokenizer_files_travel_with_the_conversion(tmp_path):
  src = tmp_path / "src"
  src.mkdir()
  for f in ("config.json", "model.safetensors"):
    (src / f).write_bytes((FIX / "qwen2" / f).read_bytes())
  for f in ("tokenizer.json", "tokenizer_config.json"):
    (src / f).write_bytes((FIX / "qwen2_tokenizer" / f).read_bytes())
  assert convert_main("import", str(src), str(tmp_path / "conv")) == 0
  assert convert_main("export", str(tmp_path / "conv"), str(tmp_path / "out")) == 0
  for f in ("tokenizer.json", "tokenizer_config.json"):
    assert (tmp_path / "out" / f).read_bytes() == (src / f).read_bytes()


def test_init_from_takes_the_architecture_from_the_source(tmp_path):
  from scaleopt.train import bridge, config as C, convert
  src = FIX / "qwen2"
  want = hf.config_from_hf(json.loads((src / "config.json").read_text()))
  raw = {"model": {"preset": "tiny", "dtype": "float32", "init_from": str(src)},
         "optimizer": {"name": "adamw"}}
  cfg = C.from_dict(raw)
  got = bridge.model_config(cfg.model)
  for f in convert.architecture_fields():
    assert getattr(got, f) == getattr(want, f), f
  assert got.dtype == "float32"  # a setting that does not change the parameters stays
  convert.check_matches(convert.open_source(src), got)
  # the recorded config names the whole architecture: it loads without the source
  C.dump_config(bridge.with_source_architecture(cfg), tmp_path / "config.yaml")
  saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
  saved["model"]["init_from"] = str(tmp_path / "gone")
  assert bridge.model_config(C.from_dict(saved).model) == got
  # a field set to another value than the source's is named
  raw["model"].update(n_heads=want.n_heads * 2, rope_theta=10.0)  # every difference at once
  with pytest.raises(convert.SourceError, match="model.n_heads=.*; model.rope_theta=10.0"):
    convert.check_matches(convert.open_source(src),
                          bridge.model_config(C.from_dict(raw).model))
