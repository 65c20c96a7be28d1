"""alpha from a study's results.csv: lr chosen on the validation split, fit on the test split."""

import csv

import numpy as np
import pytest

from scaleopt.scaling import lm_alpha

COLS = ["cell", "arm", "model.d_model", "lr", "seed", "stage", "status", "val_loss", "test_loss"]


def _write(path, alphas, rng):
  rows = []
  for arm, alpha in alphas.items():
    for d in (64, 128, 256, 512, 768):
      for lr, penalty in ((1e-3, 1.0), (3e-3, 1.3)):  # the second lr is worse on both splits
        for seed in range(4):
          base = 5.0 * d ** -alpha * np.exp(0.03 * rng.standard_normal()) * penalty
          rows.append({"arm": arm, "model.d_model": d, "lr": lr, "seed": seed, "stage": 1,
                       "status": "ok", "val_loss": base * 1.01, "test_loss": base,
                       "cell": len(rows)})
    rows.append({"arm": arm, "model.d_model": 64, "lr": 1e-2, "seed": 0, "stage": 1,
                 "status": "diverged", "val_loss": "nan", "test_loss": "nan", "cell": len(rows)})
    rows.append({"arm": arm, "model.d_model": 64, "lr": 1e-4, "seed": 0, "stage": 1,
                 "status": "interrupted", "val_loss": 0.0, "test_loss": 0.0, "cell": len(rows)})
  with path.open("w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=COLS)
    w.writeheader()
    w.writerows(rows)


def test_study_alpha_recovers_exponents_and_chosen_lr(tmp_path):
  truth = {"adamw": 0.25, "muon": 0.4}
  _write(tmp_path / "results.csv", truth, np.random.default_rng(0))
  out = {r["arm"]: r for r in lm_alpha.study_alpha(tmp_path / "results.csv", "model.d_model",
                                                   bootstrap=400)}
  for arm, alpha in truth.items():
    r = out[arm]
    assert r["seeds"] == 4 and r["lr"] == [1e-3] * 5 and r["interval_method"] == "cluster_t"
    assert r["ci_low"] <= alpha <= r["ci_high"]
    assert abs(r["alpha"] - alpha) < 0.03
  # width -> parameters: N = d^2 halves the exponent
  sq = lm_alpha.study_alpha(tmp_path / "results.csv", "model.d_model", n_of=lambda d: d * d,
                            bootstrap=50)
  assert sq[0]["alpha"] == pytest.approx(out["adamw"]["alpha"] / 2, rel=1e-9)


def test_study_alpha_errors_name_the_problem(tmp_path):
  _write(tmp_path / "results.csv", {"adamw": 0.3}, np.random.default_rng(1))
  with pytest.raises(ValueError, match="no column 'model.n_layers'"):
    lm_alpha.study_alpha(tmp_path / "results.csv", "model.n_layers")


def test_size_from_arm_names(tmp_path):
  _write(tmp_path / "results.csv", {"adamw": 0.3}, np.random.default_rng(2))
  rows = list(csv.DictReader((tmp_path / "results.csv").open()))
  for r in rows:
    r["arm"] = f"{r['arm']}+{r.pop('model.d_model')}"
  with (tmp_path / "arms.csv").open("w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=list(rows[0]))
    w.writeheader()
    w.writerows(rows)
  a = lm_alpha.study_alpha(tmp_path / "arms.csv", "width", arm_sep="+", bootstrap=50)
  b = lm_alpha.study_alpha(tmp_path / "results.csv", "model.d_model", bootstrap=50)
  assert [r["arm"] for r in a] == ["adamw"]
  assert a[0]["alpha"] == pytest.approx(b[0]["alpha"], rel=1e-12) and a[0]["n"] == b[0]["n"]
