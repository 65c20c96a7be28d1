"""adamw_bc against optax.adamw, float64 numpy formulas and Monte Carlo references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scaleopt.optim as so
from scaleopt.optim.adam_bc import var_sq_of_mean
from scaleopt.optim.collect import BCStats, GroupStats

# ---------------------------------------------------------------------------------------
# std mode is optax.adamw


def _trees():
  k = jax.random.PRNGKey(3)
  ks = jax.random.split(k, 6)
  return [
      {"a": jax.random.normal(ks[0], (3, 4)), "b": jax.random.normal(ks[1], (5,))},
      [jax.random.normal(ks[2], ()), (jax.random.normal(ks[3], (2, 3, 2)),
                                      {"z": jax.random.normal(ks[4], (7,))})],
      jax.random.normal(ks[5], (8, 3)),
  ]


SCHEDULES = {
    "constant": 3e-3,
    "warmup_cosine": optax.warmup_cosine_decay_schedule(0.0, 1e-2, 20, 200, 1e-4),
    "linear": optax.linear_schedule(1e-2, 1e-4, 200),
}


@pytest.mark.parametrize("tree_idx", [0, 1, 2])
@pytest.mark.parametrize("sched", list(SCHEDULES))
def test_std_matches_optax_adamw(tree_idx, sched):
  params0 = _trees()[tree_idx]
  lr = SCHEDULES[sched]
  kw = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
  mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
  ref = optax.adamw(lr, mask=mask, **kw)
  ours = so.adamw_bc(lr, mode="std", correction="none", mask=mask, **kw)

  @jax.jit
  def run(params):
    def step(carry, key):
      p_r, s_r, p_o, s_o = carry
      g = jax.tree.map(lambda x, k: jax.random.normal(k, x.shape) + x,
                       p_r, _split_like(key, p_r))
      u_r, s_r = ref.update(g, s_r, p_r)
      u_o, s_o = ours.update(g, s_o, p_o)  # no bc_stats: an ordinary optax transform
      return (optax.apply_updates(p_r, u_r), s_r, optax.apply_updates(p_o, u_o), s_o), None
    carry = (params, ref.init(params), params, ours.init(params))
    carry, _ = jax.lax.scan(step, carry, jax.random.split(jax.random.PRNGKey(9), 200))
    return carry[0], carry[2]

  p_ref, p_ours = run(params0)
  for a, b in zip(jax.tree.leaves(p_ref), jax.tree.leaves(p_ours)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=2e-6, atol=2e-7)


def _split_like(key, tree):
  leaves, td = jax.tree.flatten(tree)
  return jax.tree.unflatten(td, list(jax.random.split(key, len(leaves))))


def test_inject_hyperparams_and_jit():
  params = _trees()[0]
  tx = optax.inject_hyperparams(so.adamw_bc)(learning_rate=1e-3, mode="std")
  ref = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3, b1=0.9, b2=0.95,
                                              weight_decay=0.1)
  s, s_r = tx.init(params), ref.init(params)
  s.hyperparams["learning_rate"] = jnp.asarray(5e-3)
  s_r.hyperparams["learning_rate"] = jnp.asarray(5e-3)
  g = jax.tree.map(jnp.ones_like, params)
  u, _ = jax.jit(tx.update)(g, s, params)
  u_r, _ = jax.jit(ref.update)(g, s_r, params)
  for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(u_r)):
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_bf16_params_keep_f32_state():
  p32 = _trees()[0]
  p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), p32)
  tx = so.adamw_bc(1e-2, mode="std")
  s16, s32 = tx.init(p16), tx.init(p32)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(s16[0].mu))
  for i in range(5):
    g32 = jax.tree.map(lambda x: jnp.cos(x + i), p32)
    g16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), g32)
    u16, s16 = tx.update(g16, s16, p16)
    u32, s32 = tx.update(g32, s32, p32)
    for a, b in zip(jax.tree.leaves(u16), jax.tree.leaves(u32)):
      assert a.dtype == jnp.bfloat16
      np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=3e-2, atol=1e-4)


def test_errors():
  with pytest.raises(ValueError, match="mode"):
    so.adamw_bc(1e-3, mode="sideways")
  with pytest.raises(ValueError, match="correction"):
    so.adamw_bc(1e-3, mode="full", correction="none")
  with pytest.raises(ValueError, match="correction"):
    so.adamw_bc(1e-3, mode="cf", correction="pre_ema")
  with pytest.raises(ValueError, match="crossfit"):
    so.adamw_bc(1e-3, mode="cf", crossfit="threefold")
  tx = so.adamw_bc(1e-3, mode="full")
  p = {"w": jnp.ones(3)}
  with pytest.raises(ValueError, match="needs bc_stats"):
    tx.update(p, tx.init(p), p)
  # m < 2 in the preconditioner group with a variance correction
  tx = so.adamw_bc(1e-3, mode="full", crossfit="ab")
  with pytest.raises(ValueError, match="at least 2 microbatches"):
    so.collect(lambda p, mb: (jnp.sum(p["w"] * mb), {}), p, jnp.ones((2, 3)), tx.init(p))
  # MultiSteps would mix the k-step mean gradient with one mini-step's statistics
  ms = optax.MultiSteps(so.adamw_bc(1e-3), every_k_schedule=2)
  with pytest.raises(ValueError, match="MultiSteps"):
    so.collect(lambda p, mb: (jnp.sum(p["w"] * mb), {}), p, jnp.ones((4, 3)), ms.init(p))


# ---------------------------------------------------------------------------------------
# Explicit float64 formulas of every mode (independent re-implementation from the paper's equations)

D_IN, D_OUT = 4, 3


def reg_loss(p, mb):
  pred = mb["x"] @ p["w"] + p["b"]
  # p["c"] has the same gradient in every microbatch: zero variance
  return 0.5 * jnp.mean((pred - mb["y"]) ** 2) + jnp.sum(p["c"] * jnp.arange(1.0, 3.0)), {}


def reg_params():
  k = jax.random.PRNGKey(5)
  return {"w": jax.random.normal(k, (D_IN, D_OUT)), "b": jnp.zeros(D_OUT), "c": jnp.ones(2)}


def reg_mbs(key, m, s=3):
  kx, ky = jax.random.split(key)
  x = jax.random.normal(kx, (m, s, D_IN))
  y = jnp.exp(jax.random.normal(ky, (m, s, D_OUT)))  # skewed targets
  return {"x": x, "y": y}


def per_mb_grads(params, mbs):
  g = jax.vmap(lambda mb: jax.grad(lambda p: reg_loss(p, mb)[0])(params))(mbs)
  return jax.tree.map(lambda a: np.asarray(a, np.float64), g)


def warm_state(tx, params, steps=3):
  """tx's state with non-trivial Adam moments from a few std steps."""
  std = so.scale_by_adam_bc(B1, B2, EPS, mode="std")
  s = std.init(params)
  for i in range(steps):
    g = jax.tree.map(lambda x: jnp.sin(x * (i + 1)) + 0.3, params)
    _, s = std.update(g, s, params)
  st = tx.init(params)
  return (st[0]._replace(count=s.count, mu=s.mu, nu=s.nu),) + tuple(st[1:])


