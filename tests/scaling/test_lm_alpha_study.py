"""The language-model alpha study end to end on CPU: a micro lm_alpha (the shipped adamw arms at
three widths, one layer, a few steps) through `scaleopt study`, the spectral diagnostic from its
kept checkpoints and the report; plus the pooled floor fit on curves with a known floor."""

import csv
import json
import pathlib
import sys

import numpy as np
import pytest
import yaml

from scaleopt import cli
from scaleopt.study import convert

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))
import lm_alpha_diag  # noqa: E402
import lm_alpha_report  # noqa: E402

LM_ALPHA = str(ROOT / "configs" / "studies" / "lm_alpha.yaml")
WIDTHS = (64, 128, 256)
CELLS = [f"adamw+{w}/*" for w in WIDTHS]
MICRO = ["run.steps=6", "run.log_every=3", "run.eval_tokens=128", "data.seq_len=16",
         "data.batch_size=8", "model.n_layers=1", "model.max_seq_len=16", "model.dtype=float32",
         "optimizer.schedule.warmup_steps=2", "seeds=[0,1]", "engine.cells_at_once=6"]


def _csv(path):
  with open(path, newline="") as fh:
    return list(csv.DictReader(fh))


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("lm_alpha")
  study, out = tmp / "study", tmp / "report"
  args = ["study", "--config", LM_ALPHA, "--out", str(study)]
  for kv in MICRO:
    args += ["--set", kv]
  args += ["--cells"] + CELLS
  assert cli.main(args) == 0
  assert lm_alpha_diag.main([str(study), "--arms", "adamw", "--windows", "4",
                             "--seq-len", "16"]) == 0
  assert lm_alpha_report.main([str(study), str(out), "--bootstrap", "200"]) == 0
  return study, out


@pytest.mark.integration
def test_micro_study_report_matches_independent_references(micro):
  study, out = micro
  for f in ("alpha.md", "alpha.csv", "losses.csv", "results.csv", "diag.csv", "lm_alpha.png"):
    assert (out / f).is_file() and (out / f).stat().st_size > 0, f
  cells = [json.loads(p.read_text()) for p in (study / "cells").glob("*/*/result.json")]
  assert len(cells) == len(CELLS) * 3 * 2 and {c["status"] for c in cells} == {"ok"}

  # N: non-embedding parameters of one layer (attention 4 d^2 with n_heads = d / 64, SwiGLU
  # 3 d d_ff, two norm scales) plus the final norm scale; d_ff = 8/3 d rounded to 64.
  d_ff = {64: 192, 128: 320, 256: 704}
  n_expect = {d: 4 * d * d + 3 * d * d_ff[d] + 2 * d + d for d in WIDTHS}
  losses = _csv(out / "losses.csv")
  alpha = {(r["optimizer"], r["fit"]): r for r in _csv(out / "alpha.csv")}
  floor = json.loads((out / "pooled_floor.json").read_text())["floor"]
  for arm in ("adamw",):
    rows = [r for r in losses if r["optimizer"] == arm]
    assert {int(r["d_model"]): int(r["N"]) for r in rows} == n_expect
    for d in WIDTHS:
      # the lr with the smallest seed-mean val loss, from the cells' own result.json
      at = [c for c in cells if c["arm"] == f"{arm}+{d}"]
      lrs = sorted({c["lr"] for c in at})
      best = lrs[int(np.argmin([np.mean([c["val_loss"] for c in at if c["lr"] == lr])
                                for lr in lrs]))]
      chosen = {float(r["lr"]) for r in rows if int(r["d_model"]) == d}
      assert len(chosen) == 1 and chosen.pop() == pytest.approx(best)
      test = sorted(c["test_loss"] for c in at if c["lr"] == best)
      assert sorted(float(r["test_loss"]) for r in rows if int(r["d_model"]) == d) == \
          pytest.approx(test, rel=1e-5)
    # alpha: minus the OLS slope of log seed-mean loss on log N (numpy's polyfit)
    n = np.array(sorted(n_expect.values()), float)
    mean = np.array([np.mean([float(r["test_loss"]) for r in rows if int(r["N"]) == v])
                     for v in n])
    for fit, fl in (("raw", 0.0), ("floor", floor)):
      a = alpha[(arm, fit)]
      assert float(a["alpha"]) == pytest.approx(-np.polyfit(np.log(n), np.log(mean - fl), 1)[0],
                                                rel=1e-4, abs=1e-6)
      assert float(a["ci_low"]) <= float(a["alpha"]) <= float(a["ci_high"])
      assert a["interval_method"] == "cluster_t" and int(a["seeds"]) == 2
  assert 0.0 <= floor < min(float(r["test_loss"]) for r in losses)

  diag = _csv(out / "diag.csv")
  assert [r["name"] for r in diag if r["kind"] == "corpus"] == ["unigram", "bigram"]
  acts = [r for r in diag if r["kind"] == "activations"]
  assert sorted(int(r["d_model"]) for r in acts) == list(WIDTHS)
  assert {r["status"] for r in acts} == {"ok"} and {r["name"] for r in acts} == {"adamw"}
  for r in acts:  # the checkpoint of the chosen lr, seed 0
    assert float(r["lr"]) == pytest.approx(float(next(
        x["lr"] for x in losses if x["optimizer"] == "adamw" and x["d_model"] == r["d_model"])))
    assert 2 < int(r["rank"]) <= int(r["d_model"]) and np.isfinite(float(r["s_hat"]))
  md = (out / "alpha.md").read_text()
  assert "| adamw | raw |" in md and "| adamw | floor |" in md and "corpus bigram" in md
  # the shipped grid (every arm's lrs x the 2 micro seeds), cut to this micro run by --cells
  shipped = yaml.safe_load(pathlib.Path(LM_ALPHA).read_text())["arms"]
  assert f"of {2 * sum(len(a['learning_rates']) for a in shipped.values())} planned" in md


