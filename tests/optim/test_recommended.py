"""Each registered optimizer's recommended learning rate and schedule (``register_optimizer(...,
recommended=)``): a training config takes them where its optimizer section sets none, records
them in the run's config.yaml, and with them every registered name trains the shipped ``tiny``
config below 3.5 nats in 60 steps (integration tier; the names are read from the registry, so
a new registration is covered). docs/optim.md's table of them agrees with the registry."""

import dataclasses
import pathlib
import re

import pytest
import yaml

import scaleopt.optim as so
from scaleopt.optim.schedules import ScheduleConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "train" / "tiny.yaml"
STEPS, WARMUP, TARGET = 60, 5, 3.5


def test_every_registered_name_has_recommended_settings():
  schedule_keys = {f.name for f in dataclasses.fields(ScheduleConfig)}
  for name in so.names():
    rec = so.recommended(name)
    assert rec is not None, name
    assert isinstance(rec.learning_rate, float) and rec.learning_rate > 0, name
    assert set(rec.schedule) <= schedule_keys - {"total_steps"}, name
    ScheduleConfig.from_dict({**rec.schedule, "total_steps": STEPS})


def test_with_recommended_fills_only_what_the_section_leaves_out():
  rec = so.recommended("schedule_free_adamw")
  assert rec.schedule == {"kind": "constant"}
  out = so.with_recommended({"name": "schedule_free_adamw", "schedule": {"warmup_steps": 5}})
  assert out == {"name": "schedule_free_adamw", "learning_rate": rec.learning_rate,
                 "schedule": {"kind": "constant", "warmup_steps": 5}}
  mine = {"name": "schedule_free_adamw", "learning_rate": 1e-4, "schedule": {"kind": "cosine"}}
  assert so.with_recommended(mine) == mine
  assert so.with_recommended({"name": "soap"}) == {
      "name": "soap", "learning_rate": so.recommended("soap").learning_rate}


def _tiny_raw(name: str) -> dict:
  """configs/train/tiny.yaml for STEPS steps, the optimizer section reduced to its name and a
  warm-up of WARMUP steps: every other optimizer setting at the optimizer's own defaults."""
  raw = yaml.safe_load(TINY.read_text())
  raw["run"].update(steps=STEPS, eval_every=0, checkpoint_every=0, progress=False,
                    tensorboard=False, plot=False)
  raw["optimizer"] = {"name": name, "schedule": {"warmup_steps": WARMUP}}
  return raw


def test_the_training_config_takes_and_records_the_recommended_settings():
  from scaleopt.train import config as C
  for name in ("soap", "schedule_free_adamw"):
    cfg = C.from_dict(_tiny_raw(name))
    rec = so.recommended(name)
    assert cfg.optimizer.learning_rate == rec.learning_rate
    written = cfg.to_dict()["optimizer"]
    assert written["learning_rate"] == rec.learning_rate
    for k, v in rec.schedule.items():
      assert written["schedule"][k] == v
  raw = _tiny_raw("soap")
  raw["optimizer"]["learning_rate"] = 1e-4
  assert C.from_dict(raw).optimizer.learning_rate == 1e-4


def _docs_table() -> dict:
  """{name: (learning rate, schedule text)} of docs/optim.md's table of recommended settings."""
  text = (ROOT / "docs" / "optim.md").read_text()
  section = text.split("## Recommended learning rates", 1)[1].split("\n## ", 1)[0]
  rows = re.findall(r"^\| `(\w+)` \| ([0-9.e-]+) \| ([^|]*) \|", section, re.M)
  return {name: (float(lr), sched.strip()) for name, lr, sched in rows}


def test_docs_table_matches_the_registry():
  """Every shipped name (``build.RECOMMENDED``, each also registered) is in the docs table;
  names a program registers itself (tests do) are not shipped and not documented."""
  import importlib
  table = _docs_table()
  shipped = set(importlib.import_module("scaleopt.optim.build").RECOMMENDED)
  assert shipped <= set(so.names())
  assert set(table) == shipped, set(table) ^ shipped
  for name, (lr, sched) in table.items():
    rec = so.recommended(name)
    assert lr == rec.learning_rate, name
    assert sched == (", ".join(f"`{k}: {v}`" for k, v in rec.schedule.items()) or "-"), name


@pytest.mark.integration
@pytest.mark.parametrize("name", so.names())
def test_recommended_settings_train_tiny_below_target(name, tmp_path):
  from scaleopt.train import config as C, loop
  summary = loop.train(C.from_dict(_tiny_raw(name)), tmp_path)
  recorded = yaml.safe_load((tmp_path / "config.yaml").read_text())["optimizer"]
  assert recorded["learning_rate"] == so.recommended(name).learning_rate
  print(f"{name}: learning rate {recorded['learning_rate']}, held-out loss "
        f"{summary['final_eval_loss']:.3f} at step {STEPS}")
  assert summary["final_eval_loss"] < TARGET, (name, summary["final_eval_loss"])
