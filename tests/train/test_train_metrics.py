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


def test_meter_resume_counts_the_earlier_pieces():
  """A resumed run's tokens/s is over every timed interval of the run (each row's steps since
  the previous row at its rate; a first interval has none), its wall time continues."""
  rows = [{"step": 1, "tokens_per_s": None}, {"step": 10, "tokens_per_s": 1000.0},
          {"step": 20, "tokens_per_s": 500.0}, {"step": 25, "tokens_per_s": 250.0,
                                                "wall_s": 7.0}]
  m = M.Meter(100)
  m.resume(rows)
  assert m.timed_steps == 24
  assert abs(m.overall() - 2400 / (0.9 + 2.0 + 2.0)) < 1e-9
  assert 7.0 <= m.wall() < 8.0
