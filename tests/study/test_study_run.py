"""bc_tiny end to end: interrupted, resumed, skipped when finished, and checked against an
ordinary training run of one of its cells."""

import csv
import os
import pathlib
import resource
import signal
import threading
import time

import pytest

from scaleopt import cli
from scaleopt.study import runner, store

ROOT = pathlib.Path(__file__).resolve().parents[2]
BC_TINY = str(ROOT / "configs" / "studies" / "bc_tiny.yaml")
CELL = "adamw/lr=0.01,seed=0"


def _rows(out):
  with (out / "results.csv").open() as fh:
    return {r["cell"]: r for r in csv.DictReader(fh)}


def _cpu_s():
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def _logged(folder: pathlib.Path) -> bool:
  return any(p.stat().st_size > 0 for p in folder.glob("cells/*/*/metrics.jsonl"))


@pytest.mark.integration
def test_bc_tiny_study(tmp_path, capsys, monkeypatch):
  out = tmp_path / "study"
  c0 = _cpu_s()

  class StopAfterFirstLog(runner._Stop):  # a deadline that falls inside the first unit
    def __call__(self):
      self.expired = self.expired or _logged(out)
      return super().__call__()

  monkeypatch.setattr(runner, "_Stop", StopAfterFirstLog)
  assert cli.main(["study", "--config", BC_TINY, "--out", str(out), "--max-minutes", "60"]) == 0
  monkeypatch.undo()
  assert "0 cell(s) trained now, 8 left" in capsys.readouterr().out
  ck = sorted((out / "cells").glob("*/*/checkpoints/*"))
  assert ck and not list((out / "cells").glob("*/*/result.json"))

  # The rerun resumes those cells from their checkpoints and finishes the study.
  assert cli.main(["study", "--config", BC_TINY, "--out", str(out)]) == 0
  assert "8 cell(s) trained now, 0 left" in capsys.readouterr().out
  # under two minutes of this process's CPU time (wall time depends on the machine's load)
  assert _cpu_s() - c0 < 120
  rows = _rows(out)
  assert len(rows) == 8
  # a finished cell's folder (checkpoints included) is folded into cells.jsonl and deleted
  assert not (out / "cells").exists()
  assert sorted(r["cell"]["id"] for r in store.read(out)) == sorted(rows)
  for r in rows.values():
    assert r["status"] == "ok" and int(r["steps"]) == 30 and r["card"]
    assert float(r["val_loss"]) < 5.0 and float(r["test_loss"]) < 5.0  # below ln 256 = 5.55
    # one sweep per step for both arms (LOO folds the stored microbatch gradients)
    assert float(r["gradient_passes"]) == 30 * 8 and int(r["tokens"]) == 30 * 8 * 32
    for k in ("lr", "seed", "train_loss", "wall_time_s", "tokens_per_s"):
      assert r[k] != ""
  summary = (out / "summary.md").read_text()
  for s in ("| adamw |", "| adamw_bc |", "Student-t", "diff vs adamw", "| 1x |",
            "Learning-rate search"):
    assert s in summary, s
  for png in ("curves.png", "lr.png"):
    assert (out / png).stat().st_size > 5000

  # Finished cells are skipped; the report is rebuilt from cells.jsonl.
  (out / "results.csv").unlink()
  assert cli.main(["study", "--config", BC_TINY, "--out", str(out)]) == 0
  assert "0 cell(s) trained now, 0 left" in capsys.readouterr().out
  assert _rows(out) == rows

  # One cell again as an ordinary training run (loop engine), stopped by SIGTERM (preemption)
  # after its first logged step (the loop checkpoints; the study exits 143) and resumed: the
  # vmapped, interrupted-and-resumed cell matches it.
  ref = tmp_path / "ref"
  args = ["study", "--config", BC_TINY, "--out", str(ref), "--set", "engine.kind=loop",
          "--cells", CELL]

  def preempt():
    while not _logged(ref):
      time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)

  threading.Thread(target=preempt, daemon=True).start()
  assert cli.main(args) == 143
  assert "0 cell(s) trained now, 1 left (stopped: SIGTERM/SIGINT" in capsys.readouterr().out
  assert list((ref / "cells" / CELL / "checkpoints").iterdir())
  assert cli.main(args) == 0
  want = _rows(ref)[CELL]
  assert want["engine"] == "loop" and rows[CELL]["engine"] == "vmap"
  for k in ("val_loss", "test_loss", "train_loss"):
    assert float(rows[CELL][k]) == pytest.approx(float(want[k]), rel=1e-4), k
  (rec,) = store.read(ref)
  assert rec["summary"]["resumed_from"] >= 1 and not (ref / "cells").exists()


