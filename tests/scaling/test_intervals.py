"""Intervals that cover at their stated rate, and the fit-window report.

Ground truths: independent replicate sweeps (another draw set's alpha must fall inside this
set's interval about 83-90 % of the time), a synthetic family whose exponent is known exactly,
and OLS slopes computed here with numpy.polyfit.
"""

import numpy as np
import pytest

from scaleopt.scaling import config, fit, sweep

R, K = 24, 3  # replicate draw sets x independent problem draws per set


@pytest.fixture(scope="module")
def replicate_sweep():
  """One vmapped sweep of R * K draws, later split into R independent sets of K draws."""
  raw = {"problem": {"s": [1.0, 1.5], "latent_dim": 256, "n_features": [8, 16, 32, 64],
                     "d_out": 2, "seeds": R * K, "seed": 0},
         "train": {"steps": 10},
         "optimizers": {"gd": {"lr": [0.5, 1.0, 1.9]},
                        "ng": {"lr": [0.5, 1.0], "damping": 1e-2}},
         "compute": {"progress": False}}
  return sweep.run_sweep(config.load_config(raw))


def _replicate_coverage(res, method):
  inside = total = 0
  for arr in res.losses.values():
    for i in range(len(res.s)):
      fits = [fit.fit_alpha(res.n, arr[i, r * K:(r + 1) * K, :, :, -1], bootstrap=200, seed=r,
                            method=method) for r in range(R)]
      for a in range(R):
        for b in range(R):
          if a != b:
            total += 1
            inside += fits[a].ci_low <= fits[b].alpha <= fits[a].ci_high
  return inside / total


def test_replicate_alpha_falls_inside_another_sets_interval(replicate_sweep):
  """>= 70 % of replicate alphas inside another set's 95 % interval (~83-90 % expected)."""
  cover = _replicate_coverage(replicate_sweep, "cluster_t")
  assert cover >= 0.70, cover
  # the check has teeth: the uncorrected percentile bootstrap over the same draws fails it
  assert _replicate_coverage(replicate_sweep, "percentile") < 0.70


def test_interval_covers_known_exponent_at_nominal_rate():
  """Draws L_k(N) = c_k N^-alpha e^{eps_kN}: the draw-mean curve has exactly exponent alpha."""
  rng = np.random.default_rng(1)
  n = np.array([16, 32, 64, 128, 256])
  hits = {"cluster_t": 0, "percentile": 0}
  trials = 300
  for trial in range(trials):
    alpha = rng.uniform(0.1, 0.8)
    c = np.exp(0.3 * rng.standard_normal((4, 1)))
    losses = c * n ** -alpha * np.exp(0.1 * rng.standard_normal((4, len(n))))
    for method in hits:
      fa = fit.fit_alpha(n, losses, bootstrap=200, seed=trial, method=method)
      hits[method] += fa.ci_low <= alpha <= fa.ci_high
  assert 0.90 <= hits["cluster_t"] / trials <= 0.995, hits
  assert hits["percentile"] / trials < 0.85, hits


def test_cluster_t_se_is_the_standard_error_of_a_mean():
  """For a draw mean the corrected bootstrap variance is s^2 / K and the quantile t_{K-1}."""
  rng = np.random.default_rng(2)
  x = rng.standard_normal(5)
  boot = x[rng.integers(0, 5, (40000, 5))].mean(axis=1)
  lo, hi, se = fit.interval(float(x.mean()), boot, 5, 0.95, "cluster_t")
  assert se == pytest.approx(x.std(ddof=1) / np.sqrt(5), rel=0.02)
  assert (hi - lo) / 2 == pytest.approx(2.7764 * se, rel=1e-4)  # t_{4, 0.975}
  lo_r, hi_r, se_r = fit.interval(float(x.mean()), boot, 5, 0.95, "cluster_resid_t", 0.3)
  assert se_r == pytest.approx(np.hypot(se, 0.3), rel=1e-12)


def test_window_report_against_polyfit():
  n = np.array([16, 32, 64, 128, 256, 512])
  loss = np.where(n <= 64, 3.0 * n ** -0.2, 3.0 * 64 ** 0.6 * n ** -0.8)
  mask = n >= 32
  wr = fit.window_report(n, loss, mask, width=3)
  x, y = np.log(n), np.log(loss)
  assert wr.windows == [(16, 64), (32, 128), (64, 256), (128, 512)]
  ref = [-np.polyfit(x[i:i + 3], y[i:i + 3], 1)[0] for i in range(4)]
  np.testing.assert_allclose(wr.slopes, ref, rtol=1e-12)
  np.testing.assert_allclose(wr.slopes[[0, 2, 3]], [0.2, 0.8, 0.8], rtol=1e-12)
  # a smoothly curved log-log curve: every sub-window has its own slope
  curved = np.exp(-0.3 * x - 0.05 * x ** 2)
  wc = fit.window_report(n, curved, mask, width=3)
  yc = np.log(curved)
  assert wc.alpha_drop_first == pytest.approx(-np.polyfit(x[2:], yc[2:], 1)[0], rel=1e-12)
  assert wc.alpha_drop_last == pytest.approx(-np.polyfit(x[1:5], yc[1:5], 1)[0], rel=1e-12)
  subs = [-np.polyfit(x[a:b], yc[a:b], 1)[0] for a in range(1, 6) for b in range(a + 3, 7)]
  assert (wc.alpha_win_min, wc.alpha_win_max) == pytest.approx((min(subs), max(subs)),
                                                               rel=1e-12)
  flat = fit.window_report(n, 2.0 * n ** -0.5, mask)
  np.testing.assert_allclose([*flat.slopes, flat.alpha_drop_first, flat.alpha_drop_last], 0.5)


def test_summary_flags_window_sensitivity(replicate_sweep):
  rows, _ = sweep.summarize(replicate_sweep, bootstrap=50)
  for r in rows:
    assert r["interval_method"] == "cluster_t" and r["draws"] == R * K
    half = (r["ci_high"] - r["ci_low"]) / 2
    shift = max(abs(r["alpha_drop_first"] - r["alpha"]), abs(r["alpha_drop_last"] - r["alpha"]))
    assert r["window_ratio"] == pytest.approx(shift / half)
    assert {"slope_8_32", "slope_16_64"} <= set(r)
  msg = sweep.window_warning(rows)
  flagged = [r for r in rows if r["window_ratio"] > 1]
  assert (msg is None) == (not flagged)
  calm = [{**r, "window_ratio": 0.5} for r in rows]
  assert sweep.window_warning(calm) is None
  loud = [{**r, "window_ratio": 3.0} for r in rows]
  assert f"in {len(rows)} of {len(rows)}" in sweep.window_warning(loud)
