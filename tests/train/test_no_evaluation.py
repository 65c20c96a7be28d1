"""``run.eval_tokens=0``: no evaluation at all, said so, and nothing reads "nan"."""

import json

import yaml

from scaleopt.train import metrics
from scaleopt.train.main import train_main

from train_helpers import tiny_raw


def test_eval_tokens_zero_skips_evaluation_cleanly(tmp_path, capsys):
  cfg = tmp_path / "cfg.yaml"
  cfg.write_text(yaml.safe_dump(tiny_raw(run={"steps": 2, "log_every": 1, "eval_every": 1,
                                              "eval_tokens": 0, "checkpoint_every": 0,
                                              "async_checkpoint": False})))
  run = tmp_path / "run"
  assert train_main(str(cfg), str(run)) == 0
  out = capsys.readouterr().out
  assert "nan" not in out.lower(), out
  assert "no evaluation (run.eval_tokens=0)" in out.splitlines()[-1]
  rows = metrics.read_metrics(run / "metrics.jsonl")
  assert [r["step"] for r in rows] == [1, 2] and not any("eval_loss" in r for r in rows)
  summary = json.loads((run / "summary.json").read_text())
  assert summary["final_eval_loss"] is None and summary["eval_windows"] == 0
  # resuming the finished run: nothing to train, nothing evaluated, said so
  assert train_main(str(cfg), str(run), resume=True) == 0
  out = capsys.readouterr().out
  assert "nan" not in out.lower() and "no evaluation" in out, out
