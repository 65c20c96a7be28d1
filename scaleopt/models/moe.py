"""Token-choice top-k mixture-of-experts SwiGLU layer (no Python loop over experts).

Routing, per group (one group = one sequence of S tokens):

  p_s     = softmax(W_r (v_r * n_s))                          router probabilities, float32
  (g, e)  = top_k(p_s)                                        gates renormalized to sum to 1
  slot    = position of (s, k) in expert e's buffer, filled in token order (s, then k): a
            token's slot depends only on earlier tokens, so capacity dropping stays causal
            (GShard's "all first choices first" order would let later tokens evict earlier ones)
  kept    = slot < C,   C = ceil(capacity_factor * S * k / E) (or S when dropless)
  y_s     = sum_k kept * g_{s,k} * Expert_{e_{s,k}}(n_s)

Dropped (token, choice) pairs contribute 0, so a token whose choices are all dropped leaves the
layer through the residual connection only. Tokens are moved with one scatter into
``[B, E, C, d]`` buffers and one gather back; the experts run as batched einsums.

Auxiliary losses (averaged over MoE layers by the Transformer):

  load balancing   L_lb = E * sum_e f_e P_e,  f_e = (#assignments to e) / (S k),
                   P_e = mean_s p_{s,e};  L_lb = 1 whenever P is uniform (its minimum
                   over balanced routings, Switch Transformer eq. 4 generalized to top-k)
  router z-loss    L_z = mean_s (logsumexp_e logits_{s,e})^2   (ST-MoE)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from scaleopt.models.config import ModelConfig
from scaleopt.models.layers import GatedMLP, Linear, Scale, effective_kernel, get_scale

f32 = jnp.float32


def capacity(cfg: ModelConfig, group_size: int) -> int:
  """Buffer slots per expert and group; dropless (factor 0) uses the group size."""
  if cfg.moe_capacity_factor <= 0:
    return group_size
  c = math.ceil(cfg.moe_capacity_factor * group_size * cfg.moe_top_k / cfg.n_experts)
  return max(1, min(c, group_size))


def route(logits_SxE: jax.Array, top_k: int, cap: int, renorm: bool) -> dict[str, jax.Array]:
  """Top-k routing of one group. Returns slots ``[S, K]`` (``E * cap`` = dropped), gates
  ``[S, K]`` (0 where dropped) and the auxiliary statistics."""
  s, e = logits_SxE.shape
  probs = jax.nn.softmax(logits_SxE, axis=-1)
  gates_SxK, idx_SxK = jax.lax.top_k(probs, top_k)
  if renorm:
    gates_SxK = gates_SxK / jnp.sum(gates_SxK, axis=-1, keepdims=True)
  onehot_SxKxE = jax.nn.one_hot(idx_SxK, e, dtype=jnp.int32)
  pos_SxKxE = jnp.cumsum(onehot_SxKxE.reshape(s * top_k, e), axis=0).reshape(s, top_k, e) - 1
  pos_SxK = jnp.sum(pos_SxKxE * onehot_SxKxE, axis=-1)
  kept_SxK = pos_SxK < cap
  slot_SxK = jnp.where(kept_SxK, idx_SxK * cap + pos_SxK, e * cap)
  f_E = jnp.sum(onehot_SxKxE, axis=(0, 1)).astype(f32) / (s * top_k)
  lb = e * jnp.sum(f_E * jnp.mean(probs, axis=0))
  z = jnp.mean(jnp.square(jax.nn.logsumexp(logits_SxE, axis=-1)))
  return dict(slot=slot_SxK, gate=jnp.where(kept_SxK, gates_SxK, 0.0), lb=lb, z=z,
              dropped=jnp.sum(~kept_SxK).astype(f32))


def dispatch(x_SxD: jax.Array, slot_SxK: jax.Array, n_slots: int) -> jax.Array:
  """Scatter token copies into ``[n_slots, d]`` buffers; out-of-range slots are dropped."""
  s, k = slot_SxK.shape
  src = jnp.broadcast_to(x_SxD[:, None], (s, k, x_SxD.shape[-1])).reshape(s * k, -1)
  buf = jnp.zeros((n_slots, x_SxD.shape[-1]), x_SxD.dtype)
  return buf.at[slot_SxK.reshape(-1)].set(src, mode="drop")


def combine(y_NxD: jax.Array, slot_SxK: jax.Array, gate_SxK: jax.Array) -> jax.Array:
  """``sum_k gate[s, k] * y[slot[s, k]]`` (dropped slots read zeros)."""
  y_SxKxD = y_NxD.at[slot_SxK].get(mode="fill", fill_value=0)
  return jnp.einsum("skd,sk->sd", y_SxKxD, gate_SxK.astype(y_NxD.dtype))


class MoE(nnx.Module):
  """Router + ``n_experts`` SwiGLU experts. Input scales: ``standard`` shares one ``in_scale``
  between router and experts; ``hg`` gives the router ``in_scale_router`` and the experts their
  own gate/up scales (per expert when ``moe_hg_per_expert``)."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.router = Linear(cfg.d_model, cfg.n_experts, std=cfg.init_std, rngs=rngs)
    self.experts = GatedMLP(cfg, rngs, n_experts=cfg.n_experts)
    if cfg.scales == "standard":
      self.in_scale = Scale((cfg.d_model,), cfg.reparam)
    elif cfg.scales == "hg":
      self.in_scale_router = Scale((cfg.d_model,), cfg.reparam)
    self.cfg = cfg

  def __call__(self, n_BxSxD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.cfg
    b, s, d = n_BxSxD.shape
    e, cap = cfg.n_experts, capacity(cfg, s)
    shared = get_scale(self, "in_scale")
    col = shared if cfg.scales != "hg" else get_scale(self, "in_scale_router")
    w_r = effective_kernel(self.router.kernel[...], col)
    logits = jnp.einsum("bsd,de->bse", n_BxSxD.astype(f32), w_r)
    r = jax.vmap(lambda l: route(l, cfg.moe_top_k, cap, cfg.moe_renorm_gates))(logits)
    buf = jax.vmap(lambda x, sl: dispatch(x, sl, e * cap))(n_BxSxD, r["slot"])
    y = self.experts(buf.reshape(b, e, cap, d), shared_scale=shared)
    out = jax.vmap(combine)(y.reshape(b, e * cap, d), r["slot"], r["gate"])
    aux = dict(moe_lb_loss=jnp.mean(r["lb"]), moe_z_loss=jnp.mean(r["z"]),
               moe_dropped_tokens=jnp.sum(r["dropped"]))
    return out, aux
