"""Per-coordinate Monte Carlo checks of the plug-in estimators, and the API contracts that keep
them honest (one source of truth, live hyperparameters, clipping, reference modes).

Ground truth is closed form or Monte Carlo over many draws; statistics go through the real
collector (microbatch gradients = the microbatch data for a linear loss).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scaleopt.optim as so
from scaleopt.optim.adam_bc import adaptive_alpha, corrected_inverse, var_sq_of_mean

N_DRAWS = 120_000
SIGNAL = np.array([0.0, 4.0])  # mu / sqrt(V) per coordinate


def _draws(m, key=0):
  """Microbatch gradients [m, N, C] ~ N(mu_c, s^2) and the collector's GroupStats."""
  s = 1.0
  v = s * s / m
  mu = SIGNAL * np.sqrt(v)
  g = mu + s * jax.random.normal(jax.random.PRNGKey(key), (m, N_DRAWS, len(SIGNAL)))
  params = jnp.zeros((N_DRAWS, len(SIGNAL)))
  loss = lambda p, mb: (jnp.sum(p * mb), {})  # gradient of microbatch j = g_j
  tx = so.scale_by_adam_bc(mode="inv")        # layout "all" with Var(g_bar)
  stats = jax.jit(lambda p, g: so.collect(loss, p, g, tx.init(p)))(params, g)
  return stats.b, mu, v


@pytest.mark.parametrize("m", [4, 8])
def test_var_of_squared_mean_is_unbiased_per_coordinate(m):
  """E[4 g^2 V_hat - 2 V_hat^2 (m-1)/(m+1)] = Var(g_bar^2) = 4 mu^2 V + 2 V^2 on every
  coordinate, at zero and at high signal (4 standard errors; a 10% change of any coefficient
  moves the zero-signal mean by >= 8 s.e., checked by mutation)."""
  grp, mu, v = _draws(m)
  est = np.asarray(var_sq_of_mean(grp.mean, grp.var, m), np.float64)
  truth = 4 * mu ** 2 * v + 2 * v ** 2
  mean, se = est.mean(0), est.std(0) / np.sqrt(N_DRAWS)
  assert np.all(np.abs(mean - truth) < 4 * se), (mean / truth, se / truth)
  assert np.all(se / truth < 0.015)  # the test resolves a 10% error at zero signal
  # the old plug-in 4 g^2 V_hat + 2 V_hat^2 is ~3x too large at zero signal
  old = np.asarray(4 * grp.mean ** 2 * grp.var + 2 * grp.var ** 2, np.float64).mean(0)
  assert old[0] / truth[0] > 2.5


def _clamped_mean_at_zero_signal(m: int) -> float:
  """E[max(0, 4 g^2 V_hat - 2 V_hat^2 (m-1)/(m+1))] / V^2 at mu = 0, by quadrature over the
  exact sampling laws of Gaussian microbatch means: g^2 / V ~ chi2_1 and, independently,
  V_hat / V ~ chi2_{m-1} / (m-1). With X, Y those two: E[Y max(0, 4X - cY)] and
  E[max(0, 4X - t)] = 4 E[(X - a)+] = 4 (P(chi2_3 > a) - a P(chi2_1 > a)), a = t/4 (the chi2_1
  density times x is the chi2_3 density)."""
  from scipy import integrate, stats
  c, chim = 2 * (m - 1) / (m + 1), stats.chi2(m - 1)
  plus = lambda a: stats.chi2.sf(a, 3) - a * stats.chi2.sf(a, 1)
  inner = lambda y: 4 * plus(c * y / 4)
  outer = lambda u: (u / (m - 1)) * inner(u / (m - 1)) * chim.pdf(u)
  return integrate.quad(outer, 0, np.inf, limit=200)[0]