def test_deadline_signals_only_the_training_loops_handler():
  """At the deadline the watcher sends SIGTERM only while another handler (the training
  loop's) is installed; between cells the flag alone stops the study."""
  st = runner._Stop(0.0005)  # 30 ms
  with st:
    time.sleep(1.5)
    assert st() and st.signal is None and st.reason() == "deadline"  # no signal was needed
  got = []
  st = runner._Stop(0.0005)
  with st:
    old = signal.signal(signal.SIGTERM, lambda *a: got.append(a[0]))  # as faults.Signals does
    try:
      deadline = time.time() + 5
      while not got and time.time() < deadline:
        time.sleep(0.05)
    finally:
      signal.signal(signal.SIGTERM, old)
  assert got == [signal.SIGTERM] and st.reason() == "deadline"


@pytest.mark.integration
def test_units_that_run_out_of_memory_are_split(tmp_path, monkeypatch, capsys):
  from scaleopt.study import engines
  real, sizes = engines.run_vmapped, []

  def small_device(cfgs, *a, **k):  # a device where only 2 cells fit at once
    sizes.append(len(cfgs))
    if len(cfgs) > 2:
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 9 GiB")
    return real(cfgs, *a, **k)

  monkeypatch.setattr(engines, "run_vmapped", small_device)
  out = tmp_path / "study"
  args = ["study", "--config", BC_TINY, "--out", str(out), "--cells", "adamw/*",
          "--set", "run.steps=3", "--set", "run.eval_every=3",
          "--set", "optimizer.schedule.warmup_steps=1", "--set", "engine.cells_at_once=4",
          "--set", "learning_rates=[0.01]"]
  assert cli.main(args + ["--set", "seeds=[0, 1, 2, 3]"]) == 0
  assert "4 cells at once do not fit in device memory; running 2 and 2" in capsys.readouterr().out
  rows = _rows(out)
  assert len(rows) == 4 and all(r["status"] == "ok" and r["cells_at_once"] == "2"
                                for r in rows.values())
  assert sizes == [4, 2, 2]
  # the group's limit is kept: four more seeds later form units of 2 without another failure
  assert cli.main(args + ["--set", "seeds=[0, 1, 2, 3, 4, 5, 6, 7]"]) == 0
  assert sizes == [4, 2, 2, 2, 2] and len(_rows(out)) == 8

  def broken(cfgs, *a, **k):  # any other error is not swallowed
    raise RuntimeError("INTERNAL: something else")

  monkeypatch.setattr(engines, "run_vmapped", broken)
  with pytest.raises(RuntimeError, match="INTERNAL"):
    cli.main(args[:3] + ["--out", str(tmp_path / "other")] + args[5:])


@pytest.mark.slow  # two worker processes compiling their own cells: half a minute on CPU
def test_study_workers_script_shares_one_folder(tmp_path):
  """scripts/study_workers.sh: two workers (as on two GPUs), started by two launches that join
  through SCALEOPT_CLAIM_TOKEN / SCALEOPT_DEADLINE, finish every cell of the study once between
  them, each holding whole conditions."""
  import subprocess
  import sys
  import time
  env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu",
             SCALEOPT_CLAIM_TOKEN="joint", SCALEOPT_DEADLINE=str(int(time.time()) + 300))
  spec = ("studies/bc_tiny@run.steps=3@run.eval_every=3@optimizer.schedule.warmup_steps=1"
          "@seeds=[0]")
  procs = [subprocess.Popen(["bash", str(ROOT / "scripts" / "study_workers.sh"), "3",
                             str(tmp_path), spec], env=dict(env, SCALEOPT_GPUS=g), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for g in ("0", "1")]
  for p in procs:
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
  out = tmp_path / "bc_tiny"
  done = [r["cell"]["id"] for r in store.read(out)]
  assert len(done) == 4  # no cell recorded twice
  assert sorted(done) == ["adamw/lr=0.003,seed=0", "adamw/lr=0.01,seed=0",
                  "adamw_bc/lr=0.003,seed=0", "adamw_bc/lr=0.01,seed=0"]
  (token,) = (out / "claims").iterdir()  # one shared token
  assert token.name == "joint"
  assert sorted(p.name for p in token.iterdir()) == ["0", "1"]  # each condition claimed once
  logs = [(tmp_path / f"worker{i}.log").read_text() for i in (0, 1)]
  assert all("cell(s) trained now" in log for log in logs)
  assert sum(log.count("[study bc_tiny]") for log in logs) == 2  # one unit per condition
  assert cli.main(["study", "--config", BC_TINY, "--out", str(out), "--report-only",
                   "--set", "run.steps=3", "--set", "run.eval_every=3",
                   "--set", "optimizer.schedule.warmup_steps=1", "--set", "seeds=[0]"]) == 0
  assert len(_rows(out)) == 4
