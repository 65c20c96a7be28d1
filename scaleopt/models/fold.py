"""Inference export: fold every foldable scale vector into the neighbouring kernel.

For a kernel ``W`` (layout ``[in, out]``) with input-side scale v and DP row scale u,
``u * (W^T (v * n) + b) = W'^T n + b'`` with ``W' = diag(v) W diag(u)``, ``b' = u * b``.
DNP scales after a norm that a linear map absorbs (v before W_o, through the attention
average; up before W_down, through the SiLU gate product) fold into that map's input rows
and are reset to 1. The final scale folds into the LM head; a tied head is untied for export
(``W_U' = diag(gamma) E^T``), since folding into E would also change the input embedding.
What cannot fold stays: Output-Norm scales (QK-norm, sandwich norms, DNP on q/k/gate) and the
DNP norms themselves. OR-parameterized scales that stay are collapsed to a plain gamma.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from scaleopt.models.config import ModelConfig
from scaleopt.models.layers import scale_value
from scaleopt.models.transformer import final_scale_name


def _copy(tree: Any) -> Any:
  return {k: _copy(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def _pop(d: dict, name: str, reparam: str):
  s = d.pop(name, None)
  return None if s is None else scale_value(s, reparam)


def _fold_kernel(lin: dict, col, row, experts: bool = False) -> None:
  k = lin["kernel"]
  if col is not None:
    if experts and col.ndim == k.ndim - 2:  # a scale shared by all experts: add the E axis
      col = col[..., None, :]
    k = k * col[..., :, None]
  if row is not None:
    k = k * row[..., None, :]
    if "bias" in lin:
      lin["bias"] = lin["bias"] * row
  lin["kernel"] = k


def _fold_into_input_rows(lin: dict, u) -> None:
  lin["kernel"] = lin["kernel"] * u[..., :, None]


def _reset_to_one(d: dict, name: str) -> Any:
  """Value of scale ``name`` (reparam already collapsed), replaced by ones; None if absent."""
  if name not in d:
    return None
  g = d[name]["gamma"]
  d[name] = {"gamma": jnp.ones_like(g)}
  return g


def _collapse(tree: Any, reparam: str) -> Any:
  """Replace every OR pair ``{beta, alpha}`` by ``{gamma}``."""
  if not isinstance(tree, dict):
    return tree
  if set(tree) == {"beta", "alpha"}:
    return {"gamma": scale_value(tree, reparam)}
  return {k: _collapse(v, reparam) for k, v in tree.items()}


def _fold_attention(cfg: ModelConfig, a: dict) -> None:
  r = cfg.reparam
  shared = _pop(a, "in_scale", r)
  for b in "qkv":
    col = _pop(a, f"in_scale_{b}", r) if cfg.scales == "hg" else shared
    _fold_kernel(a[f"w{b}"], col, _pop(a, f"row_scale_{b}", r))
  u_v = _reset_to_one(a, "dnp_in_scale_v")
  if u_v is not None:  # kv head g serves query heads g*G .. g*G + G - 1
    lead = u_v.shape[:-1]
    g = cfg.n_heads // cfg.n_kv_heads
    u = jnp.repeat(u_v.reshape(*lead, cfg.n_kv_heads, cfg.d_head), g, axis=-2)
    _fold_into_input_rows(a["wo"], u.reshape(*lead, cfg.n_heads * cfg.d_head))


def _fold_mlp(cfg: ModelConfig, m: dict, shared, experts: bool) -> None:
  r = cfg.reparam
  shared = _pop(m, "in_scale", r) if shared is None else shared
  for b in ("gate", "up"):
    col = _pop(m, f"in_scale_{b}", r) if cfg.scales == "hg" else shared
    _fold_kernel(m[f"w{b}"], col, _pop(m, f"row_scale_{b}", r), experts)
  u_up = _reset_to_one(m, "dnp_in_scale_up")
  if u_up is not None:
    _fold_into_input_rows(m["wdown"], u_up)


def fold_scales(cfg: ModelConfig, params: dict) -> tuple[ModelConfig, dict]:
  """``(cfg_inference, params_folded)`` computing the same function as ``(cfg, params)``.

  ``params`` is the pure-dict form of :func:`scaleopt.models.functional`. The inference config
  has ``scales='none'``, ``reparam='none'``, ``dual='none'`` for DP (``'dnp'`` is kept: its
  norms cannot fold) and is untied when a tied model had a final scale.
  """
  r = cfg.reparam
  p = _copy(params)
  # Collapse OR pairs first; reparam 'none' from here on.
  p = _collapse(p, r)
  cfg_c = dataclasses.replace(cfg, reparam="none")
  for i in range(cfg.period):
    blk = p["blocks"][f"b{i}"]
    _fold_attention(cfg_c, blk["attn"])
    mlp = blk["mlp"]
    if cfg.is_moe and i == cfg.period - 1:
      shared = _pop(mlp, "in_scale", "none")
      col = _pop(mlp, "in_scale_router", "none") if cfg.scales == "hg" else shared
      _fold_kernel(mlp["router"], col, None)
      _fold_mlp(cfg_c, mlp["experts"], shared if shared is not None else None, experts=True)
    else:
      _fold_mlp(cfg_c, mlp, None, experts=False)
  tie = cfg.tie_embeddings
  name = final_scale_name(cfg)
  if name is not None:
    gamma = _pop(p, name, "none")
    if tie:
      p["head"] = {"kernel": (p["embed"]["embedding"] * gamma[None, :]).T}
      tie = False
    else:
      _fold_kernel(p["head"], gamma, None)
  cfg_inf = dataclasses.replace(cfg, scales="none", reparam="none", tie_embeddings=tie,
                                dual="none" if cfg.dual == "dp" else cfg.dual)
  return cfg_inf.validate(), p