def test_clamped_variance_bias_matches_quadrature_and_vanishes_with_signal():
  """What the transform uses, max(0, Var_hat), through the real collector: at zero signal its
  mean equals the quadrature over the exact chi^2 laws (biased up, 1.38x at m = 8; 4 standard
  errors); at high signal the clamp is inactive and the mean is Var(g_bar^2) itself."""
  m = 8
  grp, mu, v = _draws(m, key=1)
  est = np.maximum(np.asarray(var_sq_of_mean(grp.mean, grp.var, m), np.float64), 0.0)
  truth = 4 * mu ** 2 * v + 2 * v ** 2
  ratio, se = est.mean(0) / truth, est.std(0)[0] / np.sqrt(N_DRAWS) / truth[0]
  want = _clamped_mean_at_zero_signal(m) / 2.0  # truth at mu = 0 is 2 V^2
  assert abs(ratio[0] - want) < 4 * se, (ratio[0], want, se)
  assert abs(ratio[1] - 1.0) < 0.02, ratio


def test_corrected_inverse_bias_per_coordinate():
  """Adam post-EMA with history (a = b2 v_{t-1} > 0), per coordinate: the corrected inverse
  is closer to T(E U) = 1/sqrt(a + b E x) than the plug-in on every coordinate, and 5x closer
  at high signal. (At zero signal x = g_bar^2 is a scaled chi^2_1, far from the delta
  method's small-noise regime: measured relative bias 0.22 -> 0.13; at mu = 4 sqrt(V):
  0.10 -> 0.017.)"""
  m, b2 = 8, 0.5
  grp, mu, v = _draws(m, key=2)
  x = np.asarray(grp.mean, np.float64) ** 2
  nu = 0.5 * v  # previous v: half of this step's noise floor
  t = 1000.0
  b = (1 - b2) / (1 - b2 ** t)
  u_hat = (b2 * nu + (1 - b2) * x) / (1 - b2 ** t)
  target = 1.0 / np.sqrt((b2 * nu + (1 - b2) * (mu ** 2 + v)) / (1 - b2 ** t))
  var_x = jnp.maximum(var_sq_of_mean(grp.mean, grp.var, m), 0.0)
  plug = np.asarray(corrected_inverse(jnp.asarray(u_hat, jnp.float32), var_x, b, 0.0, "none"))
  corr = np.asarray(corrected_inverse(jnp.asarray(u_hat, jnp.float32), var_x, b, 0.0,
                                      "post_ema"))
  bias_plug = plug.mean(0) / target - 1
  bias_corr = corr.mean(0) / target - 1
  assert np.all(bias_plug > 0)
  assert np.all(np.abs(bias_corr) < 0.7 * bias_plug), (bias_plug, bias_corr)
  assert abs(bias_corr[1]) * 5 < bias_plug[1], (bias_plug, bias_corr)


# ---------------------------------------------------------------------------------------
# One source of truth


def _reg():
  k1, k2 = jax.random.split(jax.random.PRNGKey(4))
  params = {"w": jax.random.normal(k1, (3, 2)), "b": jnp.zeros(2)}
  mbs = {"x": jax.random.normal(k2, (6, 5, 3)),
         "y": jnp.exp(jax.random.normal(k1, (6, 5, 2)))}
  loss = lambda p, mb: (0.5 * jnp.mean((mb["x"] @ p["w"] + p["b"] - mb["y"]) ** 2), {})
  return params, mbs, loss


def _steps(tx, params, mbs, loss, n=2, edit=None):
  st = tx.init(params)
  if edit:
    st = edit(st)

  @jax.jit
  def step(params, st):
    stats = so.collect(loss, params, mbs, st)
    u, st = tx.update(stats.numerator, st, params, bc_stats=stats)
    return optax.apply_updates(params, u), st

  for _ in range(n):  # v_hat at t = 1 does not depend on b2; t = 2 does
    params, st = step(params, st)
  return params


@pytest.mark.integration  # compiles a whole injected chain: second tier
def test_inject_hyperparams_live_b2_reaches_the_collector():
  """Changing b2 in inject_hyperparams' state changes the LOO folds in the same step: equal to
  a transform built with that b2 (and not to the one built with the stale value)."""
  params, mbs, loss = _reg()
  inj = optax.inject_hyperparams(so.adamw_bc)(learning_rate=1e-2, b2=0.95)

  def set_b2(st):
    st.hyperparams["b2"] = jnp.asarray(0.6)
    return st

  got = _steps(inj, params, mbs, loss, edit=set_b2)
  want = _steps(so.adamw_bc(1e-2, b2=0.6), params, mbs, loss)
  stale = _steps(so.adamw_bc(1e-2, b2=0.95), params, mbs, loss)
  for k in params:
    np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7)
  assert not np.allclose(got["w"], stale["w"], rtol=1e-4)


