"""Seed planning and the sequential mode, on synthetic cells written straight into cells.jsonl
(no training): the seeds-needed count against closed-form t quantiles, the report's seed-plan
columns against SciPy's paired t-test, the planner adding seeds only to open contrasts, paired
by seed, until the target or the cap; config errors as one line."""

import math

import numpy as np
import pytest
from scipy import stats

from scaleopt import cli
from scaleopt.study import config as SC
from scaleopt.study import report, runner, seedplan, store
from scaleopt.train.config import ConfigError

from test_study_config import BC_TINY, _raw

T975 = {1: 12.706204736174698, 2: 4.302652729749464}  # t quantiles with closed forms


@pytest.mark.parametrize("df", [1, 2])
def test_t_quantiles_of_the_closed_forms(df):
  p = 0.975
  closed = math.tan(math.pi * (p - 0.5)) if df == 1 else (2 * p - 1) / math.sqrt(2 * p * (1 - p))
  assert T975[df] == pytest.approx(closed, rel=1e-12)


@pytest.mark.parametrize("sd, target, want", [
    (1.0, T975[1] / math.sqrt(2), 2),          # two seeds reach it exactly
    (1.0, T975[1] / math.sqrt(2) * 0.999, 3),  # just short with two: three
    (1.0, T975[2] / math.sqrt(3), 3),
    (1.0, T975[2] / math.sqrt(3) * 0.999, 4),
    (0.0, 0.01, 2)])
def test_seeds_for_half_width_at_closed_form_quantiles(sd, target, want):
  assert seedplan.seeds_for_half_width(sd, target * (1 + 1e-12)) == want


@pytest.mark.parametrize("sd, target", [(0.0753, 0.05), (0.3, 0.05), (0.024, 0.05)])
def test_seeds_for_half_width_is_the_first_n_that_reaches_it(sd, target):
  """Brackets: the returned n reaches the target, n - 1 does not (t from SciPy per n), and the
  count approaches the normal-theory (1.96 sd / h)^2 from above."""
  n = seedplan.seeds_for_half_width(sd, target)
  half = lambda k: stats.t.ppf(0.975, k - 1) * sd / math.sqrt(k)
  assert half(n) <= target and (n == 2 or half(n - 1) > target)
  assert n >= (1.959963984540054 * sd / target) ** 2
  assert seedplan.seeds_for_half_width(sd, target, most=n - 1) is None


def test_planned_count_gives_about_the_target_half_width_monte_carlo():
  """With the true sd, the planned n gives a half-width near the target (below it on
  average: E[s] < sigma); a plan, not a guarantee, so a sizeable share of draws exceeds it."""
  rng = np.random.default_rng(0)
  sigma, h = 0.08, 0.05
  n = seedplan.seeds_for_half_width(sigma, h)
  draws = rng.normal(0.1, sigma, (20000, n))
  halves = stats.t.ppf(0.975, n - 1) * draws.std(axis=1, ddof=1) / math.sqrt(n)
  assert 0.85 * h < halves.mean() <= h
  assert 0.2 < (halves > h).mean() < 0.6


def _study(edit=None):
  raw = _raw()
  raw["learning_rates"] = [1e-2]
  raw["arms"] = {"adamw": {"optimizer.name": "adamw"},
                 "wide": {"optimizer.name": "adamw", "optimizer.weight_decay": 0.0},
                 "mid": {"optimizer.name": "adamw", "optimizer.weight_decay": 0.05},
                 "tight": {"optimizer.name": "adamw", "optimizer.weight_decay": 0.2}}
  raw["contrasts"] = [["wide", "adamw", "noisy"], ["mid", "adamw", "settles at 4"],
                      ["tight", "adamw", "settled"]]
  raw["target_half_width"] = 0.05
  raw["sequential"] = {"max_seeds": 6}
  if edit:
    edit(raw)
  return SC.from_dict(raw, BC_TINY)


DELTA = 0.03 / math.sqrt(2)  # two differences m -+ DELTA have sample sd 0.03


