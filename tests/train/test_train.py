"""End-to-end training on the embedded corpus: learning, exact resume, crash recovery, skips."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import yaml

from scaleopt.train import config as C
from scaleopt.train import data as D
from scaleopt.train import faults, loop, metrics

from train_helpers import run_until, tiny_raw, val_unigram_entropy

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_tiny_run_beats_unigram_entropy(tmp_path):
  raw = tiny_raw(run={"steps": 120, "log_every": 20, "eval_every": 60, "eval_tokens": 4096,
                      "checkpoint_every": 0, "plot": True},
                 model={"d_model": 64, "n_layers": 2, "d_ff": 128},
                 data={"seq_len": 64, "batch_size": 16, "microbatches": 1})
  s = loop.train(C.from_dict(raw), tmp_path)
  h = val_unigram_entropy()
  assert 2.5 < h < 4.5  # bytes of Python source
  assert s["final_eval_loss"] < h - 0.4, (s["final_eval_loss"], h)
  rows = metrics.read_metrics(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in rows] == [20, 40, 60, 80, 100, 120]
  for r in rows:
    assert {"step", "loss", "lr", "tokens_per_s", "grad_norm", "update_norm"} <= set(r)
  assert [r["step"] for r in rows if "eval_loss" in r] == [60, 120]
  summ = json.loads((tmp_path / "summary.json").read_text())
  assert summ["steps"] == 120 and summ["tokens"] == 120 * 16 * 64
  assert summ["params"] > 0 and summ["final_train_loss"] < h
  assert (tmp_path / "loss.png").stat().st_size > 1000
  assert yaml.safe_load((tmp_path / "config.yaml").read_text())["run"]["steps"] == 120
  from tensorboard.backend.event_processing import event_accumulator as ea
  acc = ea.EventAccumulator(str(tmp_path / "tb"))
  acc.Reload()
  assert [e.step for e in acc.Scalars("loss")] == [r["step"] for r in rows]


def _rows(path):
  return metrics.read_metrics(path / "metrics.jsonl")


def _strip(rows):
  return [{k: v for k, v in r.items() if k not in metrics.TIMING} for r in rows]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
  """24 steps of adamw_bc (LOO, 2 microbatches) with checkpoints every 4, uninterrupted."""
  out = tmp_path_factory.mktemp("ref")
  raw = tiny_raw(optimizer={"name": "adamw_bc", "extra": {"mode": "full", "crossfit": "loo"}},
                 run={"steps": 24, "checkpoint_every": 4, "eval_every": 8},
                 data={"seq_len": 64, "batch_size": 32})  # slow enough to signal mid-run
  cfg_path = out / "cfg.yaml"
  cfg_path.write_text(yaml.safe_dump(raw))
  loop.train(C.from_dict(raw), out / "run")
  return cfg_path, out / "run"


@pytest.mark.integration
def test_resume_is_bitwise_equal(reference_run, tmp_path):
  cfg_path, ref = reference_run
  run = tmp_path / "run"
  shutil.copytree(ref, run)
  steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
  assert steps[-1] == 24 and 8 in steps
  for st in steps:  # pretend the run died right after the checkpoint at step 8
    if st > 8:
      shutil.rmtree(run / "checkpoints" / str(st))
  rows = _rows(run)  # piece 1's rows up to the checkpoint, with a wall time no run reaches
  rows[7]["wall_s"] = 1e6
  (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  t0 = time.time()
  summary = loop.train(C.load_config(cfg_path), run, resume=True)
  elapsed = time.time() - t0
  assert summary["resumed_from"] == 8
  rows = _rows(run)
  a, b = _strip(_rows(ref)), _strip(rows)
  assert [r["step"] for r in b] == list(range(1, 25))
  assert a == b  # every logged float identical, eval losses included
  # throughput and wall time are the whole run's: both pieces' rows
  timed = [(r["tokens"] - q["tokens"], r["tokens_per_s"]) for q, r in zip(rows, rows[1:])
           if r["tokens_per_s"] is not None]
  assert summary["tokens_per_s"] == pytest.approx(sum(t for t, _ in timed)
                                                  / sum(t / v for t, v in timed), rel=1e-9)
  assert 1e6 < summary["wall_time_s"] <= 1e6 + elapsed


def _run_until(cmd, env, run, step, sig):
  """Starts the CLI, sends ``sig`` once metrics.jsonl reaches ``step``; returns (rc, step)."""
  rc, sent_at, err = run_until(cmd, run, step, sig, cwd=ROOT, env=env)
  assert sent_at is not None and sent_at < 24, err[-2000:]
  return rc, sent_at


@pytest.mark.integration
def test_sigterm_then_sigkill_then_resume(reference_run, tmp_path):
  # Synchronous saves make "at most one interval" strict; an async save still in flight when
  # the process dies is lost as well (docs/training.md).
  cfg_path, ref = reference_run
  run = tmp_path / "run"
  cmd = [sys.executable, "-m", "scaleopt.cli", "train", "--config", str(cfg_path), "--out",
         str(run), "--set", "run.async_checkpoint=false"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  # SIGTERM (preemption): the run checkpoints where it is and exits 143
  rc, sent = _run_until(cmd, env, run, 6, signal.SIGTERM)
  assert rc == 143
  summ = json.loads((run / "summary.json").read_text())
  assert summ["interrupted_by"] == "SIGTERM"
  stopped = summ["steps"]
  assert sent <= stopped < 24 and (run / "checkpoints" / str(stopped)).is_dir()
  # resume, then SIGKILL mid-way: at most one checkpoint interval is lost
  rc, killed_at = _run_until(cmd + ["--resume"], env, run, stopped + 8, signal.SIGKILL)
  assert rc == -signal.SIGKILL
  r = subprocess.run(cmd + ["--resume"], cwd=ROOT, env=env, capture_output=True, text=True)
  assert r.returncode == 0, r.stderr[-2000:]
  resumed = json.loads((run / "summary.json").read_text())["resumed_from"]
  assert resumed is not None and 0 <= killed_at - resumed <= 4
  assert _strip(_rows(run)) == _strip(_rows(ref))  # and then it matches, bit for bit


@pytest.mark.integration
def test_existing_run_needs_resume(reference_run, tmp_path, capsys):
  from scaleopt.train.main import train_main
  cfg_path, ref = reference_run
  run = tmp_path / "run"
  shutil.copytree(ref, run)
  assert train_main(str(cfg_path), str(run)) == 2
  assert "--resume" in capsys.readouterr().err


@pytest.mark.integration
def test_nonfinite_steps_are_skipped_then_run_stops(tmp_path):
  raw = tiny_raw(run={"steps": 30, "max_consecutive_skips": 3, "checkpoint_every": 0})
  cfg = C.from_dict(raw)
  s = loop.setup(cfg)
  import dataclasses
  import jax.numpy as jnp
  base_apply = s.model.apply

  def nan_apply(params, tokens):  # every loss is NaN
    logits, aux = base_apply(params, tokens)
    return logits * jnp.nan, aux

  s.model = dataclasses.replace(s.model, apply=nan_apply, loss_apply=None)
  with pytest.raises(faults.SkipLimit, match="3 consecutive"):
    loop.train(cfg, tmp_path, s=s)
  rows = _rows(tmp_path)
  assert rows[-1]["skipped"] >= 3 and rows[-1]["step"] <= 5
  # the checkpointed parameters are the initial ones (never touched)
  from scaleopt.train import checkpoint, step as step_lib
  ck = checkpoint.Checkpointer(tmp_path / "checkpoints", 2, False)
  last = ck.latest_step()
  assert last == rows[-1]["step"]
  init = jax.jit(lambda: step_lib.init_state(s.model, s.tx, cfg.run.seed))()
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = checkpoint.abstract(init, jax.tree.map(lambda _: dev, init))
  restored, data_state = ck.restore(last, target)
  assert data_state["chunk"] == last
  assert int(restored.skipped) == last and int(restored.step) == last
  for a, b in zip(jax.tree.leaves(init.params), jax.tree.leaves(restored.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.integration  # a whole training run (the cheap checks stay in make test)
def test_shards_source_trains(tmp_path):
  src = tmp_path / "txt"
  src.mkdir()
  for i in range(30):
    (src / f"doc{i}.py").write_text(("def f(x):\n  return x * %d\n" % i) * 50)
  D.prepare(src, tmp_path / "shards")
  raw = tiny_raw(data={"source": "shards", "path": str(tmp_path / "shards")},
                 run={"steps": 10, "eval_every": 10, "checkpoint_every": 0})
  s = loop.train(C.from_dict(raw), tmp_path / "run")
  assert s["final_eval_loss"] < 5.0
  (tmp_path / "shards" / "val_000.bin").write_bytes(b"\x01")
  with pytest.raises(D.DataError, match="val_000.bin"):
    loop.setup(C.from_dict(raw))


@pytest.mark.integration
def test_eval_loss_matches_direct_computation(reference_run):
  """The logged eval loss equals the cross-entropy of the final parameters on the documented
  evaluation windows (the first eval_tokens // seq_len of the permutation of seed
  data.EVAL_SEED, each window once), computed here without the training stack."""
  from scaleopt import models
  from scaleopt.train import checkpoint, step as step_lib
  cfg_path, ref = reference_run
  cfg = C.load_config(cfg_path)
  s = loop.setup(cfg)
  init = jax.jit(lambda: step_lib.init_state(s.model, s.tx, cfg.run.seed))()
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  ck = checkpoint.Checkpointer(ref / "checkpoints", 10, False)
  state, _ = ck.restore(24, checkpoint.abstract(init, jax.tree.map(lambda _: dev, init)))
  T = cfg.data.seq_len
  val = np.asarray(D.embedded_tokens("val")).astype(np.int64)
  n_windows = (val.size - 1) // T
  pick = np.random.default_rng(D.EVAL_SEED).permutation(n_windows)[:cfg.run.eval_tokens // T]
  x = np.stack([val[i * T:i * T + T + 1] for i in pick])
  _, apply = models.functional(s.model.cfg)
  logits = np.asarray(apply(state.params, x[:, :-1])[0], np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  ce = -np.take_along_axis(logp, x[:, 1:, None], -1).mean()
  logged = _rows(ref)[-1]["eval_loss"]
  np.testing.assert_allclose(logged, ce, rtol=1e-5)


HANG = r"""
import dataclasses, json, sys, time
import jax
from scaleopt.train import config as C, loop
raw = json.loads(sys.argv[1])
cfg = C.from_dict(raw)
s = loop.setup(cfg)
base = s.model.apply

