"""Decoder-only Pre-Norm Transformer (Flax NNX) and its pure functional form.

  x_0     = E[tokens]
  x'      = x + Attn(Norm(x))           (+ sandwich: x + u_pa * Norm(Attn(Norm(x))))
  x_{l+1} = x' + MLP(Norm(x'))          (MLP: SwiGLU, or top-k MoE every ``moe_every`` layers)
  logits  = Norm(x_L) diag(gamma_final) W_U,   W_U = E^T when tied

Each residual add is computed together with the norm of the next branch's input
(:func:`scaleopt.models.layers.add_rms_norm`; one Pallas pass on GPU, ``cfg.norm_kernel``), so
a block maps ``(x, Norm(x))`` to ``(x_{l+1}, Norm(x_{l+1}))`` and the last block's norm is the
final one.

Layers are grouped into units of ``cfg.period`` blocks (``period - 1`` dense + 1 MoE block for
MoE models, one dense block otherwise), their parameters stacked on a leading axis of size
``n_layers / period`` (``nnx.vmap`` at init) and applied with ``jax.lax.scan``, so compile time
does not grow with depth. Parameters are float32; compute runs in ``cfg.dtype`` (bf16) with
norms, softmax, router and logits in float32.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from scaleopt.models import kernels, sharding, tokamax_ops
from scaleopt.models.config import ModelConfig
from scaleopt.models.loss import head_loss, head_nll, use_kernel
from scaleopt.models.layers import (Attention, GatedMLP, Linear, Scale, add_rms_norm,
                                    attention_impl, effective_kernel, get_scale, rms_norm,
                                    rope_tables)
from scaleopt.models.moe import MoE

f32 = jnp.float32
AUX_KEYS = ("moe_lb_loss", "moe_z_loss", "moe_dropped_tokens")


def _zeros_aux() -> dict[str, jax.Array]:
  return {k: jnp.zeros((), f32) for k in AUX_KEYS}


class Block(nnx.Module):
  """One Pre-Norm block: attention then a dense SwiGLU MLP or an MoE layer."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, moe: bool):
    self.attn = Attention(cfg, rngs)
    self.mlp = MoE(cfg, rngs) if moe else GatedMLP(cfg, rngs)
    if cfg.post_norm:
      self.out_scale_post_attn = Scale((cfg.d_model,), cfg.reparam)
      self.out_scale_post_mlp = Scale((cfg.d_model,), cfg.reparam)
    self.cfg = cfg
    self.moe = moe

  def __call__(self, x, n, sin, cos, kernel: bool | str):
    """``(x, Norm(x)) -> (x', Norm(x'), aux)``; ``kernel``: the adds + norms in Pallas (True)
    or the norms by tokamax (its setting, :func:`scaleopt.models.layers.add_rms_norm`)."""
    eps = self.cfg.norm_eps
    h = self.attn(n, sin, cos)
    if self.cfg.post_norm:
      h = rms_norm(h, eps, get_scale(self, "out_scale_post_attn"))
    x, n = add_rms_norm(x, h, eps, kernel)
    if self.moe:
      h, aux = self.mlp(n)
    else:
      h, aux = self.mlp(n), _zeros_aux()
    if self.cfg.post_norm:
      h = rms_norm(h, eps, get_scale(self, "out_scale_post_mlp"))
    x, n = add_rms_norm(x, h, eps, kernel)
    return x, n, aux


class Unit(nnx.Module):
  """``cfg.period`` consecutive blocks ``b0 .. b{period-1}``; the last is MoE in MoE models."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    for i in range(cfg.period):
      setattr(self, f"b{i}", Block(cfg, rngs, moe=cfg.is_moe and i == cfg.period - 1))
    self.period = cfg.period

  def __call__(self, x, n, sin, cos, kernel: bool | str):
    aux = _zeros_aux()
    for i in range(self.period):
      x, n, a = getattr(self, f"b{i}")(x, n, sin, cos, kernel)
      aux = jax.tree.map(jnp.add, aux, a)
    return x, n, aux


class Embed(nnx.Module):

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.embedding = nnx.Param(
        cfg.init_std * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model), f32))


def final_scale_name(cfg: ModelConfig) -> str | None:
  """Name of the final norm's scale: Input-Norm unless tied with ``final_scale_role=output``."""
  if cfg.scales == "none":
    return None
  if cfg.tie_embeddings and cfg.final_scale_role == "output":
    return "out_scale_final"
  return "in_scale_final"


