"""Shampoo's safeguard counters (``state.rules``, ``so.rule_counts``) on constructed cases
whose count is known: a NaN statistic, Newton stopped after too few iterations, eigenvalues
below the floor and roots above d_max (float64 NumPy eigenvalues as the reference)."""

import jax
import jax.numpy as jnp
import numpy as np

import scaleopt.optim as so
from scaleopt.optim import shampoo_lib as S

B2 = 0.95


def _step(grads: dict, **kw):
  """The rule counts after one update (root_every=1: the first step computes roots)."""
  tx = S.scale_by_shampoo(b2=B2, root_every=1, graft="none", min_dim=1, **kw)
  params = {k: jnp.zeros(g.shape, jnp.float32) for k, g in grads.items()}
  _, st = tx.update({k: jnp.asarray(g, jnp.float32) for k, g in grads.items()},
                    tx.init(params), params)
  return st, {k: int(v) for k, v in so.rule_counts(st).items()}


def test_counters_are_zero_on_a_healthy_step_and_named_in_the_state():
  g = np.random.default_rng(0).normal(size=(6, 5))
  st, got = _step({"w": g}, root_method="eigh", damping=1e-3)
  assert set(got) == set(S.RULES) and all(v == 0 for v in got.values()), got
  assert set(st.rules) == set(S.RULES)


def test_nonfinite_roots_are_replaced_and_counted_per_block():
  """A NaN gradient makes every root of that tensor NaN: its 2 x 2 blocks keep their previous
  (identity) roots on both sides, 8 block roots; the finite tensor counts nothing."""
  rng = np.random.default_rng(1)
  bad = rng.normal(size=(8, 6))
  bad[0, 0] = np.nan
  st, got = _step({"bad": bad, "ok": rng.normal(size=(4, 4))}, root_method="eigh",
                  block_size=4, damping=1e-3)
  assert got["root_nonfinite"] == 2 * 4
  fac = st.factors["0"]  # "bad" is the first leaf
  np.testing.assert_array_equal(np.asarray(fac.PL), np.broadcast_to(np.eye(4), (4, 4, 4)))
  assert np.all(np.isfinite(np.asarray(st.factors["1"].PL)))


def test_newton_stopped_early_is_counted_per_matrix():
  """Rank-deficient factors (a 10 x 3 gradient: L has rank 3) with small damping need many
  Newton iterations: 2 leave both roots of each of the 3 stacked matrices unconverged (6);
  200 converge them all."""
  g = np.random.default_rng(2).normal(size=(3, 10, 3))
  kw = dict(root_method="newton", damping=1e-4, newton_precision="highest")
  assert _step({"w": g}, newton_iters=2, **kw)[1]["newton_unconverged"] == 6
  assert _step({"w": g}, newton_iters=200, **kw)[1]["newton_unconverged"] == 0


def _eig64(g, damping):
  """float64 eigenvalues of the damped first-step factors (1 - b2) G G^T, (1 - b2) G^T G."""
  g = np.asarray(g, np.float64)
  return [np.linalg.eigvalsh((1 - B2) * m + damping * np.eye(len(m))) for m in (g @ g.T, g.T @ g)]


def test_eigenvalues_at_the_floor_and_roots_at_d_max_are_counted():
  """A rank-2 8 x 6 gradient: L has 6 and R 4 eigenvalues equal to the damping, below a floor
  of 10 x damping (10 raised); d_max counts the eigenvalues whose root lam^{-1/4} exceeds it
  (computed from the float64 eigenvalues, a threshold between two of them)."""
  rng = np.random.default_rng(3)
  g = rng.normal(size=(8, 2)) @ rng.normal(size=(2, 6))
  damping, ratio = 1e-4, 10.0
  lam = np.concatenate(_eig64(g, damping))
  floor = ratio * damping
  assert (lam <= floor).sum() == 10
  _, got = _step({"w": g}, root_method="eigh", damping=damping, eig_floor_ratio=ratio)
  assert got["eig_floor_clamped"] == 10 and got["d_max_clamped"] == 0
  d = np.maximum(lam, floor) ** -0.25
  u = np.unique(np.round(d, 6))
  d_max = u[1] * (1 - 1e-3)  # just below the root of the second-largest eigenvalue
  expected = (d > d_max).sum()
  assert expected == len(lam) - 2  # L and R share their largest eigenvalue
  _, got = _step({"w": g}, root_method="eigh", damping=damping, eig_floor_ratio=ratio,
                 d_max=float(d_max))
  assert got["d_max_clamped"] == expected


def test_newton_counts_a_run_cut_at_the_cap_inside_the_quadratic_phase():
  """A well-conditioned matrix: the full run stops itself (converged) after N iterations; cut
  at N - 1 (||M - I|| already < 0.1, but the stop test not yet passed) it counts as
  unconverged, like a run cut far earlier."""
  from scaleopt.optim.shampoo_lib import roots
  a = np.random.default_rng(4).normal(size=(6, 6))
  f = jnp.asarray(a @ a.T + 6 * np.eye(6), jnp.float32)[None]
  n, _, bad = roots.newton_loop(f, 0.0, 4, 100, "highest")
  assert 3 < int(n) < 100 and not bool(bad[0])
  for iters in (1, int(n) - 1):
    assert bool(roots.newton_root_unconverged(f, 0.0, 4, iters, "highest")[1][0]), iters


def test_telemetry_rows_carry_the_counters():
  """``bc_rules/<rule>`` in the trainer's telemetry: the Newton roots of the next update, cut
  at 2 iterations, are all unconverged (one 10 x 3 matrix: 2)."""
  from scaleopt.train import telemetry
  g = np.random.default_rng(5).normal(size=(4, 10, 3)).astype(np.float32)
  params = {"w": jnp.zeros((10, 3), jnp.float32)}
  loss = lambda p, mb: (jnp.sum(p["w"] * mb), {})
  tx = S.scale_by_shampoo(root_every=1, root_method="newton", newton_iters=2, damping=1e-4,
                          min_dim=1)
  st = tx.init(params)
  stats = so.collect(loss, params, jnp.asarray(g), st)
  rows = telemetry._rules(tx, st, params, stats)
  assert {f"bc_rules/{k}" for k in S.RULES} <= set(rows)
  assert float(rows["bc_rules/newton_unconverged"]) == 2.0
  assert float(rows["bc_rules/root_nonfinite"]) == 0.0
