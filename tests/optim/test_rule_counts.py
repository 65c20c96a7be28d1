"""Counters of the coordinates a safeguard changed (``state.rules``, ``so.rule_counts``),
against the same rules applied by hand to float64 transcriptions of the first step."""

import jax
import jax.numpy as jnp
import numpy as np

import scaleopt.optim as so

B2, EPS = 0.95, 1e-8


def _first_step(tx, g):
  params = {"w": jnp.zeros(g.shape[1:], jnp.float32)}
  loss = lambda p, mb: (jnp.sum(p["w"] * mb), {})
  st = tx.init(params)
  stats = so.collect(loss, params, jnp.asarray(g, jnp.float32), st)
  _, new = tx.update(stats.numerator, st, params, bc_stats=stats)
  return {k: int(v) for k, v in so.rule_counts(new).items()}


def test_loo_counts_sign_flips_and_enlarging_corrections():
  """First step (m = v = 0, b1 = 0.9): m_hat_r = g_r, d_r = |g_{-r}| + eps; u = first -
  Var_r(d) third; a flip where sign(u) != sign(first), an enlargement where |u| > |first|."""
  m = 6
  g = np.random.default_rng(0).normal(0.2, 1.0, (m, 40, 5))
  got = _first_step(so.scale_by_adam_bc(0.9, B2, EPS), g)
  gf = g.mean(0)
  d = np.abs((m * gf - g) / (m - 1)) + EPS
  first, third = (g / d).mean(0), (g / d ** 3).mean(0)
  u = first - d.var(0, ddof=1) * third
  flips = np.sign(u) != np.sign(first)
  assert 0 < flips.sum() < flips.size
  assert got["sign_flips_zeroed"] == flips.sum()
  assert got["enlarging"] == (~flips & (np.abs(u) > np.abs(first))).sum()
  assert got["inverse_clamped"] == got["variance_clamped"] == 0


def test_ab_counts_variance_clamps():
  """A/B full, post-EMA on the square of B's mean, first step: Var(x) = 4 g^2 V -
  2 V^2 (m-1)/(m+1) is negative (clamped at 0) where g^2 is small against V; those are
  counted. The inverse 1/D - Var(x)/(4 U D^3) stays positive here (first step: the ratio to
  1/D is 1 - r + 0.39 r^2 with r = V / g^2, which has no zero)."""
  m = 8
  g = np.random.default_rng(1).normal(0.1, 1.0, (2 * m, 40, 5))
  got = _first_step(so.scale_by_adam_bc(0.9, B2, EPS, crossfit="ab"), g)
  gb = g[m:]
  x = gb.mean(0) ** 2
  v = gb.var(0, ddof=1) / m
  var_x = 4 * x * v - 2 * v * v * (m - 1) / (m + 1)
  assert 0 < (var_x < 0).sum() < var_x.size
  assert got["variance_clamped"] == (var_x < 0).sum()
  assert got["inverse_clamped"] == got["sign_flips_zeroed"] == got["enlarging"] == 0


def test_ab_counts_inverse_clamps():
  """A/B full, mean of squares, correction_scale 8 (so that the correction can exceed the
  inverse): inv = max(1/D - 8 Var(x) / (4 U D^3), 0) with U = x = mean_B g_j^2 and Var(x) the
  Welford variance of g_j^2 over m; the zeros are counted."""
  m = 8
  g = np.random.default_rng(2).normal(0.1, 1.0, (2 * m, 40, 5))
  tx = so.scale_by_adam_bc(0.9, B2, EPS, crossfit="ab", v_source="mean_sq", correction_scale=8.0)
  got = _first_step(tx, g)
  s = g[m:] ** 2
  x, var_x = s.mean(0), s.var(0, ddof=1) / m
  d = np.sqrt(x) + EPS
  raw = 1 / d - 8.0 * var_x / (4 * x * d ** 3)
  assert 0 < (raw <= 0).sum() < raw.size
  assert got["inverse_clamped"] == (raw <= 0).sum()
  assert got["variance_clamped"] == got["sign_flips_zeroed"] == got["enlarging"] == 0


def test_telemetry_reports_the_counts():
  """``run.telemetry_every`` rows carry ``bc_rules/<rule>``: the counts of this step's update."""
  from scaleopt.train import telemetry
  m = 6
  g = jnp.asarray(np.random.default_rng(0).normal(0.2, 1.0, (m, 40, 5)), jnp.float32)
  params = {"w": jnp.zeros((40, 5), jnp.float32)}
  loss = lambda p, mb: (jnp.sum(p["w"] * mb), {})
  tx = so.adamw_bc(1e-3)
  st = tx.init(params)
  stats = so.collect(loss, params, g, st)
  u, new = tx.update(stats.numerator, st, params, bc_stats=stats)
  out = telemetry.compute(tx, st, params, stats, u, params)
  want = so.rule_counts(new)
  assert want["sign_flips_zeroed"] > 0
  assert {k: int(out[f"bc_rules/{k}"]) for k in want} == {k: int(v) for k, v in want.items()}
  assert all(telemetry.is_telemetry_key(f"bc_rules/{k}") for k in want)