def ref_inv(v_hat, var_x, b, eps, correction):
  d = np.sqrt(v_hat) + eps
  if correction == "none":
    return 1 / d
  u = np.maximum(v_hat, 1e-12)
  if correction == "post_ema":
    var_d = (b / (2 * np.sqrt(u))) ** 2 * var_x          # delta method for Var(sqrt(U))
    c = var_d / d ** 3
  else:  # (1/2) f''(x) for f(x) = 1/(sqrt(a + b x) + eps)
    c = b ** 2 * var_x * (1 / (4 * u * d ** 3) + 1 / (8 * u ** 1.5 * d ** 2))
  return np.maximum(1 / d - c, 0)


B1, B2, EPS, LR, WD = 0.9, 0.95, 1e-8, 1e-2, 0.1


def ref_ab_update(p, st, g_a, g_b, mode, correction, v_source):
  """float64 A/B (and inv: A = B = all) update -> (params_new, mu, nu)."""
  t = int(st.count) + 1
  out, mu_n, nu_n = {}, {}, {}
  for k in p:
    ga, gb = g_a[k], g_b[k]
    mu, nu = np.asarray(st.mu[k], np.float64), np.asarray(st.nu[k], np.float64)
    mb = gb.shape[0]
    gbar_a, gbar_b = ga.mean(0), gb.mean(0)
    if v_source == "sq_of_mean":
      x = gbar_b ** 2
      var_g = gb.var(0, ddof=1) / mb
      var_x = np.maximum(4 * gbar_b ** 2 * var_g - 2 * var_g ** 2 * (mb - 1) / (mb + 1), 0)
    else:
      x = (gb ** 2).mean(0)
      var_x = (gb ** 2).var(0, ddof=1) / mb
    m_new = B1 * mu + (1 - B1) * gbar_a
    v_new = B2 * nu + (1 - B2) * x
    m_hat, v_hat = m_new / (1 - B1 ** t), v_new / (1 - B2 ** t)
    b = (1 - B2) / (1 - B2 ** t)
    u = m_hat * ref_inv(v_hat, var_x, b, EPS, correction)
    pk = np.asarray(p[k], np.float64)
    out[k] = pk - LR * (u + WD * pk)
    mu_n[k], nu_n[k] = m_new, v_new
  return out, mu_n, nu_n


