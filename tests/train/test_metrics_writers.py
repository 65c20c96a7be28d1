"""TensorBoard (tensorboardX, read back by TensorBoard itself), W&B and profiler traces."""

import sys
import types

import jax
import jax.numpy as jnp
import pytest

from scaleopt.train import config as C, loop, metrics as M
from train_helpers import tiny_raw

ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _tb_scalars(tb_dir, tag):
  """(step, value) pairs as TensorBoard shows them (its reader applies purge events)."""
  acc = ea.EventAccumulator(str(tb_dir), size_guidance={ea.SCALARS: 0})
  acc.Reload()
  return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_events_after_the_last_checkpoint_are_not_shown_twice(tmp_path):
  log = M.MetricsLog(tmp_path)
  for s in range(1, 9):  # a run that checkpointed at step 5 and was killed after step 8
    log.write({"step": s, "loss": float(s), "flag": True, "nan": float("nan")})
  log.flush()
  log.close()
  log = M.MetricsLog(tmp_path, resume_step=5)  # resumed from the step-5 checkpoint
  for s in range(6, 11):
    log.write({"step": s, "loss": 100.0 + s})
  log.close()
  assert len(list((tmp_path / "tb").glob("events.out.tfevents.*"))) == 2
  got = _tb_scalars(tmp_path / "tb", "loss")
  assert got == [(s, float(s)) for s in range(1, 6)] + [(s, 100.0 + s) for s in range(6, 11)]
  acc = ea.EventAccumulator(str(tmp_path / "tb"))
  acc.Reload()
  assert acc.Tags()["scalars"] == ["loss"]  # booleans and non-finite values are left out
  assert [r["loss"] for r in M.read_metrics(tmp_path / "metrics.jsonl")] == (
      [1, 2, 3, 4, 5] + [106, 107, 108, 109, 110])


class _FakeRun:
  def __init__(self, calls, **kw):
    self.calls, self.id = calls, kw.get("id") or "run-1"
    calls.append(("init", kw))

  def log(self, values, step):
    self.calls.append(("log", step, values))

  def finish(self):
    self.calls.append(("finish",))


@pytest.fixture
def fake_wandb(monkeypatch):
  calls = []
  mod = types.ModuleType("wandb")
  mod.init = lambda **kw: _FakeRun(calls, **kw)
  monkeypatch.setitem(sys.modules, "wandb", mod)
  return calls


def test_wandb_gets_the_rows_and_resumes_the_same_run(tmp_path, fake_wandb):
  settings = {"project": "p", "mode": "offline"}
  log = M.MetricsLog(tmp_path, tensorboard=False, wandb=settings, config={"a": 1})
  log.write({"step": 3, "loss": 2.5, "skipped": 0, "eval_loss": float("nan")})
  log.close()
  init = fake_wandb[0][1]
  assert init["project"] == "p" and init["config"] == {"a": 1} and init["id"] is None
  assert fake_wandb[1] == ("log", 3, {"loss": 2.5, "skipped": 0.0})
  assert fake_wandb[2] == ("finish",)
  M.MetricsLog(tmp_path, resume_step=3, tensorboard=False, wandb=settings).close()
  assert fake_wandb[3][1]["id"] == "run-1" and fake_wandb[3][1]["resume"] == "allow"


def test_wandb_enabled_but_missing_is_a_config_error(monkeypatch, capsys, tmp_path):
  monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
  with pytest.raises(C.ConfigError, match="pip install wandb"):
    M.check_outputs({"project": "p"}, None)
  with pytest.raises(C.ConfigError, match="run.wandb.projekt"):
    M.check_outputs({"projekt": "p"}, None)
  for bad in ({"start_step": 1}, {"start_step": -1, "steps": 2}, {"start_step": 0, "steps": 0},
              {"start_step": 1.5, "steps": 2}):
    with pytest.raises(C.ConfigError, match="run.profile"):
      M.check_outputs(None, bad)


def test_tensorboard_on_but_missing_is_a_config_error(monkeypatch):
  M.check_outputs(None, None, tensorboard=True)  # installed here
  monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import tensorboardX -> ImportError
  with pytest.raises(C.ConfigError, match="run.tensorboard=false"):
    M.check_outputs(None, None, tensorboard=True)
  M.check_outputs(None, None, tensorboard=False)


def _trace_files(d):
  return list(d.rglob("*.xplane.pb"))


def test_profile_writes_a_trace_of_the_chosen_steps(tmp_path):
  f = jax.jit(lambda x: jnp.sin(x) @ x)
  x = jnp.ones((64, 64))
  prof = M.Profile(tmp_path / "profile", {"start_step": 2, "steps": 2})
  states = []
  for t in range(6):
    prof.before(t)
    x = f(x) / 64
    prof.after(t + 1, x)
    states.append(prof.active)
  assert states == [False, False, True, False, False, False]  # on for steps 3 and 4
  files = _trace_files(tmp_path / "profile")
  assert len(files) == 1 and files[0].stat().st_size > 0
  M.Profile(tmp_path / "none", None).before(0)
  assert not (tmp_path / "none").exists()


@pytest.mark.integration  # a training run: the second tier
def test_training_run_profiles_and_logs_to_wandb(tmp_path, fake_wandb):
  raw = tiny_raw(run={"steps": 4, "log_every": 2, "checkpoint_every": 0, "eval_every": 0,
                      "profile": {"start_step": 1, "steps": 2}, "wandb": {"project": "t"}},
                 optimizer={"schedule": {"kind": "constant"}})
  loop.train(C.from_dict(raw), tmp_path)
  assert len(_trace_files(tmp_path / "profile")) == 1
  assert [c[1] for c in fake_wandb if c[0] == "log"] == [2, 4]
  assert fake_wandb[0][1]["config"]["run"]["steps"] == 4
  assert [s for s, _ in _tb_scalars(tmp_path / "tb", "loss")] == [2, 4]