_REMAT_POLICIES = {
    "full": None,
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


class Transformer(nnx.Module):
  """``model(tokens_BxT) -> (logits_BxTxV float32, aux)``; aux holds the MoE losses
  (``moe_lb_loss``, ``moe_z_loss`` averaged over MoE layers, ``moe_dropped_tokens`` summed
  over MoE layers, ``moe_aux_loss`` = weighted sum); zeros for dense models."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    cfg.validate()
    self.cfg = cfg
    self.embed = Embed(cfg, rngs)

    @nnx.split_rngs(splits=cfg.n_layers // cfg.period)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_units(r: nnx.Rngs) -> Unit:
      return Unit(cfg, r)

    self.blocks = make_units(rngs)
    name = final_scale_name(cfg)
    if name is not None:
      setattr(self, name, Scale((cfg.d_model,), cfg.reparam))
    if not cfg.tie_embeddings:
      self.head = Linear(cfg.d_model, cfg.vocab_size, std=cfg.init_std, rngs=rngs)

  def __call__(self, tokens_BxT: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    h, w_DxV, aux = self.features(tokens_BxT)
    pref = f32 if self.cfg.logits_dot_in_fp32 else h.dtype
    logits = jnp.einsum("btd,dv->btv", h, w_DxV, preferred_element_type=pref)
    return sharding.constrain(logits.astype(f32), ("batch", None, "tensor")), aux

  def loss(self, tokens_BxT: jax.Array, targets_BxT: jax.Array,
           mask_BxT: jax.Array | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(mean next-token cross-entropy, aux) without float32 logits when ``cfg.fused_loss``
    (:func:`scaleopt.models.loss.head_loss`, ``cfg.loss_chunks`` slices); else
    ``lm_loss(self(tokens))``. Both compute the same function."""
    cfg = self.cfg
    if not cfg.fused_loss or cfg.logits_dot_in_fp32:
      logits, aux = self(tokens_BxT)
      return lm_loss(logits, targets_BxT, mask_BxT), aux
    h, w_DxV, aux = self.features(tokens_BxT)
    kernel = use_kernel(cfg.loss_kernel, h.dtype, cfg.loss_chunks)
    return head_loss(h, w_DxV, targets_BxT, mask_BxT, cfg.loss_chunks, kernel), aux

  def token_nll(self, tokens_BxT: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    """Per-token next-token cross-entropy ``[B, T]`` (float32) of the function ``loss``
    averages, with the same head (fused, ``cfg.loss_chunks`` slices, where ``loss`` is)."""
    cfg = self.cfg
    if not cfg.fused_loss or cfg.logits_dot_in_fp32:
      return token_xent(self(tokens_BxT)[0], targets_BxT)
    h, w_DxV, _ = self.features(tokens_BxT)
    return head_nll(h, w_DxV, targets_BxT, cfg.loss_chunks)

  def features(self, tokens_BxT: jax.Array) -> tuple[jax.Array, jax.Array, dict]:
    """(final normed hidden states [B, T, d] and LM head [d, V], both in the compute dtype,
    head gathered for use; aux): ``logits = h W``."""
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    emb = self.embed.embedding[...]
    act = ("batch", None, None)
    x = sharding.constrain(jnp.take(emb, tokens_BxT, axis=0).astype(dt), act)
    sin, cos = rope_tables(tokens_BxT.shape[1], cfg.d_head, cfg.rope_theta)

    graphdef, state = nnx.split(self.blocks)
    kernel = use_norm_kernel(cfg.norm_kernel, dt)

    def body(carry, unit_state):
      x, n = (sharding.constrain(a, act) for a in carry)
      x, n, aux = nnx.merge(graphdef, unit_state)(x, n, sin, cos, kernel)
      return (sharding.constrain(x, act), sharding.constrain(n, act)), aux

    if cfg.remat != "none":
      body = jax.checkpoint(body, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=False)
    (_, n), aux = jax.lax.scan(body, (x, rms_norm(x, cfg.norm_eps)), state,
                               unroll=cfg.scan_unroll or True)  # 0: all units

    gamma = None
    name = final_scale_name(cfg)
    if name is not None:
      gamma = get_scale(self, name)
    w_DxV = emb.T if cfg.tie_embeddings else self.head.kernel[...]
    w_DxV = sharding.use_kernel(effective_kernel(w_DxV, gamma).astype(dt), ("fsdp", "tensor"))
    return n, w_DxV, _reduce_aux(cfg, aux)


def use_norm_kernel(setting: str, dtype: jnp.dtype, backend: str | None = None) -> bool | str:
  """How the residual adds + norms run for the setting ``ModelConfig.norm_kernel``: True as
  Pallas kernels (``pallas``; ``auto`` on GPU with a 16-bit dtype), a tokamax setting as it
  is, False by XLA."""
  if setting.startswith(tokamax_ops.PREFIX):
    return setting
  return setting == "pallas" or (setting == "auto" and kernels.auto(dtype, backend))


def kernel_choices(cfg: ModelConfig, mesh=None) -> dict[str, str]:
  """The implementation each op resolves to on this process's devices under ``mesh``:
  ``attention`` (xla, cudnn, tokamax_*), ``loss`` (pallas, xla; none without the fused
  loss), ``norm`` (pallas, xla, tokamax_*), ``glu`` (xla, tokamax_*)."""
  dt = jnp.dtype(cfg.dtype)
  with sharding.constraints(mesh):
    fused = cfg.fused_loss and not cfg.logits_dot_in_fp32
    loss = ("pallas" if use_kernel(cfg.loss_kernel, dt, cfg.loss_chunks) else "xla"
            ) if fused else "none"
  norm = use_norm_kernel(cfg.norm_kernel, dt)
  return {"attention": attention_impl(cfg, dt), "loss": loss,
          "norm": norm if isinstance(norm, str) else ("pallas" if norm else "xla"),
          "glu": cfg.glu_kernel if cfg.glu_kernel.startswith(tokamax_ops.PREFIX) else "xla"}


def kernel_problem(cfg: ModelConfig) -> str | None:
  """One line saying why a kernel the config names cannot run on this process's first
  device (:func:`scaleopt.models.tokamax_ops.check`); None when all can."""
  for key in ("attention_impl", "norm_kernel", "glu_kernel"):
    problem = tokamax_ops.check(key, getattr(cfg, key))
    if problem is not None:
      return problem
  return None


def _reduce_aux(cfg: ModelConfig, aux: dict[str, jax.Array]) -> dict[str, jax.Array]:
  n = max(cfg.n_moe_layers, 1)
  out = dict(moe_lb_loss=jnp.sum(aux["moe_lb_loss"]) / n,
             moe_z_loss=jnp.sum(aux["moe_z_loss"]) / n,
             moe_dropped_tokens=jnp.sum(aux["moe_dropped_tokens"]))
  out["moe_aux_loss"] = (cfg.moe_lb_weight * out["moe_lb_loss"]
                         + cfg.moe_z_weight * out["moe_z_loss"])
  return out


# ---------------------------------------------------------------------------------------------
# Functional form.

Params = dict[str, Any]


def functional(cfg: ModelConfig) -> tuple[Callable[[jax.Array], Params],
                                          Callable[[Params, jax.Array], tuple]]:
  """Pure ``(init_fn, apply_fn)`` pair over plain nested dicts of float32 arrays.

  ``init_fn(rng) -> params`` (``nnx.state(model).to_pure_dict()``: keys are the parameter path
  components, e.g. ``params["blocks"]["b0"]["attn"]["wq"]["kernel"]`` of shape
  ``[n_units, d, H*d_head]``); ``apply_fn(params, tokens_BxT) -> (logits, aux)``. Both are
  jit-able; params work directly with optax, Orbax and ``jax.sharding`` trees.
  """
  cfg.validate()
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, _ = nnx.split(abstract)

  def init_fn(rng: jax.Array) -> Params:
    state = nnx.state(Transformer(cfg, rngs=nnx.Rngs(rng)))
    return nnx.to_pure_dict(state) if hasattr(nnx, "to_pure_dict") else state.to_pure_dict()

  def apply_fn(params: Params, tokens_BxT: jax.Array):
    return nnx.merge(graphdef, params)(tokens_BxT)

  return init_fn, apply_fn


def functional_loss(cfg: ModelConfig) -> Callable[..., tuple[jax.Array, dict]]:
  """``loss_fn(params, tokens_BxT, targets_BxT, mask_BxT=None) -> (mean CE, aux)``: the
  pure form of :meth:`Transformer.loss` (fused head + cross-entropy by default)."""
  cfg.validate()
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))

  def loss_fn(params: Params, tokens_BxT: jax.Array, targets_BxT: jax.Array,
              mask_BxT: jax.Array | None = None):
    return nnx.merge(graphdef, params).loss(tokens_BxT, targets_BxT, mask_BxT)

  return loss_fn