def run_ours_updates(mode, crossfit, correction, v_source="sq_of_mean", m=8, **kw):
  """(params, microbatches, state, optax updates, new state) of one step from a warm state."""
  params = reg_params()
  mbs = reg_mbs(jax.random.PRNGKey(11), m)
  tx = so.adamw_bc(LR, B1, B2, EPS, WD, mode=mode, crossfit=crossfit, correction=correction,
                   v_source=v_source, **kw)
  st = warm_state(tx, params)
  stats = so.collect(reg_loss, params, mbs, st)
  u, st_new = tx.update(stats.numerator, st, params, bc_stats=stats)
  return params, mbs, st, u, st_new


def run_ours(mode, crossfit, correction, v_source="sq_of_mean", m=8, **kw):
  params, mbs, st, u, st_new = run_ours_updates(mode, crossfit, correction, v_source, m, **kw)
  return params, mbs, st, optax.apply_updates(params, u), st_new


def assert_params(ours, ref, rtol=2e-4):
  for k in ref:
    np.testing.assert_allclose(np.asarray(ours[k], np.float64), ref[k], rtol=rtol, atol=1e-6)


# std Adam always uses the square of the full-batch mean, so it has no mean_sq variant
AB_CASES = [("std", "none", "sq_of_mean")] + [
    (mode, corr, vs) for mode, corr in [("cf", "none"), ("inv", "post_ema"), ("inv", "pre_ema"),
                                        ("full", "post_ema"), ("full", "pre_ema")]
    for vs in ("sq_of_mean", "mean_sq")]


@pytest.mark.parametrize("mode,correction,v_source", AB_CASES)
def test_ab_modes_match_float64_formula(mode, correction, v_source):
  params, mbs, st, new, st_new = run_ours(mode, "ab", None if correction == "none" and
                                          mode in ("std", "cf") else correction, v_source)
  g = per_mb_grads(params, mbs)
  if mode in ("std", "inv"):
    g_a = g_b = g
  else:
    g_a = {k: v[:4] for k, v in g.items()}
    g_b = {k: v[4:] for k, v in g.items()}
  ref, mu_ref, nu_ref = ref_ab_update(params, st[0], g_a, g_b, mode, correction, v_source)
  assert_params(new, ref)
  for k in ref:
    np.testing.assert_allclose(np.asarray(st_new[0].nu[k]), nu_ref[k], rtol=1e-4, atol=1e-12)