def test_pooled_floor_recovers_a_known_floor():
  n = np.geomspace(2e5, 3e7, 6)
  truth = {"a": (0.3, 40.0), "b": (0.45, 300.0)}  # alpha, c
  curves = {k: (n, 0.8 + c * n ** -al) for k, (al, c) in truth.items()}
  got = lm_alpha_report.pooled_floor(curves, upper=0.999 * min(v[1].min() for v in
                                                               curves.values()))
  assert got["floor"] == pytest.approx(0.8, rel=1e-3) and not got["at_bound"]
  for k, (al, c) in truth.items():
    assert got["alpha"][k] == pytest.approx(al, rel=1e-3)
    assert np.exp(got["log_c"][k]) == pytest.approx(c, rel=1e-2)


def test_report_errors_are_one_line(tmp_path, capsys):
  assert lm_alpha_report.main([str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "no cells/ folder" in err
  assert lm_alpha_report.main([str(tmp_path), str(tmp_path / "out"), "--window", "1"]) == 2
  assert lm_alpha_diag.main([str(tmp_path / "nothing")]) == 2


def _fake_study(root, truth, floor, widths, rng):
  """A study folder of result.json + cell.json files with L = floor + c N^-alpha (x noise)
  at the better of two lrs; N from the closed form of a 4-layer model."""
  n_of = {}
  for arm, (alpha, c) in truth.items():
    for d in widths[arm]:
      h, d_ff = max(1, d // 64), {64: 192, 128: 320, 256: 704, 512: 1344, 768: 2048}[d]
      n_of[d] = 4 * (4 * d * d + 3 * d * d_ff + 2 * d) + d
      for lr, worse in ((1e-3, 1.0), (2e-3, 1.2)):
        for seed in range(3):
          loss = (floor + c * n_of[d] ** -alpha) * worse * np.exp(0.002 * rng.standard_normal())
          cell = root / "cells" / f"{arm}+{d}" / f"lr={lr:g},seed={seed}"
          cell.mkdir(parents=True)
          (cell / "result.json").write_text(json.dumps(
              {"id": f"{arm}+{d}/lr={lr:g},seed={seed}", "arm": f"{arm}+{d}", "lr": lr,
               "seed": seed, "stage": 1, "status": "ok", "val_loss": loss * 1.01,
               "test_loss": loss, "tokens": 1000, "card": "fake"}))
          model = {"preset": "tiny", "n_layers": 4, "d_model": d, "n_heads": h,
                   "n_kv_heads": h, "d_ff": d_ff}
          (cell / "cell.json").write_text(json.dumps(  # as the runner writes it
              {"id": f"{arm}+{d}/lr={lr:g},seed={seed}", "config": {
                  f"model.{k}": v for k, v in model.items()}}))
  return n_of


def test_report_on_a_known_power_law_with_a_floor(tmp_path):
  truth = {"adamw": (0.35, 60.0), "muon": (0.5, 900.0)}
  widths = {"adamw": (64, 128, 256, 512, 768), "muon": (64, 128, 256, 512, 768),
            "shampoo": (64,)}
  n_of = _fake_study(tmp_path / "s", {**truth, "shampoo": (0.3, 30.0)}, 0.9, widths,
                     np.random.default_rng(0))
  assert convert.main([str(tmp_path / "s"), "--remove"]) == 0  # read from cells.jsonl
  assert not (tmp_path / "s" / "cells").exists()
  res = lm_alpha_report.report(tmp_path / "s", tmp_path / "out", bootstrap=300)
  assert {int(r["d_model"]): int(r["N"]) for r in _csv(tmp_path / "out" / "losses.csv")} == n_of
  assert res["pool"]["floor"] == pytest.approx(0.9, abs=0.03)
  fits = {(f["optimizer"], f["fit"]): f for f in res["fits"]}
  for arm, (alpha, _) in truth.items():
    assert fits[(arm, "floor")]["ci_low"] <= alpha <= fits[(arm, "floor")]["ci_high"]
    assert fits[(arm, "raw")]["alpha"] < 0.5 * alpha  # the floor flattens the raw curve
    assert fits[(arm, "raw")]["lr"] == "0.001 0.001 0.001 0.001 0.001"
    assert fits[(arm, "raw")]["lr_at_grid_edge"] == "64 128 256 512 768"
  md = (tmp_path / "out" / "alpha.md").read_text()
  assert "shampoo (1 width(s) finished; a fit needs >= 3)" in md and "No diag.csv" in md
