r"""Spectral diagnostic: estimate the spectral exponent of a covariance and predict the alpha gain.

Given a data / feature matrix X (n x d) or its covariance eigenvalues:

1. Eigenvalues lambda_1 >= lambda_2 >= ... of the centred covariance X^T X / n (or the given
   vector). Eigenvalues below `rel_floor * lambda_1` and beyond rank min(n, d) are dropped.
2. Spectral exponent s_hat: OLS of log lambda_k on log k over the bulk k in [k_min, k_max]
   (defaults: k_min = 2 drops the top "mean" direction; k_max = half the retained rank drops
   the finite-sample tail), on a geometric grid of k so every decade weighs the same.
   Goodness of fit: R^2 of that regression on the grid (1 = perfect power law).
3. Convention: the sweep's zipf convention has lambda_k = k^{-s}, so s = s_hat; under the mrs
   convention lambda_k = k^{-(1+s)} so s = s_hat - 1.
4. Prediction: shift(s) = alpha_opt(s) - alpha_baseline(s) read from a sweep's alpha table and
   linearly interpolated at s (clamped to the table's range; `extrapolated` says when it was).
5. GD's resolved-mode count k_GD(T) = #{k : T lambda_k / lambda_1 >= 1}: if the model width N
   exceeds it, GD is optimisation-limited and preconditioning pays off (theory.py, point 3).
"""

from __future__ import annotations

import csv
import pathlib
from typing import NamedTuple, Sequence

import numpy as np


class Diagnosis(NamedTuple):
  s_hat: float           # fitted decay exponent of lambda_k
  s: float               # the sweep's s under `convention`
  r2: float              # goodness of fit of the power law on the fitted range
  k_range: tuple[int, int]
  eigenvalues: np.ndarray
  predicted_shift: dict[str, float]  # optimizer -> alpha shift over the baseline at s
  predicted_alpha: dict[str, float]
  extrapolated: bool
  gd_resolved_modes: int | None     # k_GD(T) when `steps` is given


def eigenvalues(x: np.ndarray) -> np.ndarray:
  """Descending covariance eigenvalues of X (n x d, rows = samples), or x itself if 1-D."""
  x = np.asarray(x, float)
  if x.ndim == 1:
    return np.sort(x)[::-1]
  if x.ndim != 2:
    raise ValueError(f"diagnose: expected a 1-D eigenvalue vector or a 2-D matrix, got shape "
                     f"{x.shape}")
  xc = x - x.mean(axis=0)
  if xc.shape[0] < xc.shape[1]:  # Gram trick: same non-zero eigenvalues
    lam = np.linalg.eigvalsh(xc @ xc.T / xc.shape[0])
  else:
    lam = np.linalg.eigvalsh(xc.T @ xc / xc.shape[0])
  return np.sort(lam)[::-1]


def fit_spectral_exponent(lam: np.ndarray, k_min: int = 2, k_max: int | None = None,
                          rel_floor: float = 1e-12, points: int = 40
                          ) -> tuple[float, float, tuple[int, int]]:
  """(s_hat, R^2, (k_min, k_max)) of lambda_k ~ C k^{-s_hat} on a geometric k grid."""
  lam = np.sort(np.asarray(lam, float))[::-1]
  rank = int(np.sum(lam > rel_floor * lam[0]))
  k_max = max(k_min + 2, rank // 2) if k_max is None else min(k_max, rank)
  if k_max <= k_min + 1:
    raise ValueError(f"diagnose: only {rank} eigenvalues above the floor; need more to fit")
  ks = np.unique(np.geomspace(k_min, k_max, points).round().astype(int))
  x, y = np.log(ks), np.log(lam[ks - 1])
  slope, icpt = np.polyfit(x, y, 1)
  resid = y - (slope * x + icpt)
  r2 = 1.0 - resid.var() / y.var() if y.var() > 0 else 1.0
  return float(-slope), float(r2), (int(k_min), int(k_max))


def read_alpha_table(table) -> list[dict]:
  """alpha rows from a list of dicts or an alpha.csv path."""
  if isinstance(table, (str, pathlib.Path)):
    with open(table) as fh:
      return [{**r, "s": float(r["s"]), "alpha": float(r["alpha"])} for r in csv.DictReader(fh)]
  return list(table)


def predict_from_table(s: float, table, baseline: str = "gd"
                       ) -> tuple[dict[str, float], dict[str, float], bool]:
  """Interpolated alpha per optimizer and shift over `baseline` at s."""
  rows = read_alpha_table(table)
  names = list(dict.fromkeys(r["optimizer"] for r in rows))
  alpha = {}
  svals = None
  for nm in names:
    pts = sorted((r["s"], r["alpha"]) for r in rows if r["optimizer"] == nm)
    svals = np.array([p[0] for p in pts])
    alpha[nm] = float(np.interp(s, svals, [p[1] for p in pts]))
  shift = {nm: alpha[nm] - alpha[baseline] for nm in names if nm != baseline}
  return alpha, shift, bool(s < svals.min() or s > svals.max())


def diagnose(x: np.ndarray, table=None, convention: str = "zipf", baseline: str = "gd",
             steps: int | None = None, k_min: int = 2, k_max: int | None = None) -> Diagnosis:
  """Spectral exponent of X's covariance (or of eigenvalues x) and the predicted alpha gain."""
  lam = eigenvalues(x)
  s_hat, r2, kr = fit_spectral_exponent(lam, k_min, k_max)
  s = s_hat if convention == "zipf" else s_hat - 1.0
  alpha, shift, extra = ({}, {}, False) if table is None else predict_from_table(
      s, table, baseline)
  kgd = None if steps is None else int(np.sum(steps * lam / lam[0] >= 1.0))
  return Diagnosis(s_hat, s, r2, kr, lam, shift, alpha, extra, kgd)


def report(d: Diagnosis, name: str = "") -> str:
  """A short human-readable summary."""
  lines = [f"{name}: s_hat = {d.s_hat:.3f} (R^2 = {d.r2:.3f}, k in {d.k_range}), sweep s = "
           f"{d.s:.3f}"]
  if d.gd_resolved_modes is not None:
    lines.append(f"  GD resolves ~{d.gd_resolved_modes} modes in the step budget")
  for nm, v in d.predicted_shift.items():
    lines.append(f"  predicted alpha shift {nm}: {v:+.3f}"
                 + (" (extrapolated: clamped to table edge)" if d.extrapolated else ""))
  return "\n".join(lines)


def predict_many(samples: Sequence[np.ndarray], table, **kw) -> list[Diagnosis]:
  return [diagnose(x, table, **kw) for x in samples]
