"""Seed intervals against closed forms and Monte Carlo coverage."""

import math

import numpy as np
import pytest

from scaleopt.study.report import Interval, paired_interval, t_interval, verdict


def _t975_closed_form(df: int) -> float:
  """Student-t 0.975 quantiles with closed forms: df=1 (Cauchy) and df=2."""
  p = 0.975
  if df == 1:
    return math.tan(math.pi * (p - 0.5))
  if df == 2:
    return (2 * p - 1) / math.sqrt(2 * p * (1 - p))
  raise ValueError(df)


@pytest.mark.parametrize("x", [[1.0, 2.0], [0.3, -0.1, 0.5]])
def test_half_width_matches_closed_form_quantile(x):
  iv = t_interval(x)
  n = len(x)
  s = math.sqrt(sum((v - sum(x) / n) ** 2 for v in x) / (n - 1))
  half = _t975_closed_form(n - 1) * s / math.sqrt(n)
  assert iv.n == n and iv.mean == pytest.approx(sum(x) / n)
  assert iv.hi - iv.mean == pytest.approx(half, rel=1e-9)
  assert iv.mean - iv.lo == pytest.approx(half, rel=1e-9)


@pytest.mark.parametrize("n", [3, 5])
def test_coverage_monte_carlo(n):
  rng = np.random.default_rng(n)
  reps, mu = 4000, 1.7
  hits = 0
  for _ in range(reps):
    iv = t_interval(rng.normal(mu, 0.3, n))
    hits += iv.lo <= mu <= iv.hi
  # binomial sd of the coverage at 0.95: sqrt(.95 * .05 / 4000) = 0.0034
  assert abs(hits / reps - 0.95) < 0.012, hits / reps


def test_paired_interval_removes_the_seed_effect_and_covers():
  rng = np.random.default_rng(0)
  reps, n, diff = 3000, 4, -0.05
  hits, narrower = 0, 0
  for _ in range(reps):
    seed_effect = rng.normal(0, 1.0, n)  # shared by both arms at one seed
    a = {s: 3.0 + diff + seed_effect[s] + rng.normal(0, 0.01) for s in range(n)}
    b = {s: 3.0 + seed_effect[s] + rng.normal(0, 0.01) for s in range(n)}
    iv = paired_interval(a, b)
    hits += iv.lo <= diff <= iv.hi
    unpaired_half = t_interval(list(a.values())).hi - t_interval(list(a.values())).mean
    narrower += (iv.hi - iv.lo) / 2 < unpaired_half
  assert abs(hits / reps - 0.95) < 0.015
  assert narrower == reps


def test_edge_cases():
  assert t_interval([]).n == 0
  one = t_interval([2.0])
  assert one.n == 1 and one.mean == 2.0 and math.isnan(one.lo)
  assert t_interval([1.0, float("nan"), 3.0]).n == 2  # non-finite seeds are left out
  assert paired_interval({0: 1.0, 1: 2.0, 2: 3.0}, {1: 1.0, 2: 1.5}).n == 2  # common seeds
  assert verdict(Interval(-1.0, -2.0, -0.1, 3)) == "lower"
  assert verdict(Interval(1.0, 0.1, 2.0, 3)) == "higher"
  assert verdict(Interval(0.0, -1.0, 1.0, 3)) == "n.s."
  assert verdict(one) == "n < 2"
