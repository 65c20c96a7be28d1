"""Config loading, dotted overrides and the errors a user sees."""

import pathlib

import pytest
import yaml

from scaleopt.train import config as C
from scaleopt.train.main import train_main

from train_helpers import tiny_raw

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_every_shipped_config_loads():
  files = sorted((ROOT / "configs" / "train").glob("*.yaml"))
  assert len(files) >= 6
  names = set()
  for f in files:
    cfg = C.load_config(f)
    names.add(cfg.optimizer.name)
  assert {"adamw", "adamw_bc"} <= names


def test_overrides_parse_as_yaml_and_nest(tmp_path):
  p = tmp_path / "c.yaml"
  p.write_text(yaml.safe_dump(tiny_raw()))
  cfg = C.load_config(p, ["optimizer.learning_rate=1e-4", "run.steps=7",
                          "optimizer.schedule.kind=wsd", "model.n_layers=3",
                          "optimizer.extra.mode=cf", "optimizer.name=adamw_bc"])
  assert cfg.optimizer.learning_rate == 1e-4
  assert cfg.run.steps == 7
  assert cfg.optimizer.schedule.kind == "wsd"
  assert cfg.optimizer.schedule.total_steps == 7  # filled from run.steps
  assert cfg.model.config.n_layers == 3


@pytest.mark.parametrize("sections, words", [
    ({"run": {"stepz": 3}}, ["run.stepz", "steps"]),
    ({"run": {"steps": "many"}}, ["run.steps", "int"]),
    ({"run": {"steps": 0}}, ["run.steps", "> 0"]),
    ({"data": {"source": "web"}}, ["data.source", "embedded", "shards"]),
    ({"data": {"batch_size": 10, "microbatches": 4}}, ["data.batch_size", "microbatches"]),
    ({"data": {"source": "shards"}}, ["data.path"]),
    ({"optimizer": {"name": "adamq"}}, ["optimizer.name", "adamw_bc"]),
    ({"optimizer": {"schedule": {"kind": "linear"}}}, ["schedule.kind", "cosine", "wsd"]),
    ({"optimizer": {"lr": 1e-3}}, ["optimizer.lr", "learning_rate"]),
    ({"model": {"preset": "huge"}}, ["huge", "tiny", "gpt2-small"]),
    ({"model": {"d_modle": 8}}, ["model.d_modle", "d_model"]),
    ({"model": {"wd_policy": "some"}}, ["model.wd_policy", "iwd"]),
    ({"mesh": {"fsdp": 0}}, ["mesh.fsdp"]),
    ({"run": {"update_guard": "never"}}, ["run.update_guard", "always"]),
    ({"extra_section": {}}, ["extra_section", "optimizer"]),
])
def test_bad_config_names_key_and_allowed(sections, words):
  with pytest.raises(C.ConfigError) as e:
    C.from_dict(tiny_raw(**sections))
  for w in words:
    assert w in str(e.value), (w, str(e.value))


def test_bad_override_syntax():
  with pytest.raises(C.ConfigError, match="section.key=value"):
    C.apply_overrides({}, ["novalue"])
  with pytest.raises(C.ConfigError, match="dotted"):
    C.apply_overrides({}, ["steps=3"])


def test_cli_rejects_bad_config_before_compiling(tmp_path, capsys):
  p = tmp_path / "c.yaml"
  p.write_text(yaml.safe_dump(tiny_raw()))
  out = tmp_path / "run"
  rc = train_main(str(p), str(out), overrides=["optimizer.schedule.kind=cosinus"])
  assert rc == 2
  err = capsys.readouterr().err
  assert "schedule.kind" in err and "cosine" in err
  assert not out.exists()  # nothing written, nothing compiled
  rc = train_main(str(tmp_path / "missing.yaml"), str(out))
  assert rc == 2 and "missing.yaml" in capsys.readouterr().err


def test_block_shards_fsdp_is_recorded_as_the_fsdp_size_and_another_size_refuses_resume(
    tmp_path):
  """``optimizer.extra.block_shards: fsdp`` resolves to ``mesh.fsdp`` in the loaded config (so
  the run's config.yaml records the number); resuming on another FSDP size changes the blocks'
  shapes, and the resume check names the key before any checkpoint is read."""
  raw = tiny_raw(optimizer={"name": "shampoo", "learning_rate": 1e-3,
                            "extra": {"block_shards": "fsdp"}}, mesh={"data": 1, "fsdp": 2})
  cfg = C.from_dict(raw)
  assert cfg.optimizer.extra["block_shards"] == 2
  C.dump_config(cfg, tmp_path / "config.yaml")
  assert C.check_resume(C.from_dict(raw), tmp_path) == {}
  raw["mesh"]["fsdp"] = 4
  with pytest.raises(C.ConfigError, match=r"optimizer\.extra\.block_shards \(2 -> 4\)"):
    C.check_resume(C.from_dict(raw), tmp_path)


@pytest.mark.parametrize("optimizer, guard, checked", [
    ({"name": "adamw"}, "auto", False),
    ({"name": "adamw"}, "always", True),
    ({"name": "adamw", "eps": 0.0}, "auto", True),
    ({"name": "adamw", "extra": {"mu_dtype": "float16"}}, "auto", True),
    ({"name": "muon"}, "auto", True),
    ({"name": "shampoo"}, "auto", True),
])
def test_the_skip_guard_checks_the_update_unless_the_optimizer_cannot_fail(optimizer, guard,
                                                                           checked):
  from scaleopt.train import loop
  cfg = C.from_dict(tiny_raw(run={"update_guard": guard}, optimizer=optimizer))
  assert loop.check_update(cfg) is checked


def test_learning_rate_walks_from_the_cli_into_one_build(tmp_path, monkeypatch):
  """A config parsed once (file + ``--set optimizer.learning_rate``) reaches the trainer's
  setup with the model preset resolved once, the schedule made once and the optimizer built
  once, by the setup (``bridge.run_optimizer``), with the overridden learning rate."""
  import importlib
  from scaleopt.train import bridge, loop
  optim_build = importlib.import_module("scaleopt.optim.build")  # the module, not build()

  from scaleopt import models
  calls = {"make_schedule": 0, "build": 0, "get_preset": 0}

  def counting(name, fn):
    def wrapped(*a, **k):
      calls[name] += 1
      return fn(*a, **k)
    return wrapped

  sched = counting("make_schedule", optim_build.make_schedule)
  monkeypatch.setattr(optim_build, "make_schedule", sched)
  monkeypatch.setattr(bridge, "make_schedule", sched)
  monkeypatch.setattr(bridge, "build", counting("build", optim_build.build))
  monkeypatch.setattr(models, "get_preset", counting("get_preset", models.get_preset))
  path = tmp_path / "run.yaml"
  path.write_text(yaml.safe_dump(tiny_raw(run={"steps": 10})))
  cfg = C.load_config(path, ["optimizer.learning_rate=2e-3"])
  s = loop.setup(cfg)
  assert calls == {"make_schedule": 1, "build": 1, "get_preset": 1}
  assert s.model.cfg is cfg.model.config  # the preset resolved once, at validation
  assert float(s.schedule(5)) == pytest.approx(2e-3)  # the warmup's end: the peak
