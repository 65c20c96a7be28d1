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


def test_meter_resume_counts_the_earlier_pieces(monkeypatch):
  """A resumed run's tokens/s and wall time are over both pieces: piece 1 times steps 1-20
  (compile at step 1, rows every 10 steps), piece 2 resumes from the row at step 20 and times
  steps 21-30; the result is the closed form over both pieces' timed intervals."""
  clock = [100.0]
  monkeypatch.setattr(M.time, "time", lambda: clock[0])
  rows, m1 = [], M.Meter(100)
  clock[0] += 5.0   # piece 1: setup and compile until step 1
  m1.first_step_done(1)
  for step, dt in ((10, 0.9), (20, 2.0)):  # 9 steps in 0.9 s, 10 in 2.0 s
    clock[0] += dt
    tps = m1.interval(step)
    rows.append(M.step_row(step, {"skipped": 0, "consec": 0}, step * 100, tps, m1))
  clock[0] += 50.0  # the time between the pieces is not the run's
  m2 = M.Meter(100)
  m2.resume(rows)
  clock[0] += 7.0   # piece 2: setup and compile until step 21
  m2.first_step_done(21)
  clock[0] += 3.0   # steps 22-30
  m2.interval(30)
  assert m2.timed_steps == 9 + 10 + 9
  assert abs(m2.overall() - 2800 / (0.9 + 2.0 + 3.0)) < 1e-9
  assert abs(m2.wall() - (5.0 + 2.9 + 7.0 + 3.0)) < 1e-9


def test_meter_resume_from_rows_without_cumulative_timing():
  """Rows of older runs (no timed_steps / train_s): each row's interval since the previous
  row at its tokens/s (a first row has none)."""
  rows = [{"step": 1, "tokens_per_s": None}, {"step": 10, "tokens_per_s": 1000.0},
          {"step": 20, "tokens_per_s": 500.0}]
  m = M.Meter(100)
  m.resume(rows)
  assert m.timed_steps == 19
  assert abs(m.overall() - 1900 / (0.9 + 2.0)) < 1e-9
