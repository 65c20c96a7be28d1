"""Model configuration: one frozen dataclass, every scale-vector variant a flag.

Scale-vector flags (see docs/models.md for the maths and the choices made where the paper is
silent):

* ``scales``   where the Input-Norm scale vectors live:
  ``none`` (no Input-Norm scales at all), ``standard`` (one scale per norm, shared by all
  consumers of that norm), ``hg`` (branch-specific heterogeneity: one scale per consuming
  projection: q, k, v; gate, up; router and, with ``moe_hg_per_expert``, every expert).
* ``dual``     output-side scales on the linear maps named in ``dual_targets``:
  ``none``, ``dp`` (dual placement: ``y = u * (W (v * n))``), ``dnp`` (dual placement with an
  intermediate RMS norm: ``y = u * Norm(W (v * n))``; per head for q, k, v).
* ``reparam``  parameterization of every scale vector:
  ``none`` (gamma), ``or_product`` (gamma = beta * alpha),
  ``or_normalized`` (gamma = beta * alpha / rms(alpha)); all start at gamma = 1.

Named variants (``VARIANTS``, ``ModelConfig.with_variant``) set these three together; the
``unified`` variant is HG + DNP + OR(product) and is meant to be trained with the ``iwd``
weight-decay policy of :func:`scaleopt.models.weight_decay_mask`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

SCALES = ("none", "standard", "hg")
DUALS = ("none", "dp", "dnp")
REPARAMS = ("none", "or_product", "or_normalized")
DUAL_TARGETS = ("q", "k", "v", "gate", "up")
REMATS = ("none", "full", "dots")
TOKAMAX_ATTENTION = ("tokamax_mosaic", "tokamax_triton", "tokamax_xla")
ATTENTION_IMPLS = ("auto", "xla", "cudnn") + TOKAMAX_ATTENTION
LOSS_KERNELS = ("auto", "pallas", "xla")
NORM_KERNELS = ("auto", "pallas", "xla", "tokamax_triton", "tokamax_xla")
GLU_KERNELS = ("auto", "xla", "tokamax_mosaic", "tokamax_triton", "tokamax_xla")
DTYPES = ("bfloat16", "float32", "float16")
FINAL_SCALE_ROLES = ("input", "output")

# Named scale-vector variants: (scales, dual, reparam) plus the recommended WD policy.
VARIANTS: dict[str, dict[str, Any]] = {
    "none": dict(scales="none", dual="none", reparam="none", wd_policy="matrices-only"),
    "standard": dict(scales="standard", dual="none", reparam="none", wd_policy="iwd"),
    "hg": dict(scales="hg", dual="none", reparam="none", wd_policy="iwd"),
    "dp": dict(scales="standard", dual="dp", reparam="none", wd_policy="iwd"),
    "dnp": dict(scales="standard", dual="dnp", reparam="none", wd_policy="iwd"),
    "or_product": dict(scales="standard", dual="none", reparam="or_product", wd_policy="iwd"),
    "or_normalized": dict(
        scales="standard", dual="none", reparam="or_normalized", wd_policy="iwd"),
    "unified": dict(scales="hg", dual="dnp", reparam="or_product", wd_policy="iwd"),
}


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
  if value not in allowed:
    raise ValueError(f"ModelConfig.{name}={value!r} is not allowed; choose one of {allowed}")


def _check_positive(name: str, value: Any, allow_zero: bool = False) -> None:
  ok = isinstance(value, (int, float)) and (value >= 0 if allow_zero else value > 0)
  if not ok:
    bound = ">= 0" if allow_zero else "> 0"
    raise ValueError(f"ModelConfig.{name}={value!r} must be a number {bound}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only Pre-Norm Transformer (RMSNorm, RoPE, SwiGLU, GQA), dense or MoE."""

  # Shapes.
  vocab_size: int = 256
  d_model: int = 64
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int | None = None  # None: d_model // n_heads
  d_ff: int = 128
  tie_embeddings: bool = True
  qkv_bias: bool = False
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  init_std: float = 0.02  # N(0, std) kernels/embedding; wo, wdown get std / sqrt(2 L).

  # Extra normalizations (their scales are Output-Norm scales: never folded, no WD under iwd).
  qk_norm: bool = False  # per-head RMSNorm of q and k, scale of size head_dim (Qwen3 style)
  post_norm: bool = False  # sandwich norms after the attention and MLP outputs (Gemma style)

  # Scale vectors (module docstring).
  scales: str = "standard"
  dual: str = "none"
  dual_targets: tuple[str, ...] = DUAL_TARGETS
  reparam: str = "none"
  moe_hg_per_expert: bool = True  # hg: one gate/up input scale per expert (else shared)
  final_scale_role: str = "input"  # tied head only: is the final scale Input- or Output-Norm?

  # Mixture of experts (n_experts = 0: dense).
  n_experts: int = 0
  moe_top_k: int = 2
  moe_every: int = 1  # every k-th layer is MoE (layers k-1, 2k-1, ...)
  moe_d_ff: int | None = None  # None: d_ff
  moe_capacity_factor: float = 1.25  # 0: dropless (capacity = tokens per sequence)
  moe_renorm_gates: bool = True  # renormalize the top-k softmax gates to sum to 1
  moe_lb_weight: float = 0.01  # weights used for aux["moe_aux_loss"]
  moe_z_weight: float = 1e-3

  # Numerics and performance.
  dtype: str = "bfloat16"  # compute dtype; parameters are always float32
  remat: str = "none"  # none | full | dots (save matmul outputs without batch dims)
  # Layer units per iteration of the layer scan: 1 a rolled loop (compile time flat in depth),
  # 0 all units (no loop; fastest on GPU, the GPU-size presets use it). A partial unroll is
  # slower and holds more memory than either (docs/models.md, Performance).
  scan_unroll: int = 1
  # auto: cudnn on GPU with 16-bit dtype, else xla; tokamax_mosaic | tokamax_triton |
  # tokamax_xla: tokamax's flash attention (models/tokamax_ops.py; the optional tokamax package).
  attention_impl: str = "auto"
  max_seq_len: int = 1024  # used for FLOP accounting defaults only
  # LM-head matmul output dtype before the cast to float32 logits. False (MaxText's default):
  # bf16 dot, then float32 (the faster: docs/models.md); True: float32 dot output.
  logits_dot_in_fp32: bool = False
  # Training loss: fused LM head + cross-entropy without float32 logits (models/loss.py);
  # loss_chunks > 1 slices the sequence axis (less memory, one more head matmul).
  fused_loss: bool = True
  loss_chunks: int = 1
  # The fused loss's per-row work (lse, nll, logit gradient): auto is the Pallas kernel
  # (models/kernels.py) on GPU with a 16-bit dtype, one chunk and no tensor parallelism,
  # else XLA; pallas off GPU runs the Pallas interpreter (tests).
  loss_kernel: str = "auto"
  # Each residual add with the norm that follows it (models/layers.py add_rms_norm): auto is
  # one Pallas kernel per direction (models/kernels.py) on GPU with a 16-bit dtype, else XLA.
  # tokamax_triton | tokamax_xla: the add by XLA, the norm by tokamax (models/tokamax_ops.py).
  norm_kernel: str = "auto"
  # The dense SwiGLU MLP's silu(n W_gate) * (n W_up): auto and xla are XLA's matmuls;
  # tokamax_mosaic | tokamax_triton | tokamax_xla one tokamax gated-linear-unit op (dense
  # blocks; MoE experts stay XLA), not with DNP on gate or up.
  glu_kernel: str = "auto"

  # --- derived -------------------------------------------------------------------------
  @property
  def d_head(self) -> int:
    return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

  @property
  def is_moe(self) -> bool:
    return self.n_experts > 0

  @property
  def period(self) -> int:
    """Layers per scanned unit: ``moe_every`` for MoE models, else 1."""
    return self.moe_every if self.is_moe else 1

  @property
  def n_moe_layers(self) -> int:
    return self.n_layers // self.moe_every if self.is_moe else 0

  @property
  def expert_d_ff(self) -> int:
    return self.moe_d_ff if self.moe_d_ff is not None else self.d_ff

  def dual_on(self, target: str) -> bool:
    return self.dual != "none" and target in self.dual_targets

  def with_variant(self, name: str) -> "ModelConfig":
    """Returns a copy with the scale flags of the named variant (``VARIANTS``)."""
    _check_choice("variant", name, tuple(VARIANTS))
    v = {k: x for k, x in VARIANTS[name].items() if k != "wd_policy"}
    return dataclasses.replace(self, **v).validate()

  def replace(self, **kw: Any) -> "ModelConfig":
    return dataclasses.replace(self, **kw).validate()

  def validate(self) -> "ModelConfig":
    """Raises ValueError naming the bad field and the allowed values; returns self."""
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                 "rope_theta", "norm_eps", "init_std", "max_seq_len", "loss_chunks"):
      _check_positive(name, getattr(self, name))
    _check_positive("scan_unroll", self.scan_unroll, allow_zero=True)
    if self.head_dim is not None:
      _check_positive("head_dim", self.head_dim)
    elif self.d_model % self.n_heads:
      raise ValueError(f"ModelConfig.d_model={self.d_model} must be divisible by "
                       f"n_heads={self.n_heads} when head_dim is None")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"ModelConfig.n_kv_heads={self.n_kv_heads} must divide "
                       f"n_heads={self.n_heads}")
    _check_choice("scales", self.scales, SCALES)
    _check_choice("dual", self.dual, DUALS)
    _check_choice("reparam", self.reparam, REPARAMS)
    _check_choice("remat", self.remat, REMATS)
    _check_choice("attention_impl", self.attention_impl, ATTENTION_IMPLS)
    _check_choice("loss_kernel", self.loss_kernel, LOSS_KERNELS)
    _check_choice("norm_kernel", self.norm_kernel, NORM_KERNELS)
    _check_choice("glu_kernel", self.glu_kernel, GLU_KERNELS)
    if (self.glu_kernel.startswith("tokamax") and self.dual == "dnp"
        and {"gate", "up"} & set(self.dual_targets)):
      raise ValueError(f"ModelConfig.glu_kernel={self.glu_kernel!r} fuses silu(n W_gate) * "
                       "(n W_up); dual='dnp' normalizes gate and up in between (set "
                       "glu_kernel=auto or leave gate and up out of dual_targets)")
    if self.loss_kernel == "pallas" and self.loss_chunks != 1:
      raise ValueError(f"ModelConfig.loss_kernel='pallas' needs loss_chunks=1, got "
                       f"{self.loss_chunks}")
    _check_choice("dtype", self.dtype, DTYPES)
    _check_choice("final_scale_role", self.final_scale_role, FINAL_SCALE_ROLES)
    if not isinstance(self.dual_targets, tuple):
      raise ValueError(f"ModelConfig.dual_targets={self.dual_targets!r} must be a tuple, a "
                       f"subset of {DUAL_TARGETS}")
    for t in self.dual_targets:
      _check_choice("dual_targets", t, DUAL_TARGETS)
    if self.qk_norm and self.dual == "dnp" and {"q", "k"} & set(self.dual_targets):
      raise ValueError("ModelConfig.qk_norm=True is redundant with dual='dnp' on q/k "
                       "(DNP already normalizes q and k per head); set qk_norm=False")
    _check_positive("n_experts", self.n_experts, allow_zero=True)
    if self.is_moe:
      _check_positive("moe_top_k", self.moe_top_k)
      _check_positive("moe_every", self.moe_every)
      _check_positive("moe_capacity_factor", self.moe_capacity_factor, allow_zero=True)
      if self.moe_top_k > self.n_experts:
        raise ValueError(f"ModelConfig.moe_top_k={self.moe_top_k} must be <= "
                         f"n_experts={self.n_experts}")
      if self.n_layers % self.moe_every:
        raise ValueError(f"ModelConfig.moe_every={self.moe_every} must divide "
                         f"n_layers={self.n_layers}")
      if self.moe_d_ff is not None:
        _check_positive("moe_d_ff", self.moe_d_ff)
    return self

  def __post_init__(self):
    if isinstance(self.dual_targets, list):
      object.__setattr__(self, "dual_targets", tuple(self.dual_targets))
    self.validate()
