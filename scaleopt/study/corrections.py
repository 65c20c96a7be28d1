"""The variance correction's size per layer over training, beside a study's contrasts.

Cells trained with ``run.telemetry_every`` record ``bc_correction/<group>`` (||u - u0|| / ||u0||:
the corrected update against the plug-in one, ``scaleopt.train.telemetry``) on telemetry steps;
the store keeps those curves. For each arm of a contrast that has them, summary.md gets one
table: a row per tensor group (layers in order), a column per telemetry step, each entry the
median over the arm's seeds at its best learning rate (the seeds that logged that step).
"""

from __future__ import annotations

import re

import numpy as np

from scaleopt.study import store

PREFIX = store.TELEMETRY_PREFIXES[0]


def _group_key(group: str) -> tuple:
  """Natural order: ``embed`` < ``layer2.attn`` < ``layer10.attn`` (numbers compared as numbers)."""
  return tuple((0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", group) if t)


def table(curves_by_seed: dict) -> tuple[list[int], dict[str, list[float]]]:
  """``{seed: {curve: {step: value}}}`` -> (the telemetry steps, {group: the median over seeds
  per step, NaN where no seed logged it}), groups in natural order."""
  groups = sorted({k[len(PREFIX):] for cv in curves_by_seed.values() for k in cv
                   if k.startswith(PREFIX)}, key=_group_key)
  steps = sorted({s for cv in curves_by_seed.values() for g in groups
                  for s in cv.get(PREFIX + g, {})})
  med = {}
  for g in groups:
    row = []
    for s in steps:
      vals = [cv[PREFIX + g][s] for cv in curves_by_seed.values() if s in cv.get(PREFIX + g, {})]
      vals = [v for v in vals if v is not None and np.isfinite(v)]
      row.append(float(np.median(vals)) if vals else float("nan"))
    med[g] = row
  return steps, med


def lines(st, conds) -> list[str]:
  """summary.md's section: one table per arm of a contrast with ``bc_correction`` curves."""
  by = {c.arm: c for c in conds if not c.grid}
  arms = [a for pair in st.contrasts for a in pair[:2]]
  out = []
  for arm in dict.fromkeys(arms):
    c = by.get(arm)
    if c is None or c.best_lr is None:
      continue
    steps, med = table(c.curves)
    if not med:
      continue
    if not out:
      out = ["", "## The correction's size per layer", "",
             "||u - u0|| / ||u0||: the bias-corrected update u against the plug-in update u0 "
             "(the same chain with the variance statistics set to 0), per tensor group, on the "
             "telemetry steps; each entry the median over the arm's seeds."]
    seeds = sorted(s for s, cv in c.curves.items() if any(k.startswith(PREFIX) for k in cv))
    out += ["", f"`{arm}` (lr {c.best_lr:g}, seeds with telemetry {seeds}):", "",
            "| group | " + " | ".join(f"step {s}" for s in steps) + " |",
            "|---" * (len(steps) + 1) + "|"]
    out += ["| " + " | ".join([g] + [f"{v:.2e}" if np.isfinite(v) else "-" for v in row]) + " |"
            for g, row in med.items()]
  return out