def test_collector_spec_is_hashable_and_compares_equal():
  a = so.collector_spec(so.adamw_bc(1e-3))
  b = so.collector_spec(so.adamw_bc(3e-4, b2=0.99))
  assert a == b and hash(a) == hash(b) and a.layout == "loo"
  assert so.collector_spec(so.adamw_bc(1e-3, crossfit="ab")) != a
  assert so.collector_spec(so.adamw_bc(1e-3, crossfit="symmetric")).num_groups == 1


# ---------------------------------------------------------------------------------------
# Clipping


@pytest.mark.parametrize("crossfit", ["ab", "loo", "symmetric"])
def test_consistent_clip_keeps_adam_scale_invariance(crossfit):
  """An active clip scales every statistic by c: the first update (no history) equals the
  unclipped one, while numerator-only clipping (the reference) shrinks the A/B update by c
  and leaves LOO and symmetric unchanged."""
  params, mbs, loss = _reg()
  inner = lambda: so.scale_by_adam_bc(eps=1e-12, crossfit=crossfit)

  def first(tx):
    st = tx.init(params)
    stats = so.collect(loss, params, mbs, st)
    return tx.update(stats.numerator, st, params, bc_stats=stats)[0], stats

  u0, _ = first(inner())
  u_c, st_c = first(optax.chain(so.clip_by_global_norm(1e-3), inner()))
  u_n, _ = first(optax.chain(so.clip_by_global_norm(1e-3, numerator_only=True), inner()))
  c = float(st_c.clip_factor)
  assert c < 1e-2
  for k in params:
    np.testing.assert_allclose(u_c[k], u0[k], rtol=2e-4, atol=1e-6)
    if crossfit == "ab":  # the reference's numerator-only clip: a learning-rate cut by ~c
      np.testing.assert_allclose(u_n[k], c * np.asarray(u0[k]), rtol=0.2, atol=1e-6)
    else:  # the numerator enters only the persistent moments: no effect on u
      np.testing.assert_allclose(u_n[k], u0[k], rtol=2e-4, atol=1e-6)


def test_consistent_clip_equals_collecting_scaled_gradients():
  """Independent reference: collecting the loss c * L (gradients c g_j) without clipping."""
  params, mbs, loss = _reg()
  tx = optax.chain(so.clip_by_global_norm(0.05), so.scale_by_adam_bc(crossfit="ab"))
  st = tx.init(params)
  stats = so.collect(loss, params, mbs, st)
  c = stats.clip_factor
  plain = so.scale_by_adam_bc(crossfit="ab")
  ref = so.collect(lambda p, mb: (c * loss(p, mb)[0], {}), params, mbs, plain.init(params))
  for x, y in zip(jax.tree.leaves((stats.numerator, stats.full, stats.b.mean, stats.b.var)),
                  jax.tree.leaves((ref.numerator, ref.full, ref.b.mean, ref.b.var))):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-12)


# ---------------------------------------------------------------------------------------
# Reference modes


def test_reference_post_ema_matches_per_microbatch_denominators():
  """inv = 1/D - Var(p_bar)/D^3, p_j = sqrt((b2 v + (1-b2) g_j^2)/(1-b2^t)), Var over B."""
  params, mbs, loss = _reg()
  b1, b2, eps = 0.9, 0.95, 1e-8
  tx = so.scale_by_adam_bc(b1, b2, eps, crossfit="ab", correction="reference_post_ema")
  st = tx.init(params)
  st = st._replace(nu=jax.tree.map(lambda x: 0.01 + 0.0 * x, st.nu), count=jnp.asarray(4))
  stats = so.collect(loss, params, mbs, st)
  u, _ = tx.update(stats.numerator, st, params, bc_stats=stats)
  g = jax.vmap(lambda mb: jax.grad(lambda p: loss(p, mb)[0])(params))(mbs)
  t = 5
  for k in params:
    gk = np.asarray(g[k], np.float64)
    ga, gb = gk[:3].mean(0), gk[3:]
    nu = 0.01
    p_j = np.sqrt((b2 * nu + (1 - b2) * gb ** 2) / (1 - b2 ** t))
    var_p = p_j.var(0, ddof=1) / 3
    v_hat = (b2 * nu + (1 - b2) * gb.mean(0) ** 2) / (1 - b2 ** t)
    d = np.sqrt(v_hat) + eps
    inv = np.maximum(1 / d - var_p / d ** 3, 0)
    m_hat = (1 - b1) * ga / (1 - b1 ** t)
    np.testing.assert_allclose(u[k], m_hat * inv, rtol=2e-4, atol=1e-7)