def test_reference_pre_ema_coefficient_is_reproducible():
  """reference_pre_ema=True uses 3/8 (the reference code's slip) instead of 1/8.

  At eps -> 0, (1/2) f'' is (3/8) b^2 U^{-5/2} with 1/8 and (5/8) b^2 U^{-5/2} with 3/8, so
  the subtracted term grows by 5/3; correction_scale=5/3 with the correct coefficient
  reproduces it (up to eps).
  """
  params = reg_params()
  mbs = reg_mbs(jax.random.PRNGKey(11), 8)
  tx0 = so.scale_by_adam_bc(B1, B2, 1e-12, mode="full", crossfit="ab", correction="pre_ema")
  stats = so.collect(reg_loss, params, mbs, tx0.init(params))
  def u_of(**kw):
    tx = so.scale_by_adam_bc(B1, B2, 1e-12, mode=kw.pop("mode", "full"), crossfit="ab", **kw)
    u, _ = tx.update(stats.numerator, tx.init(params), bc_stats=stats)
    return np.abs(np.asarray(u["w"], np.float64))
  cf = u_of(mode="cf")
  ok = u_of(correction="pre_ema")
  ref = u_of(correction="pre_ema", reference_pre_ema=True)
  scaled = u_of(correction="pre_ema", correction_scale=5.0 / 3.0)
  assert np.all(ref <= ok + 1e-7) and np.all(ok <= cf + 1e-7)
  pos = ref > 0
  np.testing.assert_allclose((cf - ref)[pos], (5.0 / 3.0) * (cf - ok)[pos], rtol=1e-3,
                             atol=1e-6)
  np.testing.assert_allclose(ref, scaled, rtol=1e-4, atol=1e-6)


def test_zero_variance_coordinates_get_exactly_zero_correction():
  for corr in ("post_ema", "pre_ema"):
    _, _, _, new_full, _ = run_ours("full", "ab", corr)
    _, _, _, new_cf, _ = run_ours("cf", "ab", None)
    np.testing.assert_array_equal(np.asarray(new_full["c"]), np.asarray(new_cf["c"]))
    assert not np.allclose(np.asarray(new_full["w"]), np.asarray(new_cf["w"]), rtol=1e-7, atol=0)
    _, _, _, new_inv, _ = run_ours("inv", "ab", corr)
    _, _, _, new_std, _ = run_ours("std", "ab", None)
    np.testing.assert_array_equal(np.asarray(new_inv["c"]), np.asarray(new_std["c"]))


def test_symmetric_matches_float64_formula():
  for mode, corr in (("cf", None), ("full", "post_ema"), ("full", "pre_ema")):
    params, mbs, st, new, st_new = run_ours(mode, "symmetric", corr)
    g = per_mb_grads(params, mbs)
    t = int(st[0].count) + 1
    b = (1 - B2) / (1 - B2 ** t)
    for k in params:
      mu, nu = np.asarray(st[0].mu[k], np.float64), np.asarray(st[0].nu[k], np.float64)
      sides = []
      for gs in (g[k][:4], g[k][4:]):
        gbar = gs.mean(0)
        var_g = gs.var(0, ddof=1) / 4
        var_x = np.maximum(4 * gbar ** 2 * var_g - 2 * var_g ** 2 * 3 / 5, 0)  # m = 4
        m_hat = (B1 * mu + (1 - B1) * gbar) / (1 - B1 ** t)
        v_hat = (B2 * nu + (1 - B2) * gbar ** 2) / (1 - B2 ** t)
        sides.append((m_hat, ref_inv(v_hat, var_x, b, EPS, corr or "none")))
      u = 0.5 * (sides[0][0] * sides[1][1] + sides[1][0] * sides[0][1])
      pk = np.asarray(params[k], np.float64)
      np.testing.assert_allclose(np.asarray(new[k]), pk - LR * (u + WD * pk), rtol=2e-4,
                                 atol=1e-6)
      g_full = g[k].mean(0)  # persistent moments from the full batch
      np.testing.assert_allclose(np.asarray(st_new[0].nu[k]),
                                 B2 * nu + (1 - B2) * g_full ** 2, rtol=1e-4, atol=1e-12)


