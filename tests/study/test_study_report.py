"""The report on synthetic finished cells: lr chosen on val (not test), paired differences,
the equal-gradient-pass comparison and the stage-2 plan."""

import csv
import json
import math

import numpy as np
import pytest
from scipy import stats as sps

from scaleopt.study import config as SC
from scaleopt.study import report, runner

from test_study_config import BC_TINY, _raw


def _study():
  raw = _raw()
  raw["arms"]["adamw_2x"] = {"optimizer.name": "adamw", "run.steps": 60}
  raw["compute_baselines"] = ["adamw_2x"]
  raw["arms"]["adamw_bc"]["baseline"] = "adamw_2x"  # its own baseline, beside the study's
  raw["seeds"] = [0, 1]
  raw["best_lr_seeds"] = [0, 1, 2]
  return SC.from_dict(raw, BC_TINY)


def _write(out, st, cell, val, test, passes):
  d = runner.cell_dir(out, cell)
  d.mkdir(parents=True)
  runner.write_result(d, {"id": cell.id, "arm": cell.arm, **dict(cell.grid), "lr": cell.lr,
                          "seed": cell.seed,
                          "stage": cell.stage, "status": "ok", "steps": 30, "tokens": 1,
                          "gradient_passes": passes, "val_loss": val, "test_loss": test,
                          "train_loss": 1.0, "wall_time_s": 1.0, "tokens_per_s": 1.0,
                          "cells_at_once": 1, "engine": "vmap", "card": "cpu"})


def test_selection_on_val_paired_differences_and_stage_two(tmp_path):
  st = _study()
  passes = {"adamw": 240.0, "adamw_bc": 480.0, "adamw_2x": 480.0}
  rng = np.random.default_rng(0)
  seed_eff = {s: rng.normal(0, 0.3) for s in range(3)}
  # val prefers lr 1e-2 for every arm, test would prefer 3e-3: the report must pick 1e-2.
  level = {"adamw": 3.0, "adamw_bc": 2.9, "adamw_2x": 2.8}
  truth = {}
  for c in st.search_cells():
    good = c.lr == 1e-2
    val = level[c.arm] + seed_eff[c.seed] + (0.0 if good else 0.5)
    test = level[c.arm] + seed_eff[c.seed] + (0.0 if good else -0.5) + rng.normal(0, 0.01)
    truth[(c.arm, c.lr, c.seed)] = test
    _write(tmp_path, st, c, val, test, passes[c.arm])
  todo = runner.plan(st, tmp_path)  # the search is complete: seed 2 at each best lr is next
  assert sorted((c.arm, c.lr, c.seed, c.stage) for c in todo) == sorted(
      (a, 1e-2, 2, 2) for a in st.arms)
  for c in todo:
    test = level[c.arm] + seed_eff[c.seed] + rng.normal(0, 0.01)
    truth[(c.arm, c.lr, c.seed)] = test
    _write(tmp_path, st, c, level[c.arm] + seed_eff[c.seed], test, passes[c.arm])
  assert runner.plan(st, tmp_path) == []

  conds = report.write_report(st, tmp_path)
  assert {c.arm: c.best_lr for c in conds} == {a: 1e-2 for a in st.arms}
  # independent reference: numpy/scipy on the per-seed differences at lr 1e-2
  d = np.array([truth[("adamw_bc", 1e-2, s)] - truth[("adamw", 1e-2, s)] for s in range(3)])
  half = sps.t.ppf(0.975, 2) * d.std(ddof=1) / math.sqrt(3)
  summary = (tmp_path / "summary.md").read_text()
  row = next(l for l in summary.splitlines() if l.startswith("| adamw_bc |"))
  assert f"{d.mean():+.4f} [{d.mean() - half:+.4f}, {d.mean() + half:+.4f}]" in row
  assert "lower" in row.split("|")[7]  # -0.1 nats with a tiny spread: beyond the interval
  e = np.array([truth[("adamw_bc", 1e-2, s)] - truth[("adamw_2x", 1e-2, s)] for s in range(3)])
  assert f"vs adamw_2x: {e.mean():+.4f}" in row and "higher" in row.split("|")[-2]
  assert "| 2x |" in row
  own = next(l for l in summary.splitlines() if l.startswith("| adamw_bc | adamw_2x |"))
  half_e = sps.t.ppf(0.975, 2) * e.std(ddof=1) / math.sqrt(3)
  assert f"{e.mean():+.4f} [{e.mean() - half_e:+.4f}, {e.mean() + half_e:+.4f}] | higher" in own
  assert "(grid edge)" not in summary  # two lrs per arm: no edge to speak of
  with (tmp_path / "results.csv").open() as fh:
    rows = list(csv.DictReader(fh))
  assert len(rows) == len(st.search_cells()) + 3
  assert {r["stage"] for r in rows} == {"1", "2"}
  n = len(st.search_cells()) + 3
  assert f"{n} of {n} planned cells finished;" in summary
  # a seed at a learning rate that is no longer the best (the grid changed): counted apart
  stale = next(c for c in st.best_lr_cells("adamw", (), 3e-3) if c.seed == 2)
  _write(tmp_path, st, stale, 9.0, 9.0, passes["adamw"])
  report.write_report(st, tmp_path, plots=False)
  summary = (tmp_path / "summary.md").read_text()
  assert f"{n} of {n} planned cells finished (and 1 cell(s) outside the current plan" in summary