def test_adaptive_alpha_matches_cosine_rule():
  g_a = jnp.asarray([[1.0, -2.0], [0.5, 0.0]])
  x_b = jnp.asarray([[0.5, 3.0], [0.1, 0.2]])
  s_a, s_b = np.ravel(np.asarray(g_a) ** 2), np.ravel(np.asarray(x_b))
  cos = s_a @ s_b / (np.linalg.norm(s_a) * np.linalg.norm(s_b))
  np.testing.assert_allclose(adaptive_alpha(g_a, x_b, 0.25), 0.25 * cos, rtol=1e-6)
  # through the transform: x = (1 - alpha) g_A^2 + alpha x_B enters v
  params, mbs, loss = _reg()
  tx = so.scale_by_adam_bc(0.0, 0.5, 0.0, mode="cf", crossfit="ab", crossfit_alpha=0.25,
                           crossfit_alpha_adaptive=True)
  st = tx.init(params)
  stats = so.collect(loss, params, mbs, st)
  _, st2 = tx.update(stats.numerator, st, params, bc_stats=stats)
  for k in params:
    ga, xb = np.asarray(stats.a.mean[k]), np.asarray(stats.b.mean[k]) ** 2
    al = float(adaptive_alpha(jnp.asarray(ga), jnp.asarray(xb), 0.25))
    np.testing.assert_allclose(st2.nu[k], 0.5 * ((1 - al) * ga ** 2 + al * xb), rtol=1e-5)


def test_shampoo_separate_fallback_b1():
  """adam_b1 drives the AdamW fallback's momentum; preconditioned matrices keep b1."""
  params = {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}
  g = {"w": jnp.full((4, 3), 0.5), "b": jnp.full(3, 2.0)}
  tx = so.scale_by_shampoo(0.9, adam_b1=0.5, block_size=8)
  _, st = tx.update(g, tx.init(params), params)
  np.testing.assert_allclose(st.mu["b"], 0.5 * 2.0)
  np.testing.assert_allclose(st.mu["w"], 0.1 * 0.5, rtol=1e-6)


def test_shampoo_consistent_clip_equals_collecting_scaled_gradients():
  """Shampoo-BC's two-pass statistics under the clip (factor stats c^2, eigenvalue variances
  c^4, numerator c) equal those of the gradients c g_j collected without clipping."""
  rng = np.random.default_rng(5)
  gs = jnp.asarray(rng.normal(size=(8, 6, 5)) * np.linspace(0.5, 2.0, 5), jnp.float32)
  params = {"w": jnp.zeros((6, 5), jnp.float32)}
  loss = lambda p, mb: (jnp.sum(p["w"] * mb), {})
  inner = lambda: so.scale_by_shampoo(block_size=64, root_every=1, damping=1e-3, mode="full")
  tx = optax.chain(so.clip_by_global_norm(0.1), inner())
  stats = so.collect(loss, params, gs, tx.init(params))
  c = stats.clip_factor
  assert float(c) < 0.2
  ref = so.collect(lambda p, mb: (c * loss(p, mb)[0], {}), params, gs, inner().init(params))
  a, b = stats.precond, ref.precond
  for x, y in ((a.stat_L, b.stat_L), (a.var_L, b.var_L), (a.var_R, b.var_R),
               ({k: v[0] for k, v in a.eig_L.items()}, {k: v[0] for k, v in b.eig_L.items()}),
               (stats.numerator, ref.numerator), (stats.full, ref.full)):
    for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
      np.testing.assert_allclose(u, v, rtol=2e-4, atol=1e-10)