@pytest.mark.parametrize("mode", ["cf", "full"])
def test_loo_matches_explicit_per_fold_formula(mode):
  m = 8
  params, mbs, st, upd, st_new = run_ours_updates(
      mode, "loo", None if mode == "cf" else "post_ema", m=m)
  g = per_mb_grads(params, mbs)
  t = int(st[0].count) + 1
  for k in params:
    mu, nu = np.asarray(st[0].mu[k], np.float64), np.asarray(st[0].nu[k], np.float64)
    firsts, thirds, ds = [], [], []
    for r in range(m):
      g_r = g[k][r]
      g_mr = np.delete(g[k], r, axis=0).mean(0)  # explicit leave-one-out mean
      m_hat = (B1 * mu + (1 - B1) * g_r) / (1 - B1 ** t)
      v_hat = np.maximum((B2 * nu + (1 - B2) * g_mr ** 2) / (1 - B2 ** t), 0)
      d = np.sqrt(v_hat) + EPS
      firsts.append(m_hat / d); thirds.append(m_hat / d ** 3); ds.append(d)
    u_first = np.mean(firsts, 0)
    if mode == "full":
      u = u_first - np.var(ds, 0, ddof=1) * np.mean(thirds, 0)
      u = np.where(np.sign(u) != np.sign(u_first), 0.0, u)
    else:
      u = u_first
    pk = np.asarray(params[k], np.float64)
    # the update itself (not the parameters, where lr hides the Jensen term)
    np.testing.assert_allclose(np.asarray(upd[k], np.float64), -LR * (u + WD * pk), rtol=1e-5,
                               atol=1e-9)
    np.testing.assert_allclose(np.asarray(st_new[0].mu[k]),
                               B1 * mu + (1 - B1) * g[k].mean(0), rtol=1e-5, atol=1e-8)


def test_sparse_filter_keeps_embeddings_on_full_batch_adamw():
  params = reg_params()
  mbs = reg_mbs(jax.random.PRNGKey(2), 8)
  is_sparse = lambda p: {"w": False, "b": True, "c": False}
  tx = so.adamw_bc(LR, B1, B2, EPS, WD, mode="full", crossfit="ab", sparse_filter=is_sparse,
                   sparse_learning_rate=3e-3)
  st = tx.init(params)
  stats = so.collect(reg_loss, params, mbs, st)
  u, _ = jax.jit(lambda s, st: tx.update(s.numerator, st, params, bc_stats=s))(stats, st)
  # sparse tensor: plain AdamW on the full-batch gradient with its own lr
  ref = optax.adamw(3e-3, B1, B2, EPS, weight_decay=WD)
  u_ref, _ = ref.update(stats.full, ref.init(params), params)
  np.testing.assert_allclose(u["b"], u_ref["b"], rtol=1e-6)
  # dense tensors: the same as adamw_bc without the filter
  tx_d = so.adamw_bc(LR, B1, B2, EPS, WD, mode="full", crossfit="ab")
  u_d, _ = tx_d.update(stats.numerator, tx_d.init(params), params, bc_stats=stats)
  np.testing.assert_allclose(u["w"], u_d["w"], rtol=1e-6)
  assert not np.allclose(u["b"], u_d["b"])


def test_loo_with_sparse_filter_runs_under_partition():
  params = reg_params()
  mbs = reg_mbs(jax.random.PRNGKey(2), 6)
  tx = so.adamw_bc(LR, mode="full", crossfit="loo",
                   sparse_filter=lambda p: {"w": False, "b": True, "c": False})
  st = tx.init(params)

  @jax.jit
  def step(p, st):
    stats = so.collect(reg_loss, p, mbs, st)
    u, st = tx.update(stats.numerator, st, p, bc_stats=stats)
    return optax.apply_updates(p, u), st

  p, st = step(params, st)
  p, st = step(p, st)
  assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(p))
  assert not np.allclose(p["w"], params["w"])


def test_std_warmup_steps_equal_std_then_switch():
  params = reg_params()
  tx_w = so.adamw_bc(LR, mode="full", crossfit="ab", std_warmup_steps=2)
  tx_s = so.adamw_bc(LR, mode="std")
  s_w, s_s = tx_w.init(params), tx_s.init(params)
  for i in range(3):
    stats = so.collect(reg_loss, params, reg_mbs(jax.random.PRNGKey(i), 8), s_w)
    u_w, s_w = tx_w.update(stats.numerator, s_w, params, bc_stats=stats)
    u_s, s_s = tx_s.update(stats.full, s_s, params)
    same = all(np.allclose(a, b, rtol=1e-6) for a, b in zip(jax.tree.leaves(u_w),
                                                           jax.tree.leaves(u_s)))
    assert same == (i < 2), i


