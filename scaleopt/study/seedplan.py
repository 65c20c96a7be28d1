"""How many seeds a contrast needs, and the sequential plan that adds them where it is open.

A contrast ``a - b`` is estimated from the per-seed differences ``d_s = test_a(s) - test_b(s)``
(``report.paired_interval``). With n finite differences of sample standard deviation ``sd``
the 95% interval's half-width is ``t_{0.975, n-1} sd / sqrt(n)``. The seeds needed for a
target half-width ``h`` are the smallest ``n >= 2`` with

    t_{0.975, n-1} * sd / sqrt(n) <= h,

``sd`` taken from the seeds finished so far. It is a plan, not a guarantee: ``sd`` is itself an
estimate (from two seeds it can be off by a factor of several), so the half-width reached with
that many seeds may be wider or narrower.

Sequential mode (study key ``sequential``): each contrast it names whose half-width is above
the study's ``target_half_width`` gets its arms' next seeds at their best learning rates,
paired by seed, up to the planned count (at least one more seed, at most
``sequential.max_seeds``); a contrast at or below the target gets none. The plan is recomputed
from the finished cells whenever the runner asks for work, so seeds are added in rounds.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np
from scipy import stats as sps

MOST_SEEDS = 10_000  # a plan beyond this is reported as "> MOST_SEEDS"


def seeds_for_half_width(sd: float, target: float, level: float = 0.95,
                         most: int = MOST_SEEDS) -> Optional[int]:
  """The smallest n >= 2 with ``t_{(1+level)/2, n-1} sd / sqrt(n) <= target``; None when even
  ``most`` seeds are not enough (or sd is not finite)."""
  if not math.isfinite(sd) or not target > 0:
    return None
  q = 0.5 + level / 2
  # t > z, so n >= (z sd / target)^2: the search starts there, 256 counts at a time
  start = max(2, int((sps.norm.ppf(q) * sd / target) ** 2))
  for lo in range(start, most + 1, 256):
    n = np.arange(lo, min(lo + 256, most + 1))
    ok = np.nonzero(sps.t.ppf(q, n - 1) * sd / np.sqrt(n) <= target)[0]
    if ok.size:
      return int(n[ok[0]])
  return None


@dataclasses.dataclass(frozen=True)
class SeedPlan:
  """One contrast's seeds: ``seeds`` both arms finished (diverged ones included), ``n`` of them
  with finite differences, their sample sd, the interval's current half-width, the seeds
  ``needed`` for ``target`` (None: more than ``MOST_SEEDS``, or fewer than 2 finite seeds) and
  whether the contrast is ``settled`` (half-width <= target)."""
  seeds: int
  n: int
  sd: float
  half_width: float
  needed: Optional[int]
  target: float

  @property
  def settled(self) -> bool:
    return self.n >= 2 and self.half_width <= self.target

  def needed_str(self) -> str:
    if self.n < 2:
      return "-"
    return f"> {MOST_SEEDS}" if self.needed is None else str(self.needed)


def seed_plan(a: dict, b: dict, target: float, level: float = 0.95) -> SeedPlan:
  """The seed plan of contrast a - b from ``seed -> test loss`` of each arm (at its best lr)."""
  common = sorted(set(a) & set(b))
  d = np.asarray([a[s] - b[s] for s in common], np.float64)
  d = d[np.isfinite(d)]
  n = int(d.size)
  if n < 2:
    return SeedPlan(len(common), n, math.nan, math.nan, None, target)
  sd = float(d.std(ddof=1))
  half = float(sps.t.ppf(0.5 + level / 2, n - 1) * sd / math.sqrt(n))
  return SeedPlan(len(common), n, sd, half, seeds_for_half_width(sd, target, level), target)


def planned_seeds(p: SeedPlan, max_seeds: int) -> int:
  """How many seeds of the study's seed sequence a contrast's arms should have: what they have
  when settled; else the plan's count (at least one more seed, at most ``max_seeds``)."""
  if p.settled:
    return p.seeds
  if p.n < 2:
    want = p.seeds + (2 - p.n)
  else:
    want = p.seeds + max(1, (p.needed or max_seeds) - p.n)
  return max(p.seeds, min(max_seeds, want))


def driving(st) -> list[tuple]:
  """The contrasts that drive sequential mode: ``sequential.contrasts`` (``"a - b"``), else
  all of the study's."""
  names = st.sequential.contrasts if st.sequential else None
  return [c for c in st.contrasts if names is None or f"{c[0]} - {c[1]}" in names]


def sequential_cells(st, conds: list) -> list:
  """The cells sequential mode wants now (finished ones included): for each driving contrast
  and grid point whose arms both have a best lr, the first ``planned_seeds`` of the seed
  sequence for both arms, at their best lrs (stage 3; seeds of an arm's own search are its
  search cells). Empty without ``sequential``."""
  if st.sequential is None:
    return []
  by = {(c.arm, c.grid): c for c in conds}
  seq = st.seed_sequence()
  out: dict = {}
  for a, b, _ in driving(st):
    for g in dict.fromkeys(c.grid for c in conds):
      ca, cb = by[(a, g)], by[(b, g)]
      if ca.best_lr is None or cb.best_lr is None:
        continue
      p = seed_plan(ca.test, cb.test, st.target_half_width)
      for s in seq[:planned_seeds(p, st.sequential.max_seeds)]:
        for c in (ca, cb):
          if s not in st.arm_seeds(c.arm):
            cell = st.sequential_cell(c.arm, g, c.best_lr, s)
            out.setdefault(cell.id, cell)
  return list(out.values())
