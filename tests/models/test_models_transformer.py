"""Transformer forward: numpy reference, causality, functional form, remat, loss, train step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from scaleopt import models
from models_testlib import init_params, jit_apply, randomize_scales, tiny, tiny_moe, tokens


def _np_rms(x, eps):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)


def _np_rope(x, theta):  # x [T, H, dh], rotate-half
  t, _, dh = x.shape
  half = dh // 2
  freq = theta ** (-(2.0 * np.arange(half)) / dh)
  ang = np.arange(t)[:, None] * freq[None, :]
  c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
  x1, x2 = x[..., :half], x[..., half:]
  return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def np_forward(cfg, params, toks):
  """Naive float64 reference of a dense model with standard scales (per-token loops)."""
  p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
  h, kv, dh, eps = cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.norm_eps
  out = []
  for seq in np.asarray(toks):
    x = p["embed"]["embedding"][seq]
    t = len(seq)
    for l in range(cfg.n_layers):
      a = jax.tree.map(lambda z: z[l], p["blocks"]["b0"]["attn"])
      m = jax.tree.map(lambda z: z[l], p["blocks"]["b0"]["mlp"])
      n = _np_rms(x, eps) * a["in_scale"]["gamma"]
      q = n @ a["wq"]["kernel"] + (a["wq"]["bias"] if cfg.qkv_bias else 0)
      k = n @ a["wk"]["kernel"] + (a["wk"]["bias"] if cfg.qkv_bias else 0)
      v = n @ a["wv"]["kernel"] + (a["wv"]["bias"] if cfg.qkv_bias else 0)
      q = _np_rope(q.reshape(t, h, dh), cfg.rope_theta)
      k = _np_rope(k.reshape(t, kv, dh), cfg.rope_theta)
      v = v.reshape(t, kv, dh)
      o = np.zeros((t, h, dh))
      for head in range(h):
        g = head // (h // kv)
        for i in range(t):
          s = np.array([q[i, head] @ k[j, g] for j in range(i + 1)]) / np.sqrt(dh)
          w = np.exp(s - s.max())
          w /= w.sum()
          o[i, head] = w @ v[: i + 1, g]
      x = x + o.reshape(t, h * dh) @ a["wo"]["kernel"]
      n = _np_rms(x, eps) * m["in_scale"]["gamma"]
      gate, up = n @ m["wgate"]["kernel"], n @ m["wup"]["kernel"]
      x = x + (gate / (1 + np.exp(-gate)) * up) @ m["wdown"]["kernel"]
    n = _np_rms(x, eps) * p["in_scale_final"]["gamma"]
    w_u = p["embed"]["embedding"].T if cfg.tie_embeddings else p["head"]["kernel"]
    out.append(n @ w_u)
  return np.stack(out)


@pytest.mark.parametrize("kw", [dict(), dict(qkv_bias=True, tie_embeddings=False)])
def test_matches_numpy_reference(kw):
  cfg = tiny(**kw)
  params = randomize_scales(init_params(cfg), seed=2)
  if cfg.qkv_bias:  # non-zero biases so they are exercised
    for name in ("wq", "wk", "wv"):
      b = params["blocks"]["b0"]["attn"][name]["bias"]
      params["blocks"]["b0"]["attn"][name]["bias"] = 0.1 + b
  toks = tokens(cfg, b=2, t=12)
  logits, aux = jit_apply(cfg)(params, toks)
  ref = np_forward(cfg, params, toks)
  assert logits.dtype == jnp.float32 and logits.shape == (2, 12, cfg.vocab_size)
  np.testing.assert_allclose(np.asarray(logits), ref, rtol=2e-4, atol=2e-5)
  assert all(float(v) == 0.0 for v in aux.values())


def test_module_and_functional_agree_and_bf16_close():
  cfg = tiny()
  model = models.Transformer(cfg, rngs=nnx.Rngs(0))
  params = init_params(cfg)
  toks = tokens(cfg)
  l32 = jit_apply(cfg)(params, toks)[0]
  np.testing.assert_allclose(np.asarray(model(toks)[0]), np.asarray(l32), rtol=1e-5, atol=1e-6)
  # bf16 compute stays close to float32 compute.
  l16 = jit_apply(cfg.replace(dtype="bfloat16"))(params, toks)[0]
  assert l16.dtype == jnp.float32
  assert float(jnp.max(jnp.abs(l16 - l32))) < 0.05 * float(jnp.max(jnp.abs(l32))) + 1e-2


@pytest.mark.parametrize("cfg", [
    tiny(),
    tiny().with_variant("unified"),
    pytest.param(tiny(qk_norm=True, post_norm=True, qkv_bias=True), marks=pytest.mark.slow),
    pytest.param(tiny_moe(moe_capacity_factor=0.5),  # dropping tokens must stay causal too
                 marks=pytest.mark.integration),
], ids=["standard", "unified", "qknorm-post", "moe-capacity"])
def test_causality(cfg):
  params = randomize_scales(init_params(cfg))
  apply = jit_apply(cfg)
  toks = tokens(cfg, b=2, t=24)
  t0 = 10
  changed = toks.at[:, t0:].set((toks[:, t0:] + 7) % cfg.vocab_size)
  a, b = apply(params, toks)[0], apply(params, changed)[0]
  np.testing.assert_allclose(np.asarray(a[:, :t0]), np.asarray(b[:, :t0]), atol=1e-6, rtol=0)
  assert float(jnp.max(jnp.abs(a[:, t0:] - b[:, t0:]))) > 1e-3  # the future did change


@pytest.mark.integration  # a second compile of the model with remat: second tier
def test_remat_gives_same_loss_and_grads():
  cfg = tiny()
  params = init_params(cfg)
  toks = tokens(cfg)

  def grads(c):
    _, apply = models.functional(c)
    f = lambda p: models.lm_loss(apply(p, toks[:, :-1])[0], toks[:, 1:])
    return jax.jit(jax.value_and_grad(f))(params)

  base = grads(cfg)
  for c in (cfg.replace(remat="dots"),):
    other = grads(c)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7), base, other)


@pytest.mark.integration  # slow to compile on CPU: the second tier
def test_unrolled_layer_scan_gives_same_loss_and_grads():
  """scan_unroll 0 (all units, no loop) and a partial unroll compute the rolled loop's function;
  0 leaves no loop in the program."""
  cfg = tiny(n_layers=4)
  params = init_params(cfg)
  toks = tokens(cfg)

  def fn(c):
    _, apply = models.functional(c)
    return lambda p: models.lm_loss(apply(p, toks[:, :-1])[0], toks[:, 1:])

  base = jax.jit(jax.value_and_grad(fn(cfg)))(params)
  for u in (0, 2):
    other = jax.jit(jax.value_and_grad(fn(cfg.replace(scan_unroll=u))))(params)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-7), base, other)
  hlo = lambda c: jax.jit(fn(c)).lower(params).as_text()
  assert "while" in hlo(cfg) and "while" not in hlo(cfg.replace(scan_unroll=0))


def test_lm_loss_against_numpy():
  rng = np.random.default_rng(0)
  z = rng.normal(size=(2, 5, 7)).astype(np.float32)
  y = rng.integers(0, 7, size=(2, 5))
  m = rng.integers(0, 2, size=(2, 5)).astype(np.float32)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  nll = -np.take_along_axis(logp, y[..., None], -1)[..., 0]
  np.testing.assert_allclose(models.lm_loss(z, y, m), (nll * m).sum() / m.sum(), rtol=1e-6)
  np.testing.assert_allclose(models.lm_loss(z, y), nll.mean(), rtol=1e-6)
  assert models.lm_loss(z, y, np.zeros_like(m)) == 0.0


def test_jitted_adamw_step_with_masks_lowers_loss():
  cfg = tiny().with_variant("unified")
  _, apply = models.functional(cfg)
  params = init_params(cfg)
  tx = optax.adamw(1e-2, weight_decay=0.1, mask=models.weight_decay_mask(params, "iwd"))
  opt = tx.init(params)
  toks = tokens(cfg, b=4, t=16)

  @jax.jit
  def step(p, o):
    loss, g = jax.value_and_grad(lambda p: models.lm_loss(apply(p, toks[:, :-1])[0],
                                                          toks[:, 1:]))(p)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, loss

  losses = []
  for _ in range(5):
    params, opt, loss = step(params, opt)
    losses.append(float(loss))
  assert losses[-1] < losses[0]


def test_attention_impl_choice_on_cpu():
  from scaleopt.models.layers import attention_impl
  cfg = models.get_preset("tiny")
  expected = "cudnn" if jax.default_backend() == "gpu" else "xla"
  assert attention_impl(cfg, jnp.bfloat16) == expected
  assert attention_impl(cfg, jnp.float32) == "xla"
  assert attention_impl(cfg.replace(attention_impl="xla"), jnp.bfloat16) == "xla"


def test_layer_scan_keeps_program_size_independent_of_depth():
  def n_eqns(cfg):
    _, apply = models.functional(cfg)
    params = jax.eval_shape(models.functional(cfg)[0], jax.random.key(0))
    jaxpr = jax.make_jaxpr(apply)(params, jnp.zeros((1, 8), jnp.int32))
    return len(jaxpr.jaxpr.eqns)

  assert n_eqns(tiny(n_layers=2)) == n_eqns(tiny(n_layers=8))
  assert n_eqns(tiny_moe(n_layers=2)) == n_eqns(tiny_moe(n_layers=6))


def test_logits_dot_dtype_flag_and_explicit_cudnn_on_cpu():
  cfg = tiny(dtype="bfloat16")
  params = init_params(cfg)
  toks = tokens(cfg)
  a = jit_apply(cfg)(params, toks)[0]
  b = jit_apply(cfg.replace(logits_dot_in_fp32=True))(params, toks)[0]
  assert a.dtype == b.dtype == jnp.float32
  assert float(jnp.max(jnp.abs(a - b))) < 0.02 * float(jnp.max(jnp.abs(b)))
  if jax.default_backend() != "gpu":  # an explicit cuDNN request must not silently fall back
    with pytest.raises(Exception):
      jit_apply(cfg.replace(attention_impl="cudnn"))(params, toks)


@pytest.mark.slow
def test_benchmark_quick_mode_runs():
  import subprocess
  import sys
  out = subprocess.run([sys.executable, "benchmarks/models_throughput.py", "--quick"],
                       capture_output=True, text=True, check=True,
                       env={**__import__("os").environ, "PYTHONPATH": "."})
  assert "scaleopt standard" in out.stdout and "plain-JAX reference" in out.stdout
