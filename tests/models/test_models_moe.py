"""Mixture of experts: routing against a naive reference, losses, gradients, dropping."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from scaleopt import models
from scaleopt.models import moe as moe_lib
from models_testlib import init_params, jit_apply, tiny_moe, tokens


def naive_route(logits, k, cap, renorm=True):
  """Per-token Python loop: top-k, gates, token-order buffer filling, drops, losses."""
  s, e = logits.shape
  z = logits - logits.max(-1, keepdims=True)
  p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  fill = np.zeros(e, int)
  counts = np.zeros(e)
  assign = []  # (token, expert, gate, kept)
  for t in range(s):
    top = np.argsort(-p[t], kind="stable")[:k]
    g = p[t, top] / (p[t, top].sum() if renorm else 1.0)
    for ex, gate in zip(top, g):
      counts[ex] += 1
      kept = fill[ex] < cap
      fill[ex] += kept
      assign.append((t, ex, gate, kept))
  lb = e * np.sum(counts / (s * k) * p.mean(0))
  lse = np.log(np.exp(z).sum(-1)) + logits.max(-1)
  return assign, lb, np.mean(lse ** 2)


def test_route_matches_naive_reference():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(12, 4)).astype(np.float32) * 2
  r = moe_lib.route(jnp.asarray(logits), top_k=2, cap=3, renorm=True)
  assign, lb, z = naive_route(logits, 2, 3)
  kept = [a for a in assign if a[3]]
  assert float(r["dropped"]) == len(assign) - len(kept) > 0
  np.testing.assert_allclose(float(r["lb"]), lb, rtol=1e-5)
  np.testing.assert_allclose(float(r["z"]), z, rtol=1e-5)
  slots, gates = np.asarray(r["slot"]), np.asarray(r["gate"])
  for i, (t, ex, g, k) in enumerate(assign):
    s, j = divmod(i, 2)
    assert s == t
    if k:
      assert slots[t, j] // 3 == ex
      np.testing.assert_allclose(gates[t, j], g, rtol=1e-5)
    else:
      assert slots[t, j] == 4 * 3 and gates[t, j] == 0
  used = slots[slots < 12]
  assert len(set(used.tolist())) == len(used)  # no two assignments share a slot


def test_uniform_routing_gives_minimal_load_balancing_loss():
  cfg = tiny_moe(moe_capacity_factor=0.0)
  params = init_params(cfg)
  router = params["blocks"]["b1"]["mlp"]["router"]
  router["kernel"] = jnp.zeros_like(router["kernel"])
  _, aux = jit_apply(cfg)(params, tokens(cfg, b=2, t=32))
  # P_e = 1/E for every expert => L_lb = E sum_e f_e / E = 1, the minimum; z = log(E)^2.
  np.testing.assert_allclose(float(aux["moe_lb_loss"]), 1.0, rtol=1e-6)
  np.testing.assert_allclose(float(aux["moe_z_loss"]), np.log(4.0) ** 2, rtol=1e-6)
  assert float(aux["moe_dropped_tokens"]) == 0.0
  # A non-uniform router on the same tokens raises it (balanced minimum, not a maximum).
  router["kernel"] = jnp.ones_like(router["kernel"]) * jnp.arange(4.0) * 0.5
  _, aux2 = jit_apply(cfg)(params, tokens(cfg, b=2, t=32))
  assert float(aux2["moe_lb_loss"]) > 1.0


@pytest.mark.parametrize("cf", [0.5, 0.0], ids=["capacity", "dropless"])
def test_moe_layer_matches_naive_per_token_reference(cf):
  cfg = tiny_moe(moe_capacity_factor=cf, scales="hg")
  layer = moe_lib.MoE(cfg, nnx.Rngs(3))
  keys = jax.random.split(jax.random.key(4), 3)
  layer.in_scale_router.gamma[...] = jnp.exp(0.3 * jax.random.normal(keys[0], (64,)))
  layer.experts.in_scale_gate.gamma[...] = jnp.exp(0.3 * jax.random.normal(keys[1], (4, 64)))
  layer.router.kernel[...] = layer.router.kernel[...] * 20  # confident, uneven routing
  x = jax.random.normal(keys[2], (2, 16, 64))
  y, aux = nnx.jit(lambda layer, x: layer(x))(layer, x)  # one compile, not one per op
  f64 = lambda a: np.asarray(a, np.float64)
  wr = f64(layer.router.kernel[...]) * f64(layer.in_scale_router.gamma[...])[:, None]
  wg = f64(layer.experts.wgate.kernel[...]) * f64(layer.experts.in_scale_gate.gamma[...])[..., None]
  wu, wd = f64(layer.experts.wup.kernel[...]), f64(layer.experts.wdown.kernel[...])
  cap = moe_lib.capacity(cfg, 16)
  dropped = 0
  for b in range(2):
    xb = f64(x[b])
    assign, _, _ = naive_route(xb @ wr, 2, cap)
    ref = np.zeros_like(xb)
    for t, e, g, kept in assign:
      dropped += not kept
      if kept:
        gate, up = xb[t] @ wg[e], xb[t] @ wu[e]
        ref[t] += g * ((gate / (1 + np.exp(-gate)) * up) @ wd[e])
    np.testing.assert_allclose(np.asarray(y[b]), ref, rtol=1e-4, atol=1e-6)
    all_dropped = [t for t in range(16) if not any(a[3] for a in assign if a[0] == t)]
    for t in all_dropped:  # nothing added: the token leaves through the residual alone
      assert np.all(np.asarray(y[b, t]) == 0)
  assert float(aux["moe_dropped_tokens"]) == dropped
  assert (dropped > 0) == (cf > 0)


@pytest.mark.integration  # the capacity reference test above stays in the fast tier
def test_every_expert_receives_gradient():
  cfg = tiny_moe()
  params = init_params(cfg)
  toks = tokens(cfg, b=4, t=32)
  _, apply = models.functional(cfg)

  def loss(p):
    logits, aux = apply(p, toks[:, :-1])
    return models.lm_loss(logits, toks[:, 1:]) + aux["moe_aux_loss"]

  g = jax.jit(jax.grad(loss))(params)["blocks"]["b1"]["mlp"]
  for name in ("wgate", "wup", "wdown"):
    per_expert = jnp.sqrt(jnp.sum(jnp.square(g["experts"][name]["kernel"][0]), axis=(1, 2)))
    assert per_expert.shape == (4,) and bool(jnp.all(per_expert > 0)), name
  assert float(jnp.linalg.norm(g["router"]["kernel"])) > 0


def test_dropped_token_counts_follow_capacity():
  toks = tokens(tiny_moe(), b=2, t=32)
  counts = {}
  for cf in (0.0, 0.25, 1.0, 4.0):
    cfg = tiny_moe(moe_capacity_factor=cf)
    counts[cf] = float(jit_apply(cfg)(init_params(cfg), toks)[1]["moe_dropped_tokens"])
  assert counts[0.0] == 0.0 and counts[4.0] == 0.0
  # capacity 0.25 -> 4 slots per expert and sequence: at most 16 of 64 assignments kept.
  assert counts[0.25] >= 2 * (32 * 2 - 4 * 4)
  assert counts[0.25] >= counts[1.0]
