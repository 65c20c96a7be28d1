"""Building blocks: RMS norm, scale vectors, RoPE, attention and the SwiGLU MLP.

Scale vectors live in the *consumers*, not in the norm: ``Norm(x) = x / sqrt(mean(x^2) + eps)``
has no affine part, and every linear map ``W`` (kernel layout ``[in, out]``) that reads it uses an
effective kernel

    W_eff = diag(v) W diag(u)        (v: input-side / column scale, u: output-side / row scale)

so ``W (v * n) = W_eff n`` exactly. Applying scales to the kernel (``d_in x d_out`` elementwise
multiplies in float32, fused into the bf16 cast) instead of to the activations
(``tokens x d`` multiplies) makes every foldable scale variant nearly free, and lets q, k, v
(and gate, up) share one fused matmul even when each has its own scale (HG).

Parameter names carry the role (read by :mod:`scaleopt.models.masks`):
``in_scale*`` Input-Norm scales (a linear map follows; foldable), ``row_scale*`` DP output-side
scales on a linear map's rows (foldable), ``out_scale*`` Output-Norm scales (QK-norm, sandwich
norms, DNP scales that feed attention logits or SiLU; not foldable), ``kernel``, ``bias``,
``embedding``.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from scaleopt.models import kernels, sharding, tokamax_ops
from scaleopt.models.config import ModelConfig

f32 = jnp.float32


# ---------------------------------------------------------------------------------------------
# Norms and scale vectors.


def rms_norm(x: jax.Array, eps: float, scale: jax.Array | None = None) -> jax.Array:
  """``scale * x / sqrt(mean(x^2, -1) + eps)``, computed in float32, returned in x.dtype."""
  x32 = x.astype(f32)
  y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
  if scale is not None:
    y = y * scale.astype(f32)
  return y.astype(x.dtype)


def add_rms_norm(x: jax.Array, h: jax.Array, eps: float,
                 kernel: bool | str = False) -> tuple[jax.Array, jax.Array]:
  """``(s, rms_norm(s))`` with ``s = x + h`` in x's dtype: the residual add and the norm of the
  next branch's input. ``kernel``: True: one Pallas pass over the rows forward and one
  backward (:func:`scaleopt.models.kernels.add_rms_norm_fwd`; the interpreter off GPU), per
  device on its rows under a mesh; a tokamax setting (``tokamax_triton``): the add by XLA, the
  norm by tokamax (:func:`scaleopt.models.tokamax_ops.rms_norm`); False: XLA's ops."""
  h = h.astype(x.dtype)
  if isinstance(kernel, str):
    s = x + h
    return s, tokamax_ops.rms_norm(s, eps, kernel)
  if not kernel:
    s = x + h
    return s, rms_norm(s, eps)
  return _add_norm(x, h, eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _add_norm(x, h, eps):
  return _add_norm_fwd(x, h, eps)[0]


def _add_norm_fwd(x, h, eps):
  fwd = functools.partial(kernels.add_rms_norm_fwd, eps=eps, interpret=kernels.interpret())
  s, n, r = sharding.on_rows(fwd, x, h)
  return (s, n), (s, r)


def _add_norm_bwd(eps, res, g):
  del eps
  s, r = res
  gs, gn = g
  bwd = functools.partial(kernels.add_rms_norm_bwd, interpret=kernels.interpret())
  gx = sharding.on_rows(bwd, gs, gn, s, r)
  return gx, gx


_add_norm.defvjp(_add_norm_fwd, _add_norm_bwd)


def scale_value(params: dict, reparam: str) -> jax.Array:
  """The scale vector gamma from its parameters (a dict of arrays).

  * ``none``:           gamma = gamma
  * ``or_product``:     gamma = beta * alpha                  (beta: [...], alpha: [..., d])
  * ``or_normalized``:  gamma = beta * alpha / rms(alpha),   rms(a) = sqrt(mean(a^2))
  """
  if reparam == "none":
    return params["gamma"]
  beta, alpha = params["beta"][..., None], params["alpha"]
  if reparam == "or_product":
    return beta * alpha
  if reparam == "or_normalized":
    return beta * alpha * jax.lax.rsqrt(jnp.mean(jnp.square(alpha), -1, keepdims=True))
  raise ValueError(f"reparam={reparam!r}; choose one of ('none', 'or_product', 'or_normalized')")


class Scale(nnx.Module):
  """A scale vector of shape ``shape`` (init gamma = 1), optionally magnitude x direction."""

  def __init__(self, shape: tuple[int, ...], reparam: str):
    self.reparam = reparam
    if reparam == "none":
      self.gamma = nnx.Param(jnp.ones(shape, f32))
    else:
      self.beta = nnx.Param(jnp.ones(shape[:-1], f32))
      self.alpha = nnx.Param(jnp.ones(shape, f32))

  def __call__(self) -> jax.Array:
    names = ("gamma",) if self.reparam == "none" else ("beta", "alpha")
    return scale_value({n: getattr(self, n)[...] for n in names}, self.reparam)


def get_scale(module: nnx.Module, name: str) -> jax.Array | None:
  """The value of scale ``name`` on ``module``, or None when that scale does not exist."""
  s = getattr(module, name, None)
  return None if s is None else s()


def effective_kernel(kernel: jax.Array, col: jax.Array | None = None,
                     row: jax.Array | None = None) -> jax.Array:
  """``diag(col) K diag(row)`` for a kernel ``[..., in, out]`` (float32)."""
  if col is not None:
    kernel = kernel * col[..., :, None]
  if row is not None:
    kernel = kernel * row[..., None, :]
  return kernel


class Linear(nnx.Module):
  """A kernel ``[*lead, d_in, d_out]`` ~ N(0, std^2) and an optional zero-initialized bias."""

  def __init__(self, d_in: int, d_out: int, *, std: float, rngs: nnx.Rngs,
               bias: bool = False, lead: tuple[int, ...] = ()):
    self.kernel = nnx.Param(std * jax.random.normal(rngs.params(), (*lead, d_in, d_out), f32))
    if bias:
      self.bias = nnx.Param(jnp.zeros((*lead, d_out), f32))


def _bias(lin: Linear) -> jax.Array | None:
  b = getattr(lin, "bias", None)
  return None if b is None else b[...]


# ---------------------------------------------------------------------------------------------
# Rotary positions.


def rope_tables(seq_len: int, d_head: int, theta: float) -> tuple[jax.Array, jax.Array]:
  """sin, cos of shape ``[T, d_head / 2]``: angle_{t,i} = t * theta^(-2i / d_head)."""
  inv_freq = theta ** (-jnp.arange(0, d_head, 2, dtype=f32) / d_head)
  ang = jnp.arange(seq_len, dtype=f32)[:, None] * inv_freq[None, :]
  return jnp.sin(ang), jnp.cos(ang)


def apply_rope(x_BxTxHxK: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
  """Rotate-half RoPE (LLaMA/Qwen convention) on the last axis, halves (x1, x2):

      y = (x1 cos - x2 sin, x2 cos + x1 sin)

  computed as x cos + flip(x) (-sin, sin) over a (2, K/2) view: the same products and sums
  without concatenating the halves (a slightly faster step: docs/benchmarks.md).
  """
  x = x_BxTxHxK.astype(f32)
  *lead, k = x.shape
  x_2xH = x.reshape(*lead, 2, k // 2)
  signed_sin = (sin[:, None, :] * jnp.array([-1.0, 1.0], f32)[:, None])[:, None]  # T,1,2,K/2
  y = x_2xH * cos[:, None, None, :] + jnp.flip(x_2xH, axis=-2) * signed_sin
  return y.reshape(x.shape).astype(x_BxTxHxK.dtype)


# ---------------------------------------------------------------------------------------------
# Column-parallel projections sharing one input.


def _fused_projections(x: jax.Array, kernels: list[jax.Array], biases: list[jax.Array] | None,
                       spec: str) -> list[jax.Array]:
  """``[x W_1 (+ b_1), x W_2 (+ b_2), ...]`` for float32 kernels ``[..., d, out_i]``.

  One matmul on the concatenated kernel, except under tensor parallelism, where each kernel
  is split over ``tensor`` on its own output axis and a concatenation would mix the shards
  (then one matmul per kernel). Kernels are cast to ``x.dtype`` before they are gathered.
  """
  dt = x.dtype
  lead = (None,) * (kernels[0].ndim - 2)
  out_spec = ("batch",) + (None,) * (x.ndim - 2) + ("tensor",)
  if sharding.tensor_parallel():
    ys = [jnp.einsum(spec, x, sharding.use_kernel(w.astype(dt), (*lead, "fsdp", "tensor")))
          for w in kernels]
    if biases is not None:
      ys = [y + b.astype(dt) for y, b in zip(ys, biases)]
    return [sharding.constrain(y, out_spec) for y in ys]
  w = sharding.use_kernel(jnp.concatenate(kernels, axis=-1).astype(dt), (*lead, "fsdp", None))
  y = jnp.einsum(spec, x, w)
  if biases is not None:
    y = y + jnp.concatenate(biases, axis=-1).astype(dt)
  y = sharding.constrain(y, out_spec[:-1] + (None,))
  splits = list(itertools.accumulate(k.shape[-1] for k in kernels))[:-1]
  return jnp.split(y, splits, axis=-1)


# ---------------------------------------------------------------------------------------------
# Attention.


def attention_impl(cfg: ModelConfig, dtype: jnp.dtype) -> str:
  """``cudnn`` on GPU for 16-bit dtypes and supported head sizes, else ``xla``; a setting
  other than ``auto`` as it is."""
  if cfg.attention_impl != "auto":
    return cfg.attention_impl
  ok = (jax.default_backend() == "gpu" and dtype in (jnp.bfloat16, jnp.float16)
        and cfg.d_head % 8 == 0 and cfg.d_head <= 128)
  return "cudnn" if ok else "xla"


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, impl: str,
                     strict: bool = False) -> jax.Array:
  """``jax.nn.dot_product_attention`` (B, T, heads, d_head), GQA by head grouping; a tokamax
  setting (``tokamax_mosaic``) by :func:`scaleopt.models.tokamax_ops.attention`.

  With ``impl='cudnn'`` a failure at trace time falls back to XLA unless ``strict``.
  """
  if impl.startswith(tokamax_ops.PREFIX):
    return tokamax_ops.attention(q, k, v, impl)
  if impl == "cudnn":
    try:
      return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    except Exception:  # pylint: disable=broad-except
      if strict:
        raise
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def _input_scale(module: nnx.Module, cfg: ModelConfig, branch: str,
                 shared: jax.Array | None) -> jax.Array | None:
  """Input-side (column) scale of one branch: shared (standard), own (hg) or none."""
  if cfg.scales == "hg":
    return get_scale(module, f"in_scale_{branch}")
  return shared


def _add_dual_scales(module: nnx.Module, cfg: ModelConfig, branches: dict[str, tuple],
                     foldable_after_norm: tuple[str, ...]) -> None:
  """Creates DP ``row_scale_*`` or DNP ``dnp_{in,out}_scale_*`` scales for the branches."""
  for b, shape in branches.items():
    if not cfg.dual_on(b):
      continue
    if cfg.dual == "dp":
      name = f"row_scale_{b}"
    else:
      name = f"dnp_in_scale_{b}" if b in foldable_after_norm else f"dnp_out_scale_{b}"
    setattr(module, name, Scale(shape, cfg.reparam))


def _dnp_scale(module: nnx.Module, branch: str) -> jax.Array | None:
  s = get_scale(module, f"dnp_out_scale_{branch}")
  return s if s is not None else get_scale(module, f"dnp_in_scale_{branch}")


class Attention(nnx.Module):
  """Grouped-query causal self-attention with RoPE and every scale variant.

  q = RoPE(u_q * Norm_h(W_q (v_q * n)))   with DNP on q (else u_q * (W_q (v_q * n)) with DP),
  likewise k, v (no RoPE on v); out = W_o Attn(q, k, v).
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, h, kv, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    std, std_out = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
    self.wq = Linear(d, h * dh, std=std, rngs=rngs, bias=cfg.qkv_bias)
    self.wk = Linear(d, kv * dh, std=std, rngs=rngs, bias=cfg.qkv_bias)
    self.wv = Linear(d, kv * dh, std=std, rngs=rngs, bias=cfg.qkv_bias)
    self.wo = Linear(h * dh, d, std=std_out, rngs=rngs)
    if cfg.scales == "standard":
      self.in_scale = Scale((d,), cfg.reparam)
    elif cfg.scales == "hg":
      for b in "qkv":
        setattr(self, f"in_scale_{b}", Scale((d,), cfg.reparam))
    _add_dual_scales(self, cfg, {"q": (h * dh,), "k": (kv * dh,), "v": (kv * dh,)},
                     foldable_after_norm=("v",))
    if cfg.qk_norm:
      self.out_scale_qnorm = Scale((dh,), cfg.reparam)
      self.out_scale_knorm = Scale((dh,), cfg.reparam)
    self.cfg = cfg

  def __call__(self, n_BxTxD: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    cfg = self.cfg
    dt = n_BxTxD.dtype
    b_, t_, _ = n_BxTxD.shape
    h, kv, dh = cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    shared = get_scale(self, "in_scale")
    lins = {"q": self.wq, "k": self.wk, "v": self.wv}
    kernels, biases = [], []
    for b, lin in lins.items():
      row = get_scale(self, f"row_scale_{b}")
      kernels.append(effective_kernel(lin.kernel[...], _input_scale(self, cfg, b, shared), row))
      bias = _bias(lin)
      if bias is not None:
        biases.append(bias if row is None else bias * row)
    q, k, v = _fused_projections(n_BxTxD, kernels, biases or None, "btd,de->bte")
    heads_spec = ("batch", None, "tensor", None)
    q = sharding.constrain(q.reshape(b_, t_, h, dh), heads_spec)
    k = sharding.constrain(k.reshape(b_, t_, kv, dh), heads_spec)
    v = sharding.constrain(v.reshape(b_, t_, kv, dh), heads_spec)
    heads = {"q": h, "k": kv, "v": kv}
    if cfg.dual == "dnp":
      out = []
      for b, x in zip("qkv", (q, k, v)):
        u = _dnp_scale(self, b)
        out.append(x if u is None else rms_norm(x, cfg.norm_eps, u.reshape(heads[b], dh)))
      q, k, v = out
    if cfg.qk_norm:
      q = rms_norm(q, cfg.norm_eps, get_scale(self, "out_scale_qnorm"))
      k = rms_norm(k, cfg.norm_eps, get_scale(self, "out_scale_knorm"))
    q, k = apply_rope(q, sin, cos), apply_rope(k, sin, cos)
    o = causal_attention(q, k, v, attention_impl(cfg, dt), strict=cfg.attention_impl == "cudnn")
    o = o.reshape(b_, t_, h * dh)
    wo = sharding.use_kernel(self.wo.kernel[...].astype(dt), ("tensor", "fsdp"))
    return sharding.constrain(jnp.einsum("bte,ed->btd", o, wo), ("batch", None, None))


# ---------------------------------------------------------------------------------------------
# SwiGLU MLP (dense, or a stack of experts with a leading expert axis).


class GatedMLP(nnx.Module):
  """``W_down (SiLU(W_gate m_g) * (W_up m_u))``; with ``n_experts`` every kernel is stacked.

  Dense: x ``[B, T, d]``. Experts: x ``[B, E, C, d]`` (expert-major buffers from the router).
  DNP: ``g = u_g * Norm(W_gate m)`` (Output-Norm: SiLU follows), ``u = u_u * Norm(W_up m)``
  (Input-Norm: W_down absorbs it), norms over the hidden axis.
  """

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, n_experts: int = 0):
    d = cfg.d_model
    f = cfg.expert_d_ff if n_experts else cfg.d_ff
    lead = (n_experts,) if n_experts else ()
    std, std_out = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.n_layers)
    self.wgate = Linear(d, f, std=std, rngs=rngs, lead=lead)
    self.wup = Linear(d, f, std=std, rngs=rngs, lead=lead)
    self.wdown = Linear(f, d, std=std_out, rngs=rngs, lead=lead)
    if cfg.scales == "standard" and not n_experts:  # MoE: the shared scale lives in MoE
      self.in_scale = Scale((d,), cfg.reparam)
    elif cfg.scales == "hg":
      per = lead if cfg.moe_hg_per_expert else ()
      self.in_scale_gate = Scale((*per, d), cfg.reparam)
      self.in_scale_up = Scale((*per, d), cfg.reparam)
    _add_dual_scales(self, cfg, {"gate": (*lead, f), "up": (*lead, f)},
                     foldable_after_norm=("up",))
    self.cfg = cfg
    self.stacked = bool(n_experts)

  def __call__(self, x: jax.Array, shared_scale: jax.Array | None = None) -> jax.Array:
    cfg, dt = self.cfg, x.dtype
    shared = get_scale(self, "in_scale") if shared_scale is None else shared_scale
    kernels = []
    for b, lin in (("gate", self.wgate), ("up", self.wup)):
      col = _input_scale(self, cfg, b, shared)
      kernels.append(effective_kernel(lin.kernel[...], col, get_scale(self, f"row_scale_{b}")))
    spec_in, spec_out = (("becd,edf->becf", "becf,efd->becd") if self.stacked
                         else ("btd,df->btf", "btf,fd->btd"))
    lead = (None,) * (x.ndim - 2)
    glu = cfg.glu_kernel.startswith(tokamax_ops.PREFIX) and not self.stacked
    if glu:
      w_gate, w_up = (sharding.use_kernel(w.astype(dt), ("fsdp", "tensor")) for w in kernels)
      a = tokamax_ops.gated_linear_unit(x, w_gate, w_up, cfg.glu_kernel)
    else:
      a = self._activation(x, kernels, spec_in)
    a = sharding.constrain(a, ("batch", *lead, "tensor"))
    w_down = self.wdown.kernel[...].astype(dt)
    w_down = sharding.use_kernel(w_down, (None,) * (w_down.ndim - 2) + ("tensor", "fsdp"))
    return sharding.constrain(jnp.einsum(spec_out, a, w_down), ("batch", *lead, None))

  def _activation(self, x: jax.Array, kernels: list[jax.Array], spec_in: str) -> jax.Array:
    """``SiLU(g) * u`` of the gate and up projections (with DNP's norms) by XLA."""
    cfg = self.cfg
    g, u = _fused_projections(x, kernels, None, spec_in)
    if cfg.dual == "dnp":
      ug, uu = _dnp_scale(self, "gate"), _dnp_scale(self, "up")
      if self.stacked:  # [E, F] -> [E, 1, F] against [B, E, C, F]
        ug = None if ug is None else ug[:, None, :]
        uu = None if uu is None else uu[:, None, :]
      g = g if ug is None else rms_norm(g, cfg.norm_eps, ug)
      u = u if uu is None else rms_norm(u, cfg.norm_eps, uu)
    return jax.nn.silu(g) * u