def _loss(arm: str, seed: int) -> float:
  """Planted test losses: a seed effect shared by every arm plus the arm's differences from
  adamw, ``wide`` sd 0.3, ``mid`` m -+ DELTA alternating, ``tight`` sd ~0.001."""
  base = 3.0 + 0.2 * math.sin(seed + 1.0)
  d = {"adamw": 0.0, "wide": 0.1 + 0.3 * (-1) ** seed * (1 + seed / 3),
       "mid": 0.1 + DELTA * (-1) ** (seed + 1), "tight": 0.02 + 0.001 * (-1) ** seed}[arm]
  return base + d


def _finish(out, cells):
  store.append(out, [{"cell": {"id": c.id, "arm": c.arm, "grid": dict(c.grid), "lr": c.lr,
                               "seed": c.seed, "stage": c.stage},
                      "config": None,
                      "result": {"id": c.id, "arm": c.arm, "lr": c.lr, "seed": c.seed,
                                 "stage": c.stage, "status": "ok", "gradient_passes": 1.0,
                                 "val_loss": _loss(c.arm, c.seed),
                                 "test_loss": _loss(c.arm, c.seed)},
                      "summary": {}, "curves": {}} for c in cells])


def _seeds(out, arm):
  return sorted(r["seed"] for r in store.rows(out) if r["arm"] == arm)


def test_sequential_adds_seeds_only_to_open_contrasts_paired_until_target_or_cap(tmp_path):
  st = _study()
  first = runner.plan(st, tmp_path)
  assert sorted(c.id for c in first) == sorted(c.id for c in st.search_cells())
  _finish(tmp_path, first)
  rounds = []
  while todo := runner.plan(st, tmp_path):
    rounds.append(sorted((c.arm, c.seed, c.stage) for c in todo))
    assert all(c.stage == 3 and c.lr == 1e-2 for c in todo)
    for s in {c.seed for c in todo}:  # both arms of a contrast get each new seed
      assert {c.arm for c in todo if c.seed == s} >= {"adamw"}
    _finish(tmp_path, todo)
    assert len(rounds) < 10
  # round 1: wide (needs far more than 6) gets seeds 2..5 at once, mid its planned 4 seeds;
  # tight (already settled with two seeds) gets none, ever
  assert rounds[0] == sorted([("adamw", s, 3) for s in (2, 3, 4, 5)]
                             + [("wide", s, 3) for s in (2, 3, 4, 5)]
                             + [("mid", s, 3) for s in (2, 3)])
  assert len(rounds) == 1
  assert _seeds(tmp_path, "wide") == _seeds(tmp_path, "adamw") == [0, 1, 2, 3, 4, 5]
  assert _seeds(tmp_path, "mid") == [0, 1, 2, 3] and _seeds(tmp_path, "tight") == [0, 1]
  # the report: every cell is planned; the seed-plan columns match SciPy's paired t-test
  report.write_report(st, tmp_path, plots=False)
  summary = (tmp_path / "summary.md").read_text()
  assert "planned cells finished" in summary and "outside the current plan" not in summary
  rows = {ln.split("|")[1].strip(): [x.strip() for x in ln.strip("|").split("|")]
          for ln in summary.split("## Contrasts")[1].splitlines() if " - adamw |" in ln}
  for arm, settled in (("wide", False), ("mid", True), ("tight", True)):
    seeds = _seeds(tmp_path, arm)
    a = [_loss(arm, s) for s in seeds]
    b = [_loss("adamw", s) for s in seeds]
    ci = stats.ttest_rel(a, b).confidence_interval(0.95)
    half = (ci.high - ci.low) / 2
    sd = float(np.std(np.subtract(a, b), ddof=1))
    row = rows[f"{arm} - adamw"]
    assert float(row[-3]) == pytest.approx(sd, abs=6e-5)
    assert float(row[-2]) == pytest.approx(half, abs=6e-5)
    assert (half <= 0.05) == settled, (arm, half)


