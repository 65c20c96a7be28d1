r"""Learning-rate selection, alpha fits, honest intervals and the fit-window report (numpy only).

Fit: alpha = -slope of ordinary least squares of log Lbar(N) on log N over the N range,
Lbar the mean over the K independent problem draws (`problem.seeds`) of the (excess) loss at
the selected hyper-parameters.

Selection ("policy"): for each (optimizer, s, N), the grid point with the smallest draw-mean
final loss ("best"); or the grid point that is best at one reference N, reused for every N
("transfer"). Non-finite losses (divergence) never win.

Intervals (`method`). A draw is everything random in one problem (U, W*, the training sample, a
Monte-Carlo test set); training itself is deterministic (full batch from W_0 = 0), so the draws
are the independent clusters and every source of variation lives inside them.

  "cluster_t" (default): cluster bootstrap over draws (B resamples of K draws with replacement,
      selection redone in each) for the standard error, corrected for the plug-in bias of the
      bootstrap variance and turned into a small-sample t interval:
        se^2 = K / (K - 1) * Var_b(alpha*_b),   alpha +- t_{K-1, (1+ci)/2} se.
      For a draw mean this is exactly the textbook t interval s / sqrt(K) * t_{K-1}; it stays
      honest at K = 2..5 where the percentile interval collapses.
  "cluster_resid_t": as cluster_t plus the OLS residual variance of the pooled fit,
        se^2 += sum_j r_j^2 / (m - 2) / sum_j (log N_j - mean log N)^2,
      which treats the curve's departure from a power law as noise (wider, conservative).
  "percentile": the (1-ci)/2, (1+ci)/2 percentiles of the same bootstrap, no correction — the
      former default, kept for comparison: with a handful of draws it under-covers badly
      (docs/scaling.md).

Window report (`window_report`): on the selected mean curve, local slopes over sliding windows
of `width` consecutive N (the whole grid), alpha with the smallest / largest fitted N dropped,
and the range of alpha over every contiguous sub-window of >= `width` fitted points.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from scipy import stats

INTERVAL_METHODS = ("cluster_t", "cluster_resid_t", "percentile")


class AlphaFit(NamedTuple):
  alpha: float
  ci_low: float
  ci_high: float
  intercept: float
  selected: np.ndarray   # (nN,) index of the chosen grid point per N
  mean_loss: np.ndarray  # (nN,) draw-mean (excess) loss at the chosen point
  local_slopes: np.ndarray  # (nN-1,) -d log L / d log N between neighbours
  se: float = float("nan")  # standard error behind the interval (nan for "percentile")
  method: str = "cluster_t"


class WindowReport(NamedTuple):
  windows: list[tuple[int, int]]  # (N_first, N_last) of each sliding window
  slopes: np.ndarray              # alpha fitted on each sliding window (all N)
  alpha_drop_first: float         # fit range without its smallest N
  alpha_drop_last: float          # fit range without its largest N
  alpha_win_min: float            # min / max over contiguous sub-windows of the fit range
  alpha_win_max: float


def ols_slope(log_n: np.ndarray, log_l: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Least-squares slope and intercept of log_l on log_n along the last axis (batched)."""
  x = log_n - log_n.mean()
  ybar = log_l.mean(axis=-1, keepdims=True)
  slope = ((log_l - ybar) * x).sum(axis=-1) / (x * x).sum()
  return slope, ybar[..., 0] - slope * log_n.mean()


def fit_power_law(n: np.ndarray, loss: np.ndarray) -> tuple[float, float]:
  """(alpha, log-intercept) with loss ~ exp(intercept) n^{-alpha}."""
  slope, icpt = ols_slope(np.log(np.asarray(n, float)), np.log(np.asarray(loss, float)))
  return float(-slope), float(icpt)


def select(mean_loss: np.ndarray, policy: str = "best", ref: int = 0) -> np.ndarray:
  """Index of the chosen grid point per N from (..., nN, H) draw-mean losses."""
  ml = np.where(np.isfinite(mean_loss), mean_loss, np.inf)
  if policy == "best":
    return np.argmin(ml, axis=-1)
  idx = np.argmin(ml[..., ref, :], axis=-1)
  return np.broadcast_to(idx[..., None], ml.shape[:-1])


def _safe_log(x: np.ndarray) -> np.ndarray:
  with np.errstate(invalid="ignore", divide="ignore"):
    return np.log(np.where(x > 0, x, np.nan))


