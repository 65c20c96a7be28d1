"""The JSON outputs (writers: test_metrics_writers.py)."""

import json

from scaleopt.train import metrics as M


def test_metrics_log_truncates_on_resume(tmp_path):
  log = M.MetricsLog(tmp_path, tensorboard=False)
  for s in range(1, 6):
    log.write({"step": s, "loss": float(s), "bad": float("inf")})
  log.close()
  rows = M.read_metrics(tmp_path / "metrics.jsonl")
  assert rows[0]["bad"] is None  # non-finite -> null, the file stays valid JSON
  log = M.MetricsLog(tmp_path, resume_step=3, tensorboard=False)
  log.write({"step": 4, "loss": 40.0})
  log.close()
  assert [r["loss"] for r in M.read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 40]
  M.write_summary(tmp_path, {"x": float("nan"), "y": 1})
  assert json.loads((tmp_path / "summary.json").read_text()) == {"x": None, "y": 1}
