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
    names.add(cfg.optimizer["name"])
  assert {"adamw", "adamw_bc"} <= names


def test_overrides_parse_as_yaml_and_nest(tmp_path):
  p = tmp_path / "c.yaml"
  p.write_text(yaml.safe_dump(tiny_raw()))
  cfg = C.load_config(p, ["optimizer.learning_rate=1e-4", "run.steps=7",
                          "optimizer.schedule.kind=wsd", "model.n_layers=3",
                          "optimizer.extra.mode=cf", "optimizer.name=adamw_bc"])
  assert cfg.optimizer["learning_rate"] == 1e-4
  assert cfg.run.steps == 7
  assert cfg.optimizer["schedule"]["kind"] == "wsd"
  assert cfg.optimizer["schedule"]["total_steps"] == 7  # filled from run.steps
  assert cfg.model["n_layers"] == 3


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