def test_nonfinite_update_is_skipped_per_tensor():
  params = reg_params()
  tx = so.scale_by_adam_bc(mode="full", crossfit="ab")
  st = tx.init(params)
  stats = so.collect(reg_loss, params, reg_mbs(jax.random.PRNGKey(0), 8), st)
  bad_b = stats.b._replace(var=dict(stats.b.var, w=stats.b.var["w"].at[0, 0].set(jnp.nan)))
  stats = stats._replace(b=bad_b)
  u, st2 = tx.update(stats.numerator, st, params, bc_stats=stats)
  assert np.all(np.asarray(u["w"]) == 0) and int(st2.skipped) == 1
  assert int(so.skipped_tensors((st2, optax.EmptyState()))) == 1
  np.testing.assert_array_equal(st2.mu["w"], st.mu["w"])
  assert np.all(np.isfinite(u["b"])) and np.any(np.asarray(u["b"]) != 0)


# ---------------------------------------------------------------------------------------
# Monte Carlo: bias of the corrected inverses (Gamma statistics, m = 64)
#
# x_j ~ Gamma(2, 1/2) (mean 1, variance 1/2), x_bar of m = 64: x_bar ~ Gamma(2m, 1/(2m)), so the
# plug-in's expectation is exact, E[x_bar^{-p}] = (2m)^p Gamma(2m - p) / Gamma(2m). The Monte
# Carlo only estimates the mean of the subtracted term (relative standard error ~1e-3). The
# delta method leaves a residual of relative order 1/m (measured: 0.6-0.8% of the plug-in bias
# at m = 64; 6% at m = 8); a 10% error of the coefficient leaves 10%. Each test checks that
# the coefficient's +-10% fails its bound.

M_MC = 64
RESIDUAL = 0.03  # |corrected bias| <= 3% of the plug-in bias


@pytest.fixture(scope="module")
def gamma_draws():
  rng = np.random.default_rng(0)
  x = rng.gamma(shape=2.0, scale=0.5, size=(100_000, M_MC))
  return x.mean(1), x.var(1, ddof=1) / M_MC


def _plug_bias(p):
  """E[x_bar^{-p}] - 1, exact (x_bar ~ Gamma(2m, 1/(2m)))."""
  from math import lgamma, exp, log
  k = 2 * M_MC
  return exp(p * log(k) + lgamma(k - p) - lgamma(k)) - 1.0


def _assert_removes_leading_bias(plug, term_mean):
  """plug - s E[term] is within RESIDUAL of 0 at s = 1 and outside it at s = 0.9, 1.1."""
  assert plug > 0  # Jensen: the plug-in inverse is biased upward
  for s in (0.9, 1.0, 1.1):
    ok = abs(plug - s * term_mean) <= RESIDUAL * plug
    assert ok == (s == 1.0), (s, plug, term_mean)


@pytest.mark.parametrize("fn,p", [("inv_corrected", 1.0), ("inv_sqrt_corrected", 0.5),
                                  ("inv_fourth_root_corrected", 0.25)])
def test_delta_corrections_remove_the_leading_bias(gamma_draws, fn, p):
  xbar, var = gamma_draws
  xb32, var32 = jnp.asarray(xbar, jnp.float32), jnp.asarray(var, jnp.float32)
  term = np.asarray(xb32, np.float64) ** -p - np.asarray(getattr(so.delta, fn)(xb32, var32),
                                                         np.float64)
  _assert_removes_leading_bias(_plug_bias(p), float(term.mean()))


