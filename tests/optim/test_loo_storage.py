"""How one-pass leave-one-out stores the m microbatch gradients (``loo_storage``).

float32 storage runs the same arithmetic as the two-pass form (the stored g_r is the g_r the
second sweep recomputes), so the statistics must be equal per coordinate. bfloat16 storage
rounds each g_r to nearest, |g~_r - g_r| <= u |g_r| with u = 2^-8 (bfloat16's unit roundoff),
before the float32 folds; the error of each LOO statistic is then bounded per coordinate by
first-order propagation (derived in ``bf16_bounds``) and checked against a float64 reference
computed from the exact per-microbatch gradients (no collector code). Memory: bfloat16 stores
m x params x 2 bytes instead of 4 (compiled temporaries).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scaleopt.optim as so
from scaleopt.optim.collect.spec import default_fold_chunk

M, EPS, MAX_NORM = 8, 1e-8, 0.05
U = 2.0 ** -8  # bfloat16 unit roundoff (8 significand bits, round to nearest)


def mlp():
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {"w1": jax.random.normal(k1, (6, 5)) * 0.5, "b1": jnp.full((5,), 0.1),
            "w2": jax.random.normal(k2, (5, 3)) * 0.5}
  mbs = {"x": jax.random.normal(k3, (M, 4, 6)), "y": jax.random.normal(k4, (M, 4, 3))}

  def loss(p, mb):
    err = jnp.tanh(mb["x"] @ p["w1"] + p["b1"]) @ p["w2"] - mb["y"]
    return jnp.mean(err ** 2), {}

  return params, mbs, loss


def stats_of(opts, steps=2, vmap=False):
  """LOO statistics of ``steps`` jitted steps (clip active, adamw_bc under inject)."""
  params, mbs, loss = mlp()
  inner = optax.inject_hyperparams(so.adamw_bc)(learning_rate=1e-2, b2=0.9)
  tx = optax.chain(so.clip_by_global_norm(MAX_NORM),
                   so.collector_options(vmap_microbatches=vmap or None, **opts), inner)

  @jax.jit
  def step(p, st):
    s = so.collect(loss, p, mbs, st)
    u, st = tx.update(s.numerator, st, p, bc_stats=s)
    return optax.apply_updates(p, u), st, s

  st, out = tx.init(params), []
  for _ in range(steps):
    params, st, s = step(params, st)
    out.append(s)
  return out, params


def leaves(t):
  return [np.asarray(x, np.float64) for x in jax.tree.leaves(t)]


@pytest.mark.integration  # make test: test_collect_microbatching's one_pass_one_fold, vmap cases
@pytest.mark.parametrize("vmap", [False, True], ids=["scan", "vmap"])
def test_float32_storage_equals_the_two_pass_form(vmap):
  ref, p_ref = stats_of(dict(loo_passes=2))
  got, p_got = stats_of(dict(loo_storage="float32", loo_fold_chunk=1), vmap=vmap)
  assert float(ref[0].clip_factor) < 0.5  # the clip is active and scales every fold
  rtol = 1e-4 if vmap else 0.0  # vmapped gradients: the batched matmul's rounding
  for r, g in zip(ref, got):
    for x, y in zip(leaves((g.loo, g.numerator)), leaves((r.loo, r.numerator))):
      np.testing.assert_allclose(x, y, rtol=rtol, atol=rtol and 1e-6 * np.abs(y).max())
  for x, y in zip(leaves(p_got), leaves(p_ref)):
    np.testing.assert_allclose(x, y, rtol=rtol and 2e-5)


def _grads64():
  params, mbs, loss = mlp()
  out = [jax.grad(lambda p: loss(p, jax.tree.map(lambda x: x[j], mbs))[0])(params)
         for j in range(M)]
  return {k: np.stack([np.asarray(o[k], np.float64) for o in out]) for k in params}


def bf16_bounds(g, c):
  """float64 first-step LOO statistics (m = v = 0, t = 1: m_hat_r = c g_r, d_r = |c g_{-r}| +
  eps) and per-coordinate bounds of their change when every g_r moves by at most u |g_r|.

  g_{-r} = (m g_bar - g_r) / (m - 1) with g_bar from the unrounded gradients, so
  |dd_r| <= c u |g_r| / (m - 1) and |d m_hat_r| <= c u |g_r|. First order:
    |d (m_hat/d)|   <= |d m_hat| / d + |m_hat| |dd| / d^2,
    |d (m_hat/d^3)| <= |d m_hat| / d^3 + 3 |m_hat| |dd| / d^4,
    |d Var_r(d_r)|  <= 2/(m-1) sum_r |d_r - d_bar| (|dd_r| + mean |dd|),
  each averaged over r as the statistic is; twice that covers the second-order terms and the
  float32 rounding of the folds (both O(u^2) or O(2^-24) relative)."""
  gbar = g.mean(0)
  g_mr = (M * gbar - g) / (M - 1)
  mh, d = c * g, np.abs(c * g_mr) + EPS
  dmh, dd = c * U * np.abs(g), c * U * np.abs(g) / (M - 1)
  want = {"first": np.mean(mh / d, 0), "third": np.mean(mh / d ** 3, 0),
          "var": np.var(d, 0, ddof=1)}
  bound = {"first": np.mean(dmh / d + np.abs(mh) * dd / d ** 2, 0),
           "third": np.mean(dmh / d ** 3 + 3 * np.abs(mh) * dd / d ** 4, 0),
           "var": 2 / (M - 1) * np.sum(np.abs(d - d.mean(0)) * (dd + dd.mean(0)), 0)}
  return want, {k: 2 * b + 1e-5 * np.abs(want[k]) for k, b in bound.items()}


@pytest.mark.parametrize("vmap", [False, True], ids=["scan", "vmap"])
def test_bfloat16_storage_within_its_roundoff_bound(vmap):
  g = _grads64()
  gf = {k: v.mean(0) for k, v in g.items()}
  c = min(1.0, MAX_NORM / np.sqrt(sum(np.sum(x * x) for x in gf.values())))
  got = stats_of(dict(loo_storage="bfloat16"), steps=1, vmap=vmap)[0][0]
  assert c < 0.5
  worst = 0.0
  for k in g:
    want, bound = bf16_bounds(g[k], c)
    for t in ("first", "third"):
      err = np.abs(np.asarray(got.loo.mean[t][k], np.float64) - want[t])
      assert np.all(err <= bound[t]), (k, t, (err / bound[t]).max())
      worst = max(worst, (err / np.abs(want[t])).max())
    err = np.abs(np.asarray(got.loo.var[k], np.float64) - want["var"])
    assert np.all(err <= bound["var"]), (k, "var", (err / bound["var"]).max())
  assert worst > 1e-6  # the gradients really were rounded (float32 storage gives ~1e-7)


def test_bfloat16_storage_halves_the_stored_bytes():
  """Compiled temporaries: one-pass float32 minus two-pass is about m x params x 4 bytes (the
  two forms' other buffers differ a little); bfloat16 storage saves half of the stack (the fold
  widens one g_r at a time, not the stack)."""
  d = 192
  params = {"w1": jnp.zeros((d, d)), "w2": jnp.zeros((d, d))}
  mbs = {"x": jnp.zeros((M, 2, d)), "y": jnp.zeros((M, 2, d))}
  loss = lambda p, mb: (jnp.mean((jnp.tanh(mb["x"] @ p["w1"]) @ p["w2"] - mb["y"]) ** 2), {})

  def temp(**opts):
    tx = optax.chain(so.collector_options(**opts), so.adamw_bc(1e-3))
    f = jax.jit(lambda p, b, s: so.collect(loss, p, b, s))
    return f.lower(params, mbs, tx.init(params)).compile().memory_analysis().temp_size_in_bytes

  extra = M * 2 * d * d * 4
  two = temp(loo_passes=2)  # one fold at a time: a block's temporaries are not the stack's
  f32, bf16 = temp(loo_fold_chunk=1), temp(loo_fold_chunk=1, loo_storage="bfloat16")
  assert 0.9 * extra <= f32 - two <= 1.1 * extra, (two, f32, extra)
  assert 0.95 * extra / 2 <= f32 - bf16 <= 1.05 * extra / 2, (f32, bf16, extra)


@pytest.mark.integration  # make test: test_collect_microbatching's fold_blocks case (k = 3)
@pytest.mark.parametrize("storage,k", [
    ("float32", 3),  # 3 does not divide m = 8
    ("float32", 8),  # 8: all m in one scan step
    ("bfloat16", 3)])
def test_fold_blocks_equal_one_fold_at_a_time(storage, k):
  """``loo_fold_chunk`` k: the folds' scan unrolls k stored gradients per step, and the
  statistics and parameters equal one fold per step per coordinate, up to float32 rounding
  (and, in float32 storage, the two-pass form's)."""
  ref, p_ref = stats_of(dict(loo_passes=2) if storage == "float32" else
                        dict(loo_storage=storage, loo_fold_chunk=1))
  got, p_got = stats_of(dict(loo_storage=storage, loo_fold_chunk=k))
  for r, g in zip(ref, got):
    for x, y in zip(leaves((g.loo, g.numerator)), leaves((r.loo, r.numerator))):
      np.testing.assert_allclose(x, y, rtol=2e-5, atol=1e-7 * np.abs(y).max())
  for x, y in zip(leaves(p_got), leaves(p_ref)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-8)


def test_the_folds_scan_unrolls_k_folds_per_step():
  params, mbs, loss = mlp()
  mbs2 = jax.tree.map(lambda x: jnp.concatenate([x, x]), mbs)  # 2M = 16 microbatches
  # None: the default (1 on CPU, 8 on accelerators); at most m
  for k, m, unroll in ((3, M, 3), (None, M, min(default_fold_chunk(), M)), (16, M, M),
                       (8, 2 * M, 8)):
    tx = optax.chain(so.collector_options(loo_fold_chunk=k), so.adamw_bc(1e-3))
    b = mbs if m == M else mbs2
    jaxpr = jax.make_jaxpr(lambda p, s: so.collect(loss, p, b, s))(params, tx.init(params))
    scans = [(e.params["length"], e.params["unroll"]) for e in jaxpr.eqns
             if e.primitive.name == "scan"]
    assert scans == [(m, 1), (m, unroll)], (k, m, scans)  # the gradients' scan, the folds'


def test_the_default_fold_chunk_is_8_on_accelerators_and_1_on_cpu():
  assert default_fold_chunk("gpu") == default_fold_chunk("tpu") == 8
  assert default_fold_chunk("cpu") == 1
  assert default_fold_chunk() == (1 if jax.default_backend() == "cpu" else 8)


@pytest.mark.parametrize("extra,match", [
    (dict(loo_storage="float16"), "loo_storage='float16'"),
    (dict(loo_storage="bfloat16", loo_passes=2), "loo_passes=2 stores none"),
    (dict(loo_storage="bfloat16", crossfit="ab"), "leave-one-out layout"),
    (dict(loo_fold_chunk=0), "loo_fold_chunk=0 must be an integer >= 1"),
    (dict(loo_fold_chunk=4, loo_passes=2), "loo_passes=2 stores none"),
    (dict(loo_fold_chunk=4, crossfit="ab"), "leave-one-out layout"),
])
def test_bad_storage_options_are_one_line_errors(extra, match):
  with pytest.raises(ValueError, match=match):
    so.build({"name": "adamw_bc", "learning_rate": 1e-3, "extra": extra})


_SHARDED = r"""
import jax, jax.numpy as jnp, numpy as np, optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
import scaleopt.optim as so
assert jax.device_count() == 2
mesh = Mesh(np.array(jax.devices()), ("fsdp",))
d = 256
params = jax.device_put({"w1": jnp.zeros((d, d)), "w2": jnp.zeros((d, d))},
                        NamedSharding(mesh, P("fsdp", None)))
loss = lambda p, mb: (jnp.mean((jnp.tanh(mb["x"] @ p["w1"]) @ p["w2"] - mb["y"]) ** 2), {})

def temp(m, **opts):
  mbs = jax.device_put({"x": jnp.zeros((m, 4, d)), "y": jnp.zeros((m, 4, d))},
                       NamedSharding(mesh, P(None, "fsdp")))
  tx = optax.chain(so.collector_options(loo_fold_chunk=1, **opts), so.adamw_bc(1e-3))
  f = jax.jit(lambda p, b, s: so.collect(loss, p, b, s))
  st = jax.jit(tx.init)(params)
  return f.lower(params, mbs, st).compile().memory_analysis().temp_size_in_bytes

print(temp(16) - temp(8), temp(16, loo_storage="bfloat16") - temp(8, loo_storage="bfloat16"))
"""


@pytest.mark.integration  # a subprocess with 2 simulated devices
def test_stored_gradients_are_sharded_like_the_parameters():
  """FSDP on 2 simulated devices: 8 more stored float32 gradients cost each device
  8 x params x 4 / 2 bytes (half of them; replicated stacks would cost all), bfloat16 a quarter
  (one fold at a time: a fold block's temporaries would add to the count)."""
  import os
  import subprocess
  import sys
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
             JAX_PLATFORMS="cpu", PYTHONPATH=os.getcwd())
  out = subprocess.run([sys.executable, "-c", _SHARDED], env=env, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  f32, bf16 = map(int, out.stdout.split())
  half = 8 * 2 * 256 * 256 * 4 / 2
  assert 0.95 * half <= f32 <= 1.1 * half, (f32, half)
  assert 0.45 * half <= bf16 <= 0.6 * half, (bf16, half)
