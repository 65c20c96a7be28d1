r"""Learning-rate selection and alpha fits with bootstrap confidence intervals (numpy only).

Fit: alpha = -slope of ordinary least squares of log Lbar(N) on log N over the N range,
Lbar the seed mean of the (excess) loss at the selected hyper-parameters.

Selection ("policy"): for each (optimizer, s, N), the grid point with the smallest seed-mean
final loss ("best"); or the grid point that is best at one reference N, reused for every N
("transfer"). Non-finite losses (divergence) never win.

Bootstrap: resample the seeds with replacement (B draws); in each draw redo the selection on the
resampled seed mean and refit; the interval is the (1-ci)/2, (1+ci)/2 percentile interval.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class AlphaFit(NamedTuple):
  alpha: float
  ci_low: float
  ci_high: float
  intercept: float
  selected: np.ndarray   # (nN,) index of the chosen grid point per N
  mean_loss: np.ndarray  # (nN,) seed-mean (excess) loss at the chosen point
  local_slopes: np.ndarray  # (nN-1,) -d log L / d log N between neighbours


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
  """Index of the chosen grid point per N from (..., nN, H) seed-mean losses."""
  ml = np.where(np.isfinite(mean_loss), mean_loss, np.inf)
  if policy == "best":
    return np.argmin(ml, axis=-1)
  idx = np.argmin(ml[..., ref, :], axis=-1)
  return np.broadcast_to(idx[..., None], ml.shape[:-1])


def fit_alpha(n: np.ndarray, losses: np.ndarray, floor: float = 0.0, fit_mask=None,
              policy: str = "best", ref: int = 0, bootstrap: int = 1000, ci: float = 0.95,
              seed: int = 0) -> AlphaFit:
  """alpha with a seed-bootstrap interval from losses of shape (seeds, nN, H).

  `floor` is subtracted before the fit (excess loss); `fit_mask` (nN,) picks the N range.
  """
  losses = np.asarray(losses, float)
  if losses.ndim == 2:
    losses = losses[:, :, None]
  n = np.asarray(n, float)
  fit_mask = np.ones(len(n), bool) if fit_mask is None else np.asarray(fit_mask, bool)
  log_n = np.log(n[fit_mask])

  def point(ml):  # ml: (..., nN, H) seed-mean
    idx = select(ml, policy, ref)
    chosen = np.take_along_axis(ml, idx[..., None], axis=-1)[..., 0] - floor
    with np.errstate(invalid="ignore", divide="ignore"):
      log_l = np.log(np.where(chosen > 0, chosen, np.nan))
    slope, icpt = ols_slope(log_n, log_l[..., fit_mask])
    return -slope, icpt, idx, chosen

  alpha, icpt, idx, chosen = point(losses.mean(axis=0))
  with np.errstate(invalid="ignore", divide="ignore"):
    ll = np.log(np.where(chosen > 0, chosen, np.nan))
  local = -np.diff(ll) / np.diff(np.log(n))
  lo = hi = np.nan
  if bootstrap > 0 and losses.shape[0] > 1:
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, losses.shape[0], size=(bootstrap, losses.shape[0]))
    boot = point(losses[draws].mean(axis=1))[0]
    boot = boot[np.isfinite(boot)]
    if boot.size:
      lo, hi = np.quantile(boot, [(1 - ci) / 2, (1 + ci) / 2])
  return AlphaFit(float(alpha), float(lo), float(hi), float(icpt), idx, chosen, local)