def functional_nll(cfg: ModelConfig) -> Callable[..., jax.Array]:
  """``nll_fn(params, tokens_BxT, targets_BxT) -> [B, T]`` per-token cross-entropy: the pure
  form of :meth:`Transformer.token_nll` (evaluation per window)."""
  cfg.validate()
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))

  def nll_fn(params: Params, tokens_BxT: jax.Array, targets_BxT: jax.Array):
    return nnx.merge(graphdef, params).token_nll(tokens_BxT, targets_BxT)

  return nll_fn


def token_xent(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
  """``logsumexp(z_{bt}) - z_{bt, y_{bt}}`` per position, float32 ``[B, T]``."""
  z = logits_BxTxV.astype(f32)
  return jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, targets_BxT[..., None], -1)[..., 0]


def lm_loss(logits_BxTxV: jax.Array, targets_BxT: jax.Array,
            mask_BxT: jax.Array | None = None) -> jax.Array:
  """Mean cross-entropy over supervised positions, float32:
  ``sum_{b,t} m_{bt} (logsumexp(z_{bt}) - z_{bt, y_{bt}}) / max(sum m, 1)``."""
  nll = token_xent(logits_BxTxV, targets_BxT)
  if mask_BxT is None:
    return jnp.mean(nll)
  m = mask_BxT.astype(f32)
  return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)
