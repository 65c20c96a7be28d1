r"""alpha of L(N) on language models from a study's `results.csv` (`scaleopt study`).

A study whose grid varies a model-size key (e.g. `model.d_model` at fixed depth) has one row per
training run: arm, the size value, lr, seed, status, val_loss, test_loss, ... For each arm:

  selection  per size, the learning rate with the smallest seed-mean `select_on` loss (the
             held-out split; non-finite = diverged never wins);
  L(N)       the `loss` column (the reporting split) at that lr, one row per seed; the seeds
             present at every size form the (seeds, sizes) array;
  alpha      `fit.fit_alpha` on it: the seeds are the independent draws, so the interval is the
             same draw-cluster t interval as the random-feature sweeps (the lr selection is done
             once on the other split and not redone per resample), plus the fit-window report.

When the size needs several keys at once (d_model with n_heads and d_ff), make each (optimizer,
width) an arm named `<arm><sep><size>` (e.g. `muon+256`: arm names allow letters, digits and
_ . + -) and pass `arm_sep="+"`: the size is then read from the arm name, not a grid column.

N is `n_of(size value)`, e.g. non-embedding parameters from `scaleopt.models.count_params`
(default: the size value itself; alpha in width and alpha in parameters differ by the exponent
relating them). `floor` is an assumed irreducible loss subtracted before the fit: language-model
loss does not decay to 0, and a raw-loss fit underestimates alpha when it is omitted.
"""

from __future__ import annotations

import csv
import pathlib
from typing import Callable

import numpy as np

from scaleopt.scaling import fit as fit_lib


def _float(v) -> float:
  try:
    return float(v)
  except (TypeError, ValueError):
    return float("nan")


def read_rows(path: str | pathlib.Path, size_key: str, arm_sep: str | None = None) -> list[dict]:
  """Finished rows (status ok or diverged) of a study's results.csv that carry `size_key`
  (with `arm_sep`: arm `name<sep>size` becomes arm `name` and column `size_key` = size)."""
  with open(path, newline="") as fh:
    rows = list(csv.DictReader(fh))
  if arm_sep:
    bad = [r["arm"] for r in rows if arm_sep not in r["arm"]]
    if bad:
      raise ValueError(f"{path}: arm {bad[0]!r} has no size after {arm_sep!r}")
    rows = [{**r, "arm": r["arm"].rsplit(arm_sep, 1)[0],
             size_key: r["arm"].rsplit(arm_sep, 1)[1]} for r in rows]
  if rows and size_key not in rows[0]:
    raise ValueError(f"{path}: no column {size_key!r}; columns are {', '.join(rows[0])}")
  return [r for r in rows if r.get("status") in ("ok", "diverged")]


def arm_curve(rows: list[dict], size_key: str, loss: str = "test_loss",
              select_on: str = "val_loss") -> tuple[np.ndarray, np.ndarray, dict]:
  """(sizes, losses[seeds, sizes], chosen lr per size) of one arm's rows."""
  sizes = sorted({_float(r[size_key]) for r in rows})
  chosen, per_size = {}, []
  for size in sizes:
    at = [r for r in rows if _float(r[size_key]) == size]
    lrs = sorted({_float(r["lr"]) for r in at})
    score = [np.mean([_float(r[select_on]) for r in at if _float(r["lr"]) == lr]) for lr in lrs]
    score = np.where(np.isfinite(score), score, np.inf)
    chosen[size] = lrs[int(np.argmin(score))]
    per_size.append({int(_float(r["seed"])): _float(r[loss]) for r in at
                     if _float(r["lr"]) == chosen[size]})
  seeds = sorted(set.intersection(*(set(d) for d in per_size)))
  if len(seeds) < 2:
    raise ValueError(f"{size_key}: fewer than 2 seeds finished at every size with the chosen "
                     "learning rates; no interval possible")
  losses = np.asarray([[d[s] for d in per_size] for s in seeds])
  return np.asarray(sizes), losses, chosen


def study_alpha(path: str | pathlib.Path, size_key: str,
                n_of: Callable[[float], float] | None = None, loss: str = "test_loss",
                select_on: str = "val_loss", floor: float = 0.0, bootstrap: int = 1000,
                ci: float = 0.95, method: str = "cluster_t", window: int = 3,
                arm_sep: str | None = None) -> list[dict]:
  """One row per arm: alpha [ci_low, ci_high], se, seeds, N grid, chosen lrs, window report."""
  rows = read_rows(path, size_key, arm_sep)
  out = []
  for arm in dict.fromkeys(r["arm"] for r in rows):
    sizes, losses, chosen = arm_curve([r for r in rows if r["arm"] == arm], size_key, loss,
                                      select_on)
    n = np.asarray([n_of(v) if n_of else v for v in sizes], float)
    fa = fit_lib.fit_alpha(n, losses, floor=floor, bootstrap=bootstrap, ci=ci, method=method)
    wr = fit_lib.window_report(n, fa.mean_loss, None, window)
    out.append({"arm": arm, "alpha": fa.alpha, "ci_low": fa.ci_low, "ci_high": fa.ci_high,
                "se": fa.se, "interval_method": method, "seeds": losses.shape[0],
                "n": n.tolist(), "lr": [chosen[v] for v in sizes],
                "alpha_drop_first": wr.alpha_drop_first, "alpha_drop_last": wr.alpha_drop_last,
                "mean_loss": fa.mean_loss.tolist()})
  return out
