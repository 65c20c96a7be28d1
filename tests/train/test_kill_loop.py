"""Kill loop: SIGKILL the tiny run at random steps, resume each time; the final parameters and
every logged metric equal those of an uninterrupted run, bit for bit."""

import os
import pathlib
import signal
import sys

import jax
import numpy as np
import pytest

from scaleopt.train import checkpoint, config as C, loop, metrics

from train_helpers import reference_run, run_until, tiny_raw

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = 24
# Asynchronous checkpoints every 2 steps: kills land before, during and after saves.
RAW = tiny_raw(run={"steps": STEPS, "checkpoint_every": 2, "keep_checkpoints": 2,
                    "eval_every": 0},
               data={"seq_len": 64, "batch_size": 32})  # slow enough to be killed mid-run


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  return reference_run(tmp_path_factory.mktemp("kill_ref"), RAW)


def _final_params(run):
  cfg = C.from_dict(RAW)
  fns = loop.compile_fns(loop.setup(cfg))
  ck = checkpoint.Checkpointer(run / "checkpoints", 2, False)
  state, _ = ck.restore_verified(STEPS, checkpoint.abstract(fns.state_shape, fns.state_sh))
  ck.close()
  return [np.asarray(x) for x in jax.tree.leaves(state)]


def _strip(rows):
  return [{k: v for k, v in r.items() if k not in metrics.TIMING} for r in rows]


def _kill_loop(reference, tmp_path, kills: int, seed: int):
  cfg_path, ref = reference
  run = tmp_path / "run"
  cmd = [sys.executable, "-m", "scaleopt.cli", "train", "--config", str(cfg_path), "--out",
         str(run)]
  # Increasing kill steps: stale rows of the killed run stay in metrics.jsonl until the next
  # process has restored, so each kill waits for a step beyond the previous kill.
  at = np.sort(np.random.default_rng(seed).choice(np.arange(2, STEPS - 1), kills, replace=False))
  # The processes share a compilation cache: only the first one compiles.
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jit"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  for i, step in enumerate(at):
    rc, sent, err = run_until(cmd + (["--resume"] if i else []), run, int(step), signal.SIGKILL,
                              cwd=ROOT, env=env)
    assert rc == -signal.SIGKILL and sent is not None and sent < STEPS, (step, rc, err[-2000:])
  rc, _, err = run_until(cmd + ["--resume"], run, STEPS + 1, signal.SIGKILL, cwd=ROOT, env=env)
  assert rc == 0 and "Traceback" not in err, err[-2000:]
  assert _strip(metrics.read_metrics(run / "metrics.jsonl")) == \
      _strip(metrics.read_metrics(ref / "metrics.jsonl"))
  for a, b in zip(_final_params(ref), _final_params(run)):
    np.testing.assert_array_equal(a, b)


def test_kill_loop_fast(reference, tmp_path):
  _kill_loop(reference, tmp_path, kills=2, seed=0)


@pytest.mark.slow
def test_kill_loop_five_kills(reference, tmp_path):
  _kill_loop(reference, tmp_path, kills=5, seed=1)