def residual_se(log_n: np.ndarray, log_l: np.ndarray) -> float:
  """OLS standard error of the slope from the fit's own residuals (0 with two points)."""
  m = len(log_n)
  if m <= 2:
    return 0.0
  slope, icpt = ols_slope(log_n, log_l)
  r = log_l - (icpt + slope * log_n)
  x = log_n - log_n.mean()
  return float(np.sqrt((r * r).sum() / (m - 2) / (x * x).sum()))


def interval(alpha: float, boot: np.ndarray, k: int, ci: float, method: str,
             resid_se: float = 0.0) -> tuple[float, float, float]:
  """(low, high, se) from bootstrap replicates `boot` of alpha over k draws (module doc)."""
  boot = boot[np.isfinite(boot)]
  if boot.size < 2 or k < 2:
    return np.nan, np.nan, np.nan
  if method == "percentile":
    lo, hi = np.quantile(boot, [(1 - ci) / 2, (1 + ci) / 2])
    return float(lo), float(hi), np.nan
  var = boot.var(ddof=1) * k / (k - 1)
  if method == "cluster_resid_t":
    var += resid_se ** 2
  se = float(np.sqrt(var))
  q = float(stats.t.ppf((1 + ci) / 2, k - 1))
  return alpha - q * se, alpha + q * se, se


def fit_alpha(n: np.ndarray, losses: np.ndarray, floor: float = 0.0, fit_mask=None,
              policy: str = "best", ref: int = 0, bootstrap: int = 1000, ci: float = 0.95,
              seed: int = 0, method: str = "cluster_t") -> AlphaFit:
  """alpha with an interval from losses of shape (draws, nN, H) (or (draws, nN)).

  `floor` is subtracted before the fit (excess loss); `fit_mask` (nN,) picks the N range;
  `bootstrap` = 0 gives the point estimate only (nan interval).
  """
  if method not in INTERVAL_METHODS:
    raise ValueError(f"method {method!r}: allowed values are {', '.join(INTERVAL_METHODS)}")
  losses = np.asarray(losses, float)
  if losses.ndim == 2:
    losses = losses[:, :, None]
  n = np.asarray(n, float)
  fit_mask = np.ones(len(n), bool) if fit_mask is None else np.asarray(fit_mask, bool)
  log_n = np.log(n[fit_mask])

  def point(ml):  # ml: (..., nN, H) draw-mean
    idx = select(ml, policy, ref)
    chosen = np.take_along_axis(ml, idx[..., None], axis=-1)[..., 0] - floor
    slope, icpt = ols_slope(log_n, _safe_log(chosen)[..., fit_mask])
    return -slope, icpt, idx, chosen

  alpha, icpt, idx, chosen = point(losses.mean(axis=0))
  ll = _safe_log(chosen)
  local = -np.diff(ll) / np.diff(np.log(n))
  lo = hi = se = np.nan
  k = losses.shape[0]
  if bootstrap > 0 and k > 1:
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, k, size=(bootstrap, k))
    boot = point(losses[draws].mean(axis=1))[0]
    lo, hi, se = interval(float(alpha), boot, k, ci, method, residual_se(log_n, ll[fit_mask]))
  return AlphaFit(float(alpha), float(lo), float(hi), float(icpt), idx, chosen, local,
                  float(se), method)


def window_report(n: np.ndarray, mean_loss: np.ndarray, fit_mask=None,
                  width: int = 3) -> WindowReport:
  """Sensitivity of alpha to the N window, from the selected mean (excess) loss curve."""
  n = np.asarray(n, float)
  ll = _safe_log(np.asarray(mean_loss, float))
  log_n = np.log(n)
  fit_mask = np.ones(len(n), bool) if fit_mask is None else np.asarray(fit_mask, bool)

  def alpha_on(sel):
    return float(-ols_slope(log_n[sel], ll[sel])[0])

  width = max(2, min(width, len(n)))
  starts = range(len(n) - width + 1)
  windows = [(int(n[i]), int(n[i + width - 1])) for i in starts]
  slopes = np.asarray([alpha_on(slice(i, i + width)) for i in starts])
  idx = np.flatnonzero(fit_mask)
  drop_first = drop_last = lo = hi = np.nan
  if len(idx) >= 3:
    drop_first, drop_last = alpha_on(idx[1:]), alpha_on(idx[:-1])
  sub = [alpha_on(idx[a:b]) for a in range(len(idx)) for b in range(a + width, len(idx) + 1)]
  if sub:
    lo, hi = float(np.nanmin(sub)), float(np.nanmax(sub))
  return WindowReport(windows, slopes, drop_first, drop_last, lo, hi)
