"""Two local CPU processes started as docs/training.md says (JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID), 2 simulated devices each, parameters and batch sharded
over all 4 devices: the run equals a single-process run of the same global batch, each process
reads only its rows, a SIGTERM to one process stops both at the same step with a checkpoint,
and ``--resume`` continues exactly."""

import collections
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

from scaleopt.train import config as C
from scaleopt.train import data as D
from scaleopt.train import loop, metrics
from scaleopt.train.config import ConfigError
from scaleopt.train.main import train_main
from scaleopt.train.mesh import distributed_args, maybe_initialize_distributed

from train_helpers import tiny_raw

ROOT = pathlib.Path(__file__).resolve().parents[2]
LONG = 100_000  # run.steps of the run that gets preempted: it never gets there

# The CLI, with every training-window read recorded (which rows this process loaded).
CHILD = r"""
import atexit, json, os, sys
from scaleopt.train import data
reads = []
_get = data.Windows.get
def get(self, idx):
  reads.append([int(self.n), [int(i) for i in idx]])
  return _get(self, idx)
data.Windows.get = get
atexit.register(lambda: open(os.environ["ROWS_OUT"], "w").write(json.dumps(reads)))
from scaleopt.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _raw(steps):
  # A fixed schedule length, so the preempted run, its resumed continuation and the reference
  # follow the same learning rates whatever run.steps says.
  return tiny_raw(run={"steps": steps, "log_every": 1, "eval_every": 0, "checkpoint_every": 5,
                       "tensorboard": False},
                  optimizer={"schedule": {"kind": "cosine", "warmup_steps": 5,
                                          "min_lr_ratio": 0.1, "total_steps": LONG}},
                  mesh={"data": 1, "fsdp": 4})


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _launch(tmp, cfg, run, extra, tag):
  """Starts process 0 and 1 of one run; returns the Popen objects."""
  port = _free_port()
  procs = []
  for i in range(2):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID=str(i), ROWS_OUT=str(tmp / f"rows_{tag}_{i}.json"))
    env.pop("JAX_LOCAL_DEVICE_IDS", None)
    cmd = [sys.executable, "-c", CHILD, "train", "--config", str(cfg), "--out", str(run), *extra]
    with open(tmp / f"out_{tag}_{i}.txt", "w") as out, open(tmp / f"err_{tag}_{i}.txt",
                                                            "w") as err:
      procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err))
  return procs


def _finish(procs, timeout=300):
  """Exit codes; kills both processes if either hangs (a lone process waits at a barrier)."""
  try:
    return [p.wait(timeout=timeout) for p in procs]
  except subprocess.TimeoutExpired:
    raise AssertionError(f"the processes did not exit within {timeout} s (exit codes "
                         f"{[p.poll() for p in procs]})") from None
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()


def _wait_for_step(procs, run, step, timeout=300):
  """Waits until process 0 has logged ``step`` (every process is then in the step loop)."""
  m = run / "metrics.jsonl"
  deadline = time.time() + timeout
  while time.time() < deadline and all(p.poll() is None for p in procs):
    rows = m.read_text().splitlines() if m.exists() else []
    try:
      if rows and json.loads(rows[-1])["step"] >= step:
        return
    except ValueError:  # a line being written
      pass
    time.sleep(0.05)
  raise AssertionError(f"the run did not reach step {step}: exit codes "
                       f"{[p.poll() for p in procs]}")


def _train_reads(path, n_train):
  return [i for n, idx in json.loads(path.read_text()) if n == n_train for i in idx]


def _errs(tmp, tag):
  return [(tmp / f"err_{tag}_{i}.txt").read_text() for i in range(2)]


def _preempt(tmp, cfg, run, tag, target, sig, extra=()):
  """Starts both processes, sends ``sig`` to process ``target`` alone once step 3 is logged;
  checks that both stopped after the same step with a checkpoint; returns that step."""
  procs = _launch(tmp, cfg, run, list(extra), tag)
  try:
    _wait_for_step(procs, run, 3)
    procs[target].send_signal(sig)
  finally:
    codes = _finish(procs)
  errs = _errs(tmp, tag)
  assert codes == [143, 143], (codes, errs[0][-2000:], errs[1][-2000:])
  summ = json.loads((run / "summary.json").read_text())
  stop = summ["steps"]
  assert summ["interrupted_by"] == sig.name and 3 <= stop < LONG
  assert summ["devices"] == 4
  for e in errs:
    assert f"every process stops after step {stop} and" in e
  manifest = run / "checkpoints" / str(stop) / "manifest.json"
  assert json.loads(manifest.read_text())["step"] == stop
  return stop


def _resume(tmp, cfg, run, tag, steps):
  procs = _launch(tmp, cfg, run, ["--resume", "--set", f"run.steps={steps}"], tag)
  codes = _finish(procs)
  errs = _errs(tmp, tag)
  assert codes == [0, 0], (codes, errs[0][-2000:], errs[1][-2000:])
  return errs


def _single_process(tmp, monkeypatch, steps, n_train):
  """The reference: same config and global batches, one device, in this process; returns its
  metrics and the training windows it read."""
  reads = []
  get = D.Windows.get

  def record(self, idx):
    if self.n == n_train:
      reads.extend(int(i) for i in idx)
    return get(self, idx)

  monkeypatch.setattr(D.Windows, "get", record)
  loop.train(C.from_dict(dict(_raw(steps), mesh={"data": -1})), tmp / "single")
  return metrics.read_metrics(tmp / "single" / "metrics.jsonl"), reads


def _assert_same_run(multi, single, steps):
  assert [r["step"] for r in multi] == [r["step"] for r in single] == list(range(1, steps + 1))
  # Float32 sums over 4 shards and over one device differ in rounding order only; the
  # tolerance of the simulated-device test (a different batch or a skipped step is off by
  # more than 1e-2).
  for k in ("loss", "grad_norm", "update_norm"):
    np.testing.assert_allclose([r[k] for r in multi], [r[k] for r in single], rtol=2e-4,
                               err_msg=k)
  np.testing.assert_allclose(multi[-1]["eval_loss"], single[-1]["eval_loss"], rtol=2e-4)


def _setup(tmp):
  cfg = tmp / "cfg.yaml"
  cfg.write_text(yaml.safe_dump(_raw(LONG)))
  n_train = D.open_split("embedded", None, "train", _raw(1)["data"]["seq_len"])[0].n
  return cfg, tmp / "run", n_train


@pytest.mark.integration
def test_two_processes_match_one_preempt_together_and_resume(tmp_path, monkeypatch):
  cfg, run, n_train = _setup(tmp_path)
  # SIGTERM (preemption) to process 1 only: both stop after the same step and checkpoint.
  stop = _preempt(tmp_path, cfg, run, "a", 1, signal.SIGTERM)
  # Both resume from it and train 3 more steps: together exactly one single-process run.
  for e in _resume(tmp_path, cfg, run, "b", stop + 3):
    assert f"resumed from {run / 'checkpoints'}/{stop}" in e
  single, ref_reads = _single_process(tmp_path, monkeypatch, stop + 3, n_train)
  _assert_same_run(metrics.read_metrics(run / "metrics.jsonl"), single, stop + 3)
  # Each process read only its rows: half of every batch each, together the reference's.
  # The preempted run had made up to 3 batches ahead (``prefetch.Prefetch``: 2 queued, 1 in
  # hand) that it did not train on; the resumed run reads them again from the checkpoint's
  # position and, ending at run.steps, makes none ahead.
  per = []
  for i in range(2):
    first = _train_reads(tmp_path / f"rows_a_{i}.json", n_train)
    assert 0 <= len(first) - stop * 8 <= 3 * 8, (len(first), stop)
    per.append(first[:stop * 8] + _train_reads(tmp_path / f"rows_b_{i}.json", n_train))
  assert len(per[0]) == len(per[1]) == len(ref_reads) // 2 == (stop + 3) * 8
  assert not set(per[0]) & set(per[1])
  assert collections.Counter(per[0] + per[1]) == collections.Counter(ref_reads)


@pytest.mark.slow
def test_two_processes_ctrl_c_on_one_then_sigkill_both_then_resume(tmp_path, monkeypatch):
  cfg, run, n_train = _setup(tmp_path)
  # SIGINT to process 0 is forwarded to JAX's preemption notice: the same agreed stop.
  stop = _preempt(tmp_path, cfg, run, "a", 0, signal.SIGINT)
  # Resume, then SIGKILL both after the next periodic checkpoint; resume again to the end.
  end = stop + 14
  procs = _launch(tmp_path, cfg, run, ["--resume", "--set", f"run.steps={end}",
                                       "--set", "run.async_checkpoint=false"], "b")
  try:
    _wait_for_step(procs, run, (stop // 5 + 1) * 5 + 2)
    for p in procs:
      p.kill()
  finally:
    codes = _finish(procs)
  assert codes == [-signal.SIGKILL] * 2
  kept = max(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
  assert stop < kept < end
  for e in _resume(tmp_path, cfg, run, "c", end):
    assert f"resumed from {run / 'checkpoints'}/{kept}" in e
  single, _ = _single_process(tmp_path, monkeypatch, end, n_train)
  _assert_same_run(metrics.read_metrics(run / "metrics.jsonl"), single, end)


@pytest.mark.parametrize("env,msg", [
    ({"JAX_COORDINATOR_ADDRESS": "localhost:1234"},  # and no cluster manager
     "cannot start the multi-process run from JAX_COORDINATOR_ADDRESS alone"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}, "JAX_COORDINATOR_ADDRESS not set"),
    ({"JAX_COORDINATOR_ADDRESS": "localhost:1234", "JAX_PROCESS_ID": "1"},
     "JAX_NUM_PROCESSES not set"),
    ({"JAX_COORDINATOR_ADDRESS": "localhost", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"},
     "JAX_COORDINATOR_ADDRESS='localhost' is not HOST:PORT"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
     "JAX_NUM_PROCESSES='two' is not an integer >= 1"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
     "JAX_PROCESS_ID=2 is not below JAX_NUM_PROCESSES=2"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0",
      "JAX_LOCAL_DEVICE_IDS": "0,x"}, "JAX_LOCAL_DEVICE_IDS='x' is not an integer >= 0"),
])
def test_bad_launch_variables_are_one_line_errors(tmp_path, monkeypatch, capsys, env, msg):
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
            "JAX_LOCAL_DEVICE_IDS"):
    monkeypatch.delenv(k, raising=False)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  cfg = tmp_path / "cfg.yaml"
  cfg.write_text(yaml.safe_dump(tiny_raw()))
  assert train_main(str(cfg), str(tmp_path / "run")) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and msg in err and err.count("\n") == 1, err
  assert not (tmp_path / "run").exists()


def test_launch_variables_are_passed_explicitly():
  env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
         "JAX_PROCESS_ID": "3", "JAX_LOCAL_DEVICE_IDS": "2, 3"}
  assert distributed_args(env) == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4,
                                   "process_id": 3, "local_device_ids": [2, 3]}
  # only an address (a cluster manager may supply the rest), or nothing: JAX detects
  assert distributed_args({"JAX_COORDINATOR_ADDRESS": "h:1"}) == {} == distributed_args({})
  with pytest.raises(ConfigError, match="mesh.distributed=off, but JAX_NUM_PROCESSES=4"):
    maybe_initialize_distributed("off", env)
  assert not maybe_initialize_distributed("auto", {})  # a plain single-process run


def test_loading_every_shipped_optimizer_config_leaves_jax_uninitialized():
  """Config loading builds the optimizer; nothing in that may start a JAX backend, since a
  multi-process run calls jax.distributed.initialize() after loading its config."""
  code = ("import jax._src.xla_bridge as xb\n"
          "from scaleopt.train.config import load_config\n"
          "for name in ('shampoo', 'shampoo_bc', 'sophia_bc', 'adamw_bc', 'muon'):\n"
          "  load_config('configs/train/tiny.yaml', [f'optimizer.name={name}'])\n"
          "assert not xb.backends_are_initialized(), 'a JAX backend was initialized'\n")
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                     env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
