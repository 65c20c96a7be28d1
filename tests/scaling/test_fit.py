"""alpha fits and selection against synthetic data with a known exponent."""

import numpy as np

from scaleopt.scaling import fit


def test_recovers_known_exponent_with_noise():
  rng = np.random.default_rng(0)
  n = np.array([32, 64, 128, 256, 512, 1024])
  hits = 0
  for trial in range(20):
    alpha_true = rng.uniform(0.1, 1.0)
    losses = 3.0 * n[None, :] ** -alpha_true * np.exp(0.05 * rng.standard_normal((8, len(n))))
    fa = fit.fit_alpha(n, losses, bootstrap=400, seed=trial)
    assert abs(fa.alpha - alpha_true) < 0.05
    hits += fa.ci_low <= alpha_true <= fa.ci_high
    assert fa.ci_low < fa.alpha < fa.ci_high
  assert hits >= 15  # a 95 % interval should cover the truth most of the time


def test_excess_loss_and_fit_range():
  n = np.array([16, 32, 64, 128, 256])
  floor = 0.7
  losses = (floor + 2.0 * n ** -0.45)[None, :].repeat(3, 0)
  assert abs(fit.fit_alpha(n, losses, floor=floor, bootstrap=0).alpha - 0.45) < 1e-12
  assert fit.fit_alpha(n, losses, bootstrap=0).alpha < 0.3  # the floor flattens a raw fit
  bent = np.where(n > 64, 5.0 * n ** -1.0, 2.0 * n ** -0.2 * 64 ** -0.8 * 5 / 2)[None]
  sel = fit.fit_alpha(n, bent, fit_mask=n >= 64, bootstrap=0)
  assert abs(sel.alpha - 1.0) < 1e-9
  np.testing.assert_allclose(sel.local_slopes[-2:], 1.0)


def test_selection_best_and_transfer():
  n = np.array([10, 100, 1000])
  # grid point 0 is best at small N, point 1 at large N; divergence (nan) never wins
  l0 = np.array([1.0, 0.5, 0.4])
  l1 = np.array([2.0, 0.3, 0.04])
  l2 = np.full(3, np.nan)
  losses = np.stack([l0, l1, l2], -1)[None]
  best = fit.fit_alpha(n, losses, bootstrap=0)
  np.testing.assert_array_equal(best.selected, [0, 1, 1])
  np.testing.assert_allclose(best.mean_loss, [1.0, 0.3, 0.04])
  tr = fit.fit_alpha(n, losses, policy="transfer", ref=0, bootstrap=0)
  np.testing.assert_array_equal(tr.selected, [0, 0, 0])
  assert abs(tr.alpha - fit.fit_power_law(n, l0)[0]) < 1e-12