def test_grid_study_recovers_planted_effects(tmp_path):
  """scale_vectors_dense's grid (variant x wd policy) on synthetic cells: -0.04 nats planted
  for `unified`, +0.02 for `none`, a shared seed effect much larger than both."""
  st = SC.load(BC_TINY.parent / "scale_vectors_dense.yaml")
  rng = np.random.default_rng(1)
  seed_eff = rng.normal(0, 0.05, 3)
  effect = {"none": 0.02, "unified": -0.04}
  for _ in range(2):  # the search, then the extra seeds at the best lr
    for c in runner.plan(st, tmp_path):
      v = (3.0 + seed_eff[c.seed] + effect.get(c.arm, 0.0) + rng.normal(0, 0.003)
           + 0.05 * abs(math.log(c.lr / 2e-3)))
      _write(tmp_path, st, c, v, v - 0.1, 9830.0)
  assert runner.plan(st, tmp_path) == []
  conds = report.write_report(st, tmp_path)
  assert len(conds) == 16 and {c.best_lr for c in conds} == {2e-3}
  assert all(len(c.test) == 3 for c in conds)
  rows = {(l.split("|")[1].strip(), l.split("|")[2].strip()): l.split("|")
          for l in (tmp_path / "summary.md").read_text().splitlines()
          if l.startswith("| ") and "| 1x |" in l}  # the results table, not the lr search
  for pol in ("iwd", "matrices-only"):
    assert rows[("unified", f"model.wd_policy={pol}")][8].strip() == "lower"
    assert rows[("none", f"model.wd_policy={pol}")][8].strip() == "higher"


def test_best_lr_at_the_grid_edge_is_flagged(tmp_path):
  raw = _raw()
  raw["learning_rates"] = [1e-3, 3e-3, 1e-2]
  raw["arms"]["adamw_bc"]["learning_rates"] = [1e-3, 3e-3, 1e-2]
  raw["seeds"] = [0, 1]
  st = SC.from_dict(raw, BC_TINY)
  best = {"adamw": 1e-2, "adamw_bc": 3e-3}  # adamw's optimum lies beyond its largest lr
  for c in st.search_cells():
    v = 3.0 + abs(math.log(c.lr / best[c.arm]))
    _write(tmp_path, st, c, v, v, 1.0)
  report.write_report(st, tmp_path, plots=False)
  lines = (tmp_path / "summary.md").read_text().splitlines()
  assert next(l for l in lines if l.startswith("| adamw |")).split("|")[2].strip() == \
      "0.01 (grid edge)"
  assert next(l for l in lines if l.startswith("| adamw_bc |")).split("|")[2].strip() == "0.003"


def test_arm_baseline_must_name_another_arm():
  raw = _raw()
  raw["arms"]["adamw_bc"]["baseline"] = "sgd"
  with pytest.raises(SC.ConfigError, match="arms.adamw_bc.baseline"):
    SC.from_dict(raw, BC_TINY)


def test_contrasts_list_each_seed_and_plot_paired_curves(tmp_path, monkeypatch):
  """The contrast table's per-seed column is a - b of each seed's test loss (planted values),
  and contrasts.png draws the paired difference of the logged curves."""
  raw = _raw()
  raw["seeds"] = [0, 1]
  raw["contrasts"] = [["adamw_bc", "adamw", "the correction"]]
  raw["learning_rates"] = [1e-2]
  raw["arms"]["adamw_bc"].pop("learning_rates", None)
  st = SC.from_dict(raw, BC_TINY)
  planted = {("adamw", 0): 3.10, ("adamw", 1): 3.30, ("adamw_bc", 0): 3.05, ("adamw_bc", 1): 3.32}
  def finish(arm):
    for c in st.search_cells():
      if c.arm == arm:
        _write(tmp_path, st, c, 3.0, planted[(c.arm, c.seed)], 1.0)
        with (runner.cell_dir(tmp_path, c) / "metrics.jsonl").open("w") as fh:
          for step in (10, 20):
            fh.write(json.dumps({"step": step, "loss": planted[(c.arm, c.seed)] + step}) + "\n")

  finish("adamw")
  report.write_report(st, tmp_path, plots=False)  # an arm without a finished cell
  lines = (tmp_path / "summary.md").read_text().splitlines()
  assert next(l for l in lines if l.startswith("| adamw_bc |")).split("|")[2].strip() == \
      "not run yet"
  finish("adamw_bc")
  drawn = []
  real = report.plot_contrasts
  monkeypatch.setattr(report, "plot_contrasts", lambda st_, conds, path: (
      drawn.append((path, conds)), real(st_, conds, path)))
  report.write_report(st, tmp_path)
  row = next(l for l in (tmp_path / "summary.md").read_text().splitlines()
             if l.startswith("| adamw_bc - adamw |"))
  assert row.split("|")[6].strip() == "s0 -0.0500, s1 +0.0200"
  (path, conds), = drawn
  assert path == tmp_path / "contrasts.png" and path.stat().st_size > 0
  by = {c.arm: c.curves for c in conds}  # the curves it drew the paired differences of
  for seed, want in ((0, -0.05), (1, 0.02)):
    for step in (10, 20):
      got = by["adamw_bc"][seed]["loss"][step] - by["adamw"][seed]["loss"][step]
      assert abs(got - want) < 1e-9, (seed, step, got)


def test_contrast_names_a_diverged_seed():
  raw = _raw()
  raw["seeds"] = [0, 1]
  raw["contrasts"] = [["adamw_bc", "adamw", "the correction"]]
  st = SC.from_dict(raw, BC_TINY)
  conds = [report.Condition("adamw", (), 1e-2, {0: 3.0, 1: 3.1}, {}, 1.0, {}),
           report.Condition("adamw_bc", (), 1e-2, {0: 2.9, 1: float("inf")}, {}, 1.0, {})]
  row = next(l for l in report.contrast_lines(st, conds, False) if l.startswith("| adamw_bc"))
  assert row.split("|")[6].strip() == "s0 -0.1000, s1 diverged"