def test_sequential_waits_for_the_search_and_counts_a_diverged_seed(tmp_path):
  st = _study(lambda r: r["contrasts"].pop(1))
  search = st.search_cells()
  _finish(tmp_path, [c for c in search if c.arm != "wide"])
  assert sorted(c.id for c in runner.plan(st, tmp_path)) == sorted(
      c.id for c in search if c.arm == "wide")  # wide's best lr unknown: no sequential seeds
  _finish(tmp_path, [c for c in search if c.arm == "wide" and c.seed == 0])
  bad = next(c for c in search if c.arm == "wide" and c.seed == 1)
  store.append(tmp_path, [{"cell": {"id": bad.id, "arm": "wide", "grid": {}, "lr": bad.lr,
                                    "seed": 1, "stage": 1}, "config": None,
                           "result": {"id": bad.id, "arm": "wide", "lr": bad.lr, "seed": 1,
                                      "stage": 1, "status": "diverged", "val_loss": None,
                                      "test_loss": None}, "summary": {}, "curves": {}}])
  # one finite pair out of two seeds: no sd yet, so one more finite pair is asked for (seed 2)
  assert sorted((c.arm, c.seed) for c in runner.plan(st, tmp_path)) == [
      ("adamw", 2), ("wide", 2)]


def test_without_sequential_the_plan_is_unchanged(tmp_path):
  st = _study(lambda r: r.pop("sequential"))
  _finish(tmp_path, st.search_cells())
  assert runner.plan(st, tmp_path) == []
  report.write_report(st, tmp_path, plots=False)
  assert "seeds for +-0.05" in (tmp_path / "summary.md").read_text()


def test_seed_sequence_follows_the_study_seeds():
  st = _study(lambda r: r.update(seeds=[3, 7]))
  assert st.seed_sequence() == [3, 7, 8, 9, 10, 11]


@pytest.mark.parametrize("edit, key", [
    (lambda r: r.pop("contrasts"), "sequential"),
    (lambda r: r["sequential"].update(contrasts=["wide - mid"]), "sequential.contrasts"),
    (lambda r: r["sequential"].update(max_seeds=1), "sequential.max_seeds"),
    (lambda r: r["sequential"].update(max_seeds=2.5), "sequential.max_seeds"),
    (lambda r: r["sequential"].pop("max_seeds"), "sequential.max_seeds"),
    (lambda r: r["sequential"].update(bogus=1), "sequential.bogus"),
    (lambda r: r.update(target_half_width=0), "target_half_width"),
    (lambda r: r.update(seeds=[0, 1, 2], sequential={"max_seeds": 2}), "sequential.max_seeds"),
])
def test_sequential_config_errors_name_the_key(edit, key):
  with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
    _study(edit)


def test_sequential_config_error_is_one_line_exit_2(tmp_path, capsys):
  rc = cli.main(["study", "--config", str(BC_TINY), "--out", str(tmp_path),
                 "--set", "sequential.max_seeds=4"])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and len(err) == 1 and "sequential" in err[0], err


@pytest.mark.integration  # trains: the runner's loop adds the sequential seeds and stops
def test_sequential_study_runs_tiny_to_the_cap(tmp_path, capsys):
  out = tmp_path / "study"
  sets = ["run.steps=4", "run.eval_every=0", "run.checkpoint_every=0", "run.log_every=2",
          "learning_rates=[1e-2]", "arms.adamw_bc.learning_rates=[1e-2]",
          'contrasts=[["adamw_bc", "adamw", "the correction"]]',
          "target_half_width=1e-6", "sequential.max_seeds=3"]
  args = ["study", "--config", str(BC_TINY), "--out", str(out)]
  for s in sets:
    args += ["--set", s]
  assert cli.main(args) == 0
  assert "6 cell(s) trained now, 0 left" in capsys.readouterr().out
  rows = store.rows(out)
  assert sorted((r["arm"], r["seed"], r["stage"]) for r in rows) == sorted(
      [(a, s, 1) for a in ("adamw", "adamw_bc") for s in (0, 1)]
      + [(a, 2, 3) for a in ("adamw", "adamw_bc")])
  summary = (out / "summary.md").read_text()
  assert "6 of 6 planned cells finished" in summary and "up to 3 per arm" in summary
