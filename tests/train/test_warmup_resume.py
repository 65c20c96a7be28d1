"""A warm-up shortened to fit a short run is derived, not recorded: config.yaml keeps what the
user wrote, so the run can be extended by --resume with a larger run.steps."""

import json

import pytest
import yaml

from scaleopt.train import config as C
from scaleopt.train.main import train_main

from train_helpers import tiny_raw


def _recorded(cfg, tmp_path) -> dict:
  C.dump_config(cfg, tmp_path / "config.yaml")
  return yaml.safe_load((tmp_path / "config.yaml").read_text())


def test_a_fitted_warmup_is_used_but_not_recorded(tmp_path, capsys):
  """The run trains with the warm-up shortened to its length; config.yaml keeps what the user
  wrote, and loading config.yaml again gives the same schedule."""
  raw = tiny_raw(run={"steps": 10}, optimizer={"schedule": {"kind": "cosine",
                                                             "warmup_steps": 30}})
  cfg = C.from_dict(raw)
  assert "warming up over 10 steps" in capsys.readouterr().err
  assert cfg.optimizer.schedule.warmup_steps == 10  # what the optimizer is built with
  rec = _recorded(cfg, tmp_path)
  assert rec["optimizer"]["schedule"]["warmup_steps"] == 30
  again = C.from_dict(rec)
  assert again.optimizer.schedule == cfg.optimizer.schedule


def test_extending_a_fitted_run_is_a_resumable_change(tmp_path, capsys):
  raw = tiny_raw(run={"steps": 10}, optimizer={"schedule": {"kind": "cosine",
                                                             "warmup_steps": 30}})
  C.dump_config(C.from_dict(raw), tmp_path / "config.yaml")
  longer = C.from_dict(tiny_raw(run={"steps": 20}, optimizer={
      "schedule": {"kind": "cosine", "warmup_steps": 30}}))
  assert longer.optimizer.schedule.warmup_steps == 20
  changes = C.check_resume(longer, tmp_path)
  assert "optimizer.schedule.warmup_steps" not in changes
  assert changes["run.steps"] == (10, 20)


@pytest.mark.integration
def test_a_short_run_is_extended_by_a_real_resume(tmp_path, capsys):
  """``run.steps=10`` of a config with a 30-step warm-up, then ``--resume`` with
  ``run.steps=20``: the resume trains, and its learning rates are those of the warm-up
  refitted to 20 steps (linear warm-up: lr_t = peak * t / 20 up to step 20)."""
  cfg = tmp_path / "cfg.yaml"
  body = tiny_raw(run={"steps": 10, "log_every": 1, "eval_every": 0, "eval_tokens": 256,
                       "checkpoint_every": 5},
                  optimizer={"learning_rate": 1e-3,
                             "schedule": {"kind": "cosine", "warmup_steps": 30}})
  cfg.write_text(yaml.safe_dump(body))
  run = tmp_path / "run"
  assert train_main(str(cfg), str(run)) == 0
  assert train_main(str(cfg), str(run), ["run.steps=20"], resume=True) == 0, \
      capsys.readouterr().err
  from scaleopt.optim import schedules
  from scaleopt.train import metrics
  rows = metrics.read_metrics(run / "metrics.jsonl")
  assert [r["step"] for r in rows] == list(range(1, 21))
  sched = schedules.make_schedule(
      schedules.ScheduleConfig(kind="cosine", warmup_steps=20, total_steps=20,
                               min_lr_ratio=0.0), 1e-3)
  for r in rows[10:]:
    assert r["lr"] == pytest.approx(float(sched(r["step"] - 1)), rel=1e-6), r["step"]
  rec = yaml.safe_load((run / "config.yaml").read_text())  # as the run started
  assert rec["optimizer"]["schedule"]["warmup_steps"] == 30 and rec["run"]["steps"] == 10
  history = [json.loads(l) for l in (run / C.HISTORY).read_text().splitlines()]
  assert [h["changes"] for h in history] == [{"run.steps": [10, 20],
                                              "optimizer.schedule.total_steps": [10, 20]}]


def test_a_run_recorded_with_its_fitted_warmup_can_be_extended(tmp_path):
  """A config.yaml that holds the fitted warm-up (10 for a 10-step run of a 30-step warm-up),
  not the written one: extending it is not a changed warm-up; a really changed one is."""
  raw = tiny_raw(run={"steps": 10}, optimizer={"schedule": {"kind": "cosine",
                                                             "warmup_steps": 30}})
  rec = C.from_dict(raw).to_dict()
  rec["optimizer"]["schedule"]["warmup_steps"] = 10
  (tmp_path / "config.yaml").write_text(yaml.safe_dump(rec))
  longer = lambda w: C.from_dict(tiny_raw(run={"steps": 20}, optimizer={
      "schedule": {"kind": "cosine", "warmup_steps": w}}))
  assert "optimizer.schedule.warmup_steps" not in C.check_resume(longer(30), tmp_path)
  with pytest.raises(C.ConfigError, match=r"optimizer.schedule.warmup_steps \(10 -> 5\)"):
    C.check_resume(longer(5), tmp_path)
