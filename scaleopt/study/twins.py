"""Twins: the same cell trained twice under two arm names, compared bit for bit.

A study's ``twins`` pairs arms with the same overrides, learning rates and seeds
(``study.config``). For every (learning rate, seed) both arms finished, summary.md says
whether the two runs are bitwise equal: every stored curve value (training loss at each logged
step, held-out loss at each evaluation, telemetry) and the final train, val and test losses,
compared as the exact numbers the store keeps. With ``run.deterministic`` on one kind of card
they must be (docs/training.md, "Reproducibility"); without it they show how far the same seed
drifts.
"""

from __future__ import annotations

import math

LOSSES = ("train_loss", "val_loss", "test_loss")


def _values(row: dict) -> dict:
  """``(curve, step) -> value`` for every stored curve point, plus the final losses."""
  out = {(k, s): v for k, curve in row["curves"].items() for s, v in curve.items()}
  out.update({(k, None): row.get(k) for k in LOSSES})
  return out


def _same(x, y) -> bool:
  if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
    return True
  return x == y


def compare(a: dict, b: dict) -> str:
  """One line: ``bitwise equal (N values)``, or where the two rows first differ (the earliest
  step of any curve, else the first final loss)."""
  va, vb = _values(a), _values(b)
  if va.keys() != vb.keys():
    only = sorted(map(str, va.keys() ^ vb.keys()))[:3]
    return f"differ: values logged by one run only ({', '.join(only)})"
  bad = [k for k in va if not _same(va[k], vb[k])]
  if not bad:
    return f"bitwise equal ({len(va)} values)"
  steps = [k for k in bad if k[1] is not None]
  k = min(steps, key=lambda k: (k[1], k[0] != "loss", k[0])) if steps else bad[0]
  where = f"{k[0]} at step {k[1]}" if k[1] is not None else k[0]
  return (f"differ in {len(bad)} of {len(va)} values; first: {where} "
          f"({va[k]!r} vs {vb[k]!r})")


def lines(st, rows: list[dict]) -> list[str]:
  """summary.md's section: a row per twin pair and (learning rate, seed) both arms finished."""
  if not st.twins:
    return []
  by = {(r["arm"], r["lr"], r["seed"]): r for r in rows}
  out = ["", "## Twins", "",
         "The same cell trained twice under two arm names (`twins`), every stored value "
         "compared exactly: logged training losses, held-out losses, telemetry, final losses.",
         "", "| twins | lr | seed | cards | result |", "|---|---|---|---|---|"]
  for a, b in st.twins:
    pairs = sorted((lr, s) for arm, lr, s in by if arm == a and (b, lr, s) in by)
    for lr, s in pairs:
      ra, rb = by[(a, lr, s)], by[(b, lr, s)]
      cards = " / ".join(dict.fromkeys(str(r.get("card")) for r in (ra, rb)))
      out.append(f"| {a} = {b} | {lr:g} | {s} | {cards} | {compare(ra, rb)} |")
    if not pairs:
      out.append(f"| {a} = {b} | - | - | - | no seed finished by both yet |")
  return out

