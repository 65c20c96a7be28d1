"""PNG plots of a sweep: loss vs N per (optimizer, s), alpha vs s, and the theory overlay."""

from __future__ import annotations

import pathlib
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def plot_loss_vs_n(loss_rows: Sequence[dict], path: pathlib.Path) -> None:
  """One panel per s: seed-mean (excess) loss at the selected hyper-parameters vs N, log-log."""
  svals = sorted({r["s"] for r in loss_rows})
  names = list(dict.fromkeys(r["optimizer"] for r in loss_rows))
  cols = min(3, len(svals))
  rows = -(-len(svals) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
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
  for ax in list(axes.flat)[len(svals):]:
    ax.axis("off")
  axes.flat[0].legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_alpha_vs_s(alpha_rows: Sequence[dict], path: pathlib.Path,
                    theory: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> None:
  """alpha(s) per optimizer with bootstrap intervals (left) and the shift over the baseline."""
  names = list(dict.fromkeys(r["optimizer"] for r in alpha_rows))
  fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
  for nm in names:
    pts = sorted((r for r in alpha_rows if r["optimizer"] == nm), key=lambda r: r["s"])
    s = np.array([r["s"] for r in pts])
    a = np.array([r["alpha"] for r in pts])
    lo = np.array([r["ci_low"] for r in pts])
    hi = np.array([r["ci_high"] for r in pts])
    a1.errorbar(s, a, yerr=[np.clip(a - lo, 0, None), np.clip(hi - a, 0, None)], marker="o",
                capsize=3, label=nm)
    a2.plot(s, [r.get("shift", np.nan) for r in pts], marker="o", label=nm)
  for nm, (s, a) in (theory or {}).items():
    a1.plot(s, a, ls="--", color="gray", label=nm)
  a1.set_xlabel("s")
  a1.set_ylabel("fitted alpha")
  a1.legend(fontsize=8)
  a2.axhline(0, color="k", lw=0.5)
  a2.set_xlabel("s")
  a2.set_ylabel("alpha shift over baseline")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_theory_overlay(n: np.ndarray, sim: dict[str, np.ndarray], theory: dict[str, np.ndarray],
                        path: pathlib.Path, title: str = "") -> None:
  """Simulated (markers) vs closed-form (lines) loss vs N for each optimizer."""
  fig, ax = plt.subplots(figsize=(5, 3.8))
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
  plt.close(fig)


def plot_all(res, alpha_rows: Sequence[dict], loss_rows: Sequence[dict],
             out: pathlib.Path) -> None:
  """Loss-vs-N and alpha-vs-s plots for one sweep (the files the CLI writes)."""
  steps = res.cfg["fit"]["steps"]
  plot_loss_vs_n([r for r in loss_rows if r["steps"] == steps], out / "loss_vs_n.png")
  plot_alpha_vs_s(alpha_rows, out / "alpha_vs_s.png")
