"""Hugging Face checkpoints <-> scaleopt parameters: the Qwen2 and Llama architectures.

scaleopt's dense model with ``scales="standard"`` is Hugging Face's ``Qwen2ForCausalLM`` when
``qkv_bias=True`` and ``LlamaForCausalLM`` when ``qkv_bias=False``, tensor for tensor:

  HF (per layer l, weights [out, in])        scaleopt (stacked on axis 0, kernels [in, out])
  model.embed_tokens.weight      [V, d]      embed/embedding
  input_layernorm.weight         [d]         blocks/b0/attn/in_scale/gamma   (scale in W_q,k,v)
  self_attn.{q,k,v}_proj.weight  [Hh, d]     blocks/b0/attn/w{q,k,v}/kernel  (transposed)
  self_attn.{q,k,v}_proj.bias    [Hh]        blocks/b0/attn/w{q,k,v}/bias    (Qwen2 only)
  self_attn.o_proj.weight        [d, Hh]     blocks/b0/attn/wo/kernel
  post_attention_layernorm.weight            blocks/b0/mlp/in_scale/gamma
  mlp.{gate,up,down}_proj.weight             blocks/b0/mlp/w{gate,up,down}/kernel
  model.norm.weight              [d]         in_scale_final/gamma
  lm_head.weight                 [V, d]      head/kernel (untied; tied: E^T)

Both compute ``RMSNorm(x) * w`` in float32 and then the projection; scaleopt multiplies ``w``
into the kernel (``diag(w) W``), which is the same map. Both use rotate-half RoPE with
``inv_freq = theta^(-2i/h)``, ``1/sqrt(h)`` attention scaling, query head ``n`` reading kv head
``n // (H / K)``, and SiLU-gated MLPs. Checked by ``tests/models/test_hf_convert.py`` against
logits computed by transformers.

Not convertible (a clear error): ``dual="dnp"``, ``qk_norm``, ``post_norm`` (no such norms in
Qwen2/Llama; Qwen3 has QK-norm but no q/k/v biases), mixture-of-experts models (``moe-small``
alternates dense and MoE layers with capacity dropping: Mixtral has MoE in every layer and no
dropping; Qwen2-MoE always adds a gated shared expert), RoPE scaling, Llama's o-projection and
MLP biases, sliding-window attention. Other scale variants (``hg``, ``dp``, OR) are exported
after :func:`scaleopt.models.fold_scales` (norm weights 1, the scales in the kernels).

Only numpy is needed for the mapping; reading and writing files needs ``safetensors``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import jax
import numpy as np

from scaleopt.models.config import ModelConfig
from scaleopt.models.fold import fold_scales
from scaleopt.models.transformer import functional

ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
_IGNORED = ("rotary_emb.inv_freq",)  # buffers some older checkpoints carry

# (scaleopt path, HF name under model.layers.L., transpose, present when)
_LAYER = [
    ("blocks/b0/attn/in_scale/gamma", "input_layernorm.weight", False, "scales"),
    ("blocks/b0/attn/wq/kernel", "self_attn.q_proj.weight", True, "always"),
    ("blocks/b0/attn/wk/kernel", "self_attn.k_proj.weight", True, "always"),
    ("blocks/b0/attn/wv/kernel", "self_attn.v_proj.weight", True, "always"),
    ("blocks/b0/attn/wq/bias", "self_attn.q_proj.bias", False, "bias"),
    ("blocks/b0/attn/wk/bias", "self_attn.k_proj.bias", False, "bias"),
    ("blocks/b0/attn/wv/bias", "self_attn.v_proj.bias", False, "bias"),
    ("blocks/b0/attn/wo/kernel", "self_attn.o_proj.weight", True, "always"),
    ("blocks/b0/mlp/in_scale/gamma", "post_attention_layernorm.weight", False, "scales"),
    ("blocks/b0/mlp/wgate/kernel", "mlp.gate_proj.weight", True, "always"),
    ("blocks/b0/mlp/wup/kernel", "mlp.up_proj.weight", True, "always"),
    ("blocks/b0/mlp/wdown/kernel", "mlp.down_proj.weight", True, "always"),
]
_GLOBAL = [
    ("embed/embedding", "model.embed_tokens.weight", False, "always"),
    ("in_scale_final/gamma", "model.norm.weight", False, "scales"),
    ("head/kernel", "lm_head.weight", True, "untied"),
]


class ConversionError(ValueError):
  """The checkpoint or the model cannot be converted; the message names the key/tensor."""


# ---------------------------------------------------------------------------------------------
# Configs.


def _rope_theta(hf: dict) -> float:
  """RoPE base of a config.json (transformers 5 ``rope_parameters`` or the older top-level
  ``rope_theta``); scaled RoPE variants are refused."""
  rp, legacy = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
  kind = rp.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
  if kind != "default":
    raise ConversionError(f"config.json: RoPE type {kind!r} is not supported (only plain RoPE)")
  return float(rp.get("rope_theta", hf.get("rope_theta", 10_000.0)))


def config_from_hf(hf: dict, **overrides: Any) -> ModelConfig:
  """The ModelConfig of a Hugging Face ``config.json`` (dict); overrides set other fields
  (e.g. ``dtype``)."""
  arch = (hf.get("architectures") or [None])[0]
  if arch not in ARCHITECTURES:
    raise ConversionError(f"config.json: architectures={hf.get('architectures')!r}; "
                          f"supported: {sorted(ARCHITECTURES)}")
  if hf.get("hidden_act", "silu") != "silu":
    raise ConversionError(f"config.json: hidden_act={hf['hidden_act']!r}; only 'silu'")
  if hf.get("use_sliding_window"):
    raise ConversionError("config.json: use_sliding_window=true is not supported")
  for key in ("attention_bias", "mlp_bias"):
    if arch == "LlamaForCausalLM" and hf.get(key):
      raise ConversionError(f"config.json: {key}=true is not supported (scaleopt's Llama-"
                            "shaped model has no o-projection or MLP biases)")
  d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
  head_dim = hf.get("head_dim")
  fields = dict(
      vocab_size=int(hf["vocab_size"]), d_model=d, n_layers=int(hf["num_hidden_layers"]),
      n_heads=heads, n_kv_heads=int(hf.get("num_key_value_heads") or heads),
      head_dim=None if head_dim in (None, d // heads) else int(head_dim),
      d_ff=int(hf["intermediate_size"]), tie_embeddings=bool(hf.get("tie_word_embeddings")),
      qkv_bias=arch == "Qwen2ForCausalLM", rope_theta=_rope_theta(hf),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      max_seq_len=int(hf.get("max_position_embeddings", 4096)), scales="standard")
  return ModelConfig(**{**fields, **overrides})


def check_convertible(cfg: ModelConfig) -> None:
  """Raises ConversionError naming the first ModelConfig field Qwen2/Llama cannot express."""
  bad = [("dual", cfg.dual == "dnp"), ("qk_norm", cfg.qk_norm), ("post_norm", cfg.post_norm),
         ("n_experts", cfg.is_moe)]
  for name, is_bad in bad:
    if is_bad:
      raise ConversionError(f"ModelConfig.{name}={getattr(cfg, name)!r} has no Qwen2/Llama "
                            "counterpart (see scaleopt/models/hf.py)")


def config_to_hf(cfg: ModelConfig, base: dict | None = None) -> dict:
  """A ``config.json`` dict for ``cfg`` (standard or no scales), updating ``base`` if given."""
  check_convertible(cfg)
  arch = "Qwen2ForCausalLM" if cfg.qkv_bias else "LlamaForCausalLM"
  out = dict(base or {})
  out.pop("rope_scaling", None)
  out.update(
      architectures=[arch], model_type=ARCHITECTURES[arch], hidden_act="silu",
      vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
      num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
      num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.d_head, rms_norm_eps=cfg.norm_eps,
      rope_theta=cfg.rope_theta,
      rope_parameters={"rope_theta": cfg.rope_theta, "rope_type": "default"},
      tie_word_embeddings=cfg.tie_embeddings, max_position_embeddings=cfg.max_seq_len,
      attention_dropout=0.0, torch_dtype="float32")
  if arch == "LlamaForCausalLM":
    out.update(attention_bias=False, mlp_bias=False)
  else:
    out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
  return out


# ---------------------------------------------------------------------------------------------
# Tensors.


def _entries(cfg: ModelConfig) -> list[tuple[str, str, bool, bool]]:
  """(scaleopt path, HF name, transpose, per layer) of every tensor of ``cfg``."""
  on = {"always": True, "scales": cfg.scales != "none", "bias": cfg.qkv_bias,
        "untied": not cfg.tie_embeddings}
  return ([(p, n, t, True) for p, n, t, w in _LAYER if on[w]]
          + [(p, n, t, False) for p, n, t, w in _GLOBAL if on[w]])


def _shapes(cfg: ModelConfig) -> dict[str, tuple]:
  init, _ = functional(cfg)
  tree = jax.eval_shape(init, jax.random.key(0))
  return {"/".join(str(k.key) for k in path): tuple(x.shape)
          for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _set(tree: dict, path: str, value: np.ndarray) -> None:
  *parents, leaf = path.split("/")
  for p in parents:
    tree = tree.setdefault(p, {})
  tree[leaf] = value


def _get(tree: dict, path: str) -> np.ndarray:
  for p in path.split("/"):
    tree = tree[p]
  return np.asarray(tree, np.float32)


def params_from_hf(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict:
  """scaleopt parameters (nested dict of float32 numpy arrays) from HF tensors by name."""
  if cfg.scales != "standard" or cfg.reparam != "none" or cfg.dual != "none":
    raise ConversionError("import needs scales='standard', reparam='none', dual='none' (the "
                          f"Qwen2/Llama layout); got {cfg.scales!r}, {cfg.reparam!r}, "
                          f"{cfg.dual!r}")
  check_convertible(cfg)
  shapes, used, params = _shapes(cfg), set(), {}
  for path, name, transpose, per_layer in _entries(cfg):
    names = ([f"model.layers.{l}.{name}" for l in range(cfg.n_layers)] if per_layer
             else [name])
    missing = [n for n in names if n not in tensors]
    if missing:
      raise ConversionError(f"checkpoint tensor {missing[0]!r} is missing")
    arrs = [np.asarray(tensors[n], np.float32) for n in names]
    arrs = [a.T if transpose else a for a in arrs]
    value = np.stack(arrs) if per_layer else arrs[0]
    if value.shape != shapes[path]:
      raise ConversionError(f"checkpoint tensor {names[0]!r} has shape {tensors[names[0]].shape}"
                            f", which does not fit {path} {shapes[path]} of the config")
    _set(params, path, value)
    used.update(names)
  extra = sorted(n for n in tensors if n not in used and not n.endswith(_IGNORED))
  if cfg.tie_embeddings and "lm_head.weight" in extra:  # a tied head saved anyway
    if not np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
      raise ConversionError("tie_word_embeddings=true but lm_head.weight differs from "
                            "model.embed_tokens.weight")
    extra.remove("lm_head.weight")
  if extra:
    raise ConversionError(f"checkpoint tensors not used by the config: {extra[:5]}")
  return params


def params_to_hf(cfg: ModelConfig, params: Any) -> tuple[ModelConfig, dict[str, np.ndarray]]:
  """(exported config, HF tensors by name); foldable scale variants are folded first."""
  check_convertible(cfg)
  if cfg.scales != "standard" or cfg.reparam != "none" or cfg.dual != "none":
    cfg, params = fold_scales(cfg, params)
  out = {}
  for path, name, transpose, per_layer in _entries(cfg):
    value = _get(params, path)
    if per_layer:
      for l in range(cfg.n_layers):
        out[f"model.layers.{l}.{name}"] = np.ascontiguousarray(value[l].T if transpose
                                                               else value[l])
    else:
      out[name] = np.ascontiguousarray(value.T if transpose else value)
  if cfg.scales == "none":  # folded: every norm weight is 1
    d = np.ones((cfg.d_model,), np.float32)
    out["model.norm.weight"] = d
    for l in range(cfg.n_layers):
      out[f"model.layers.{l}.input_layernorm.weight"] = d
      out[f"model.layers.{l}.post_attention_layernorm.weight"] = d
  return dataclasses.replace(cfg, scales="standard"), out


# ---------------------------------------------------------------------------------------------
# Files.


def read_hf(directory: str | pathlib.Path) -> tuple[dict, dict[str, np.ndarray]]:
  """(config.json dict, tensors) of a Hugging Face model directory (one or many
  ``*.safetensors`` files)."""
  from safetensors.numpy import load_file
  d = pathlib.Path(directory)
  if not (d / "config.json").is_file():
    raise ConversionError(f"{str(d)!r} has no config.json (expected a Hugging Face model "
                          "directory)")
  files = sorted(d.glob("*.safetensors"))
  if not files:
    raise ConversionError(f"{str(d)!r} has no *.safetensors files (convert .bin checkpoints "
                          "with transformers first)")
  tensors: dict[str, np.ndarray] = {}
  for f in files:
    tensors.update(load_file(str(f)))
  return json.loads((d / "config.json").read_text()), tensors


def load_hf(directory: str | pathlib.Path, **overrides: Any) -> tuple[ModelConfig, dict]:
  """(ModelConfig, scaleopt params) of a Hugging Face Qwen2/Llama directory."""
  hf_cfg, tensors = read_hf(directory)
  cfg = config_from_hf(hf_cfg, **overrides)
  return cfg, params_from_hf(cfg, tensors)


def save_hf(directory: str | pathlib.Path, cfg: ModelConfig, params: Any,
            base_config: dict | None = None, dtype: str = "float32") -> pathlib.Path:
  """Writes ``config.json`` and ``model.safetensors`` (``dtype`` float32 or bfloat16)."""
  from safetensors.numpy import save_file
  if dtype not in ("float32", "bfloat16"):
    raise ConversionError(f"dtype={dtype!r}; choose float32 or bfloat16")
  cfg_out, tensors = params_to_hf(cfg, params)
  if dtype == "bfloat16":
    import ml_dtypes
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
  d = pathlib.Path(directory)
  d.mkdir(parents=True, exist_ok=True)
  hf_cfg = config_to_hf(cfg_out, base_config)
  hf_cfg["torch_dtype"] = dtype
  (d / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
  save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
  return d
