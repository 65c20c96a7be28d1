"""PNG plots of a sweep: loss vs N, alpha vs s with the theory overlay, the fit-window report.

Figures are ``matplotlib.figure.Figure`` objects written straight to their files: nothing here
touches pyplot's figure manager or the backend, so importing this module in a notebook leaves
the notebook's own (inline) figures alone."""

from __future__ import annotations

import pathlib
from typing import Sequence

import matplotlib.ticker
import numpy as np
from matplotlib.figure import Figure


def _panels(k: int):
  """A grid of k panels, three per row; unused panels switched off."""
  cols = min(3, k)
  rows = -(-k // cols)
  fig = Figure(figsize=(4.2 * cols, 3.4 * rows))
  axes = fig.subplots(rows, cols, squeeze=False)
  for ax in list(axes.flat)[k:]:
    ax.axis("off")
  return fig, axes


def plot_loss_vs_n(loss_rows: Sequence[dict], path: pathlib.Path) -> None:
  """One panel per s: seed-mean (excess) loss at the selected hyper-parameters vs N, log-log."""
  svals = sorted({r["s"] for r in loss_rows})
  names = list(dict.fromkeys(r["optimizer"] for r in loss_rows))
  fig, axes = _panels(len(svals))
  for ax, s in zip(axes.flat, svals):
    for nm in names:
      pts = [r for r in loss_rows if r["s"] == s and r["optimizer"] == nm]
      n = np.array([r["N"] for r in pts])
      l = np.array([r["loss_mean"] for r in pts])
      e = np.array([r["loss_sem"] for r in pts])
      ax.errorbar(n, l, yerr=e, marker="o", ms=3, label=nm)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(f"s = {s:g}")
    ax.set_xlabel("N (features)")
    ax.set_ylabel("test loss (excess)")
  axes.flat[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def plot_alpha_vs_s(alpha_rows: Sequence[dict], path: pathlib.Path,
                    theory: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> None:
  """alpha(s) per optimizer with bootstrap intervals (left) and the shift over the baseline."""
  names = list(dict.fromkeys(r["optimizer"] for r in alpha_rows))
  fig = Figure(figsize=(10, 3.8))
  a1, a2 = fig.subplots(1, 2)
  for nm in names:
    pts = sorted((r for r in alpha_rows if r["optimizer"] == nm), key=lambda r: r["s"])
    s = np.array([r["s"] for r in pts])
    a = np.array([r["alpha"] for r in pts])
    lo = np.array([r["ci_low"] for r in pts])
    hi = np.array([r["ci_high"] for r in pts])
    a1.errorbar(s, a, yerr=[np.clip(a - lo, 0, None), np.clip(hi - a, 0, None)], marker="o",
                capsize=3, label=nm)
    a2.plot(s, [r.get("shift", np.nan) for r in pts], marker="o", label=nm)
  colour = {nm: f"C{i}" for i, nm in enumerate(names)}
  for nm, (s, a) in (theory or {}).items():
    base = nm.split(" (")[0]
    a1.plot(s, a, ls="--" if base in colour else ":", color=colour.get(base, "gray"), lw=1,
            label=nm)
  a1.set_xlabel("s")
  a1.set_ylabel("fitted alpha")
  a1.legend(fontsize=8)
  a2.axhline(0, color="k", lw=0.5)
  a2.set_xlabel("s")
  a2.set_ylabel("alpha shift over baseline")
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def plot_theory_overlay(n: np.ndarray, sim: dict[str, np.ndarray], theory: dict[str, np.ndarray],
                        path: pathlib.Path, title: str = "") -> None:
  """Simulated (markers) vs closed-form (lines) loss vs N for each optimizer."""
  fig = Figure(figsize=(5, 3.8))
  ax = fig.subplots()
  for i, nm in enumerate(sim):
    ax.plot(n, sim[nm], "o", color=f"C{i}", label=f"{nm} simulated")
    if nm in theory:
      ax.plot(n, theory[nm], "-", color=f"C{i}", label=f"{nm} closed form")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("N")
  ax.set_ylabel("test loss")
  ax.set_title(title)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def plot_window(alpha_rows: Sequence[dict], path: pathlib.Path) -> None:
  """One panel per s: alpha fitted on each sliding window of N (markers, at the window's
  geometric centre) against the full-range alpha and its interval (line and band)."""
  svals = sorted({r["s"] for r in alpha_rows})
  names = list(dict.fromkeys(r["optimizer"] for r in alpha_rows))
  keys = [k for k in alpha_rows[0] if k.startswith("slope_")]
  centre = np.array([np.sqrt(float(k.split("_")[1]) * float(k.split("_")[2])) for k in keys])
  fig, axes = _panels(len(svals))
  for ax, s in zip(axes.flat, svals):
    for i, nm in enumerate(names):
      r = next(r for r in alpha_rows if r["s"] == s and r["optimizer"] == nm)
      ax.plot(centre, [r[k] for k in keys], "o-", color=f"C{i}", ms=3, label=nm)
      ax.axhline(r["alpha"], color=f"C{i}", lw=0.8, ls="--")
      if np.isfinite([r["ci_low"], r["ci_high"]]).all():
        ax.axhspan(r["ci_low"], r["ci_high"], color=f"C{i}", alpha=0.12)
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xticks(centre, [f"{c:.0f}" for c in centre])
    ax.set_title(f"s = {s:g}")
    ax.set_xlabel("N (geometric centre of the sliding window)")
    ax.set_ylabel("local alpha")
  axes.flat[0].legend(fontsize=8)
  fig.suptitle("local slopes over sliding windows of N; dashed + band: fitted alpha and interval",
               fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def theory_curves(cfg: dict, points: int = 13) -> dict[str, tuple[np.ndarray, np.ndarray]]:
  """Mode-counting alpha(s) for the sweep's gd / kron_sqrt / ng optimizers (same T, fit window,
  lr grid and damping) and the converged exponent; empty unless the teacher is isotropic."""
  from scaleopt.scaling import config as config_lib
  from scaleopt.scaling import theory

  p, f = cfg["problem"], cfg["fit"]
  if p["teacher"] != "isotropic":
    return {}
  svals = np.linspace(min(p["s"]), max(p["s"]), points) if len(p["s"]) > 1 else np.asarray(p["s"])
  n = np.asarray([v for v in p["n_features"] if f["n_min"] <= v <= f["n_max"]])
  out = {}
  for o in config_lib.parse_optimizers(cfg["optimizers"]):
    if o.kind not in ("gd", "kron_sqrt", "ng") or o.fixed.get("lr_scale") != "curvature":
      continue
    lrs = sorted({g["lr"] for g in o.grid})
    damping = min(g.get("damping", 0.0) for g in o.grid)
    out[f"{o.name} (mode counting)"] = (svals, theory.mode_counting_alpha(
        svals, n, f["steps"], o.kind, p["latent_dim"], p["spectrum"], lrs, damping))
  out["converged"] = (svals, theory.converged_alpha(svals, p["spectrum"]))
  return out


def plot_all(res, alpha_rows: Sequence[dict], loss_rows: Sequence[dict],
             out: pathlib.Path) -> None:
  """Loss-vs-N, alpha-vs-s (with the theory overlay) and the window plot for one sweep."""
  steps = res.cfg["fit"]["steps"]
  plot_loss_vs_n([r for r in loss_rows if r["steps"] == steps], out / "loss_vs_n.png")
  plot_alpha_vs_s(alpha_rows, out / "alpha_vs_s.png", theory=theory_curves(res.cfg))
  plot_window(alpha_rows, out / "window.png")