def test_adam_pre_ema_inverse_sqrt_removes_the_leading_bias(gamma_draws):
  """Through the transform: first step, b1 = 0, statistic = Gamma mean-of-squares, so
  v_hat = x_bar and the target is 1 / sqrt(E x) = 1; the subtracted term is u0 - u."""
  xbar, var = gamma_draws
  n = xbar.shape[0]
  tx = so.scale_by_adam_bc(b1=0.0, b2=0.95, eps=1e-8, mode="full", crossfit="ab",
                           correction="pre_ema", v_source="mean_sq", skip_nonfinite=False)
  ones = jnp.ones(n)
  grp = GroupStats(mean=ones, sq=jnp.asarray(xbar, jnp.float32),
                   var=jnp.asarray(var, jnp.float32), count=M_MC)
  stats = BCStats(numerator=ones, full=ones, a=grp, b=grp, loo=None, loss=0.0, aux={})
  u, _ = tx.update(ones, tx.init(ones), bc_stats=stats)
  tx0 = so.scale_by_adam_bc(b1=0.0, b2=0.95, eps=1e-8, mode="cf", crossfit="ab",
                            v_source="mean_sq")
  u0, _ = tx0.update(ones, tx0.init(ones), bc_stats=stats)
  term = np.asarray(u0, np.float64) - np.asarray(u, np.float64)
  _assert_removes_leading_bias(_plug_bias(0.5), float(term.mean()))


# ---------------------------------------------------------------------------------------
# Coupling: cross-fitting removes the same-batch dependence


def _coupling_errors(m, b2, trials=20_000):
  """Linear regression, x ~ N(0, I), y = eps, w = d; per-example g = x (x.d - eps).

  Population: E g = d; E[g_k^2] = |d|^2 + 2 d_k^2 + sigma^2 (Isserlis), so with one example
  per microbatch P_k = E[g_bar_k^2] = d_k^2 + (|d|^2 + d_k^2 + sigma^2) / m. Adam in steady
  state (v_{t-1} = P, t large, b1 = 0) has the population preconditioned direction d / sqrt(P).
  Returns |E u - d / sqrt(P)| for the same-batch, cross-fitted and cross-fitted + corrected
  (pre-EMA) updates, from the same Monte Carlo draws.
  """
  d = jnp.array([1.0, 0.5, -0.3, 0.0])
  sigma = 0.3
  var_g = float(jnp.sum(d * d)) + np.asarray(d) ** 2 + sigma ** 2
  P = np.asarray(d) ** 2 + var_g / m
  target = np.asarray(d) / np.sqrt(P)

  def loss(p, mb):
    return 0.5 * jnp.mean((mb["x"] @ p - mb["y"]) ** 2), {}

  warm = lambda s: s._replace(count=jnp.asarray(10_000, jnp.int32), nu=jnp.asarray(P, jnp.float32))
  tx_same = so.scale_by_adam_bc(b1=0.0, b2=b2, mode="std")
  tx = so.scale_by_adam_bc(b1=0.0, b2=b2, mode="cf", crossfit="rolling_b")
  tx_full = so.scale_by_adam_bc(b1=0.0, b2=b2, mode="full", crossfit="rolling_b",
                                correction="pre_ema")
  st_same, st, st_full = (warm(t.init(d)) for t in (tx_same, tx, tx_full))

  def one(key):
    kx, ke = jax.random.split(key)
    x = jax.random.normal(kx, (2, m, 1, 4))
    y = sigma * jax.random.normal(ke, (2, m, 1))
    a, b = {"x": x[0], "y": y[0]}, {"x": x[1], "y": y[1]}
    same = so.collect(loss, d, a, st_same)
    cross = so.collect(loss, d, a, st_full, b_microbatches=b)
    return (tx_same.update(same.numerator, st_same)[0],
            tx.update(cross.numerator, st, bc_stats=cross)[0],
            tx_full.update(cross.numerator, st_full, bc_stats=cross)[0])

  us = jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(0), trials))
  return [float(np.linalg.norm(np.asarray(u, np.float64).mean(0) - target)) for u in us]


def test_crossfit_expectation_closer_to_population_direction():
  # b2 = 0.9: this step's statistic has weight 0.1, coupling (O(b)) dominates Jensen (O(b^2))
  same, cross, _ = _coupling_errors(m=8, b2=0.9)
  assert cross < 0.5 * same, (same, cross)


def test_crossfit_plus_correction_beats_both_when_jensen_matters():
  # b2 = 0.5: the statistic has weight 0.5 and the inversion bias of cf is as large as the
  # coupling bias; the corrected inverse removes most of it
  same, cross, full = _coupling_errors(m=4, b2=0.5)
  assert full < 0.9 * min(same, cross), (same, cross, full)