def stuck(x):
  print("hung", flush=True)  # the first step is running and will not finish
  time.sleep(3600)
  return x

def hung_apply(params, tokens):  # a device computation that never finishes
  tokens = jax.pure_callback(stuck, jax.ShapeDtypeStruct(tokens.shape, tokens.dtype), tokens)
  return base(params, tokens)

s.model = dataclasses.replace(s.model, apply=hung_apply, loss_apply=None)
print("ready", flush=True)
loop.train(cfg, sys.argv[2], s=s)
"""


@pytest.mark.integration
def test_second_signal_exits_even_if_a_step_hangs(tmp_path):
  raw = tiny_raw(run={"steps": 5, "checkpoint_every": 0})
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.Popen([sys.executable, "-c", HANG, json.dumps(raw), str(tmp_path / "run")],
                       cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       text=True)
  assert p.stdout.readline().strip() == "ready"
  assert p.stdout.readline().strip() == "hung"  # inside the first step, handlers installed
  p.send_signal(signal.SIGTERM)
  deadline = time.time() + 60
  line = ""
  while time.time() < deadline and "stopping after this step" not in line:
    line = p.stderr.readline()
    if not line and p.poll() is not None:
      break
  assert "SIGTERM" in line, p.poll()
  assert p.poll() is None  # the step cannot finish, so the first signal cannot stop it
  p.send_signal(signal.SIGTERM)
  assert p.wait(timeout=30) == 128 + signal.SIGTERM
