"""What a new user types first: the help's examples, the README's config paths from another
folder, the plain progress lines of a batch job, a short smoke run of a long config."""

import json
import pathlib
import re

import pytest
import yaml

from scaleopt import cli
from scaleopt.config import ConfigError, configs_dir, resolve_config, to_dict
from scaleopt.train import config as C

from train_helpers import tiny_raw

ROOT = pathlib.Path(__file__).resolve().parents[2]
KINDS = {"train": "train", "sweep": "sweep", "study": "study"}


def _help(command: str) -> str:
  sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
  return " ".join(a.help or "" for a in sub.choices[command]._actions)


def test_train_help_examples_are_accepted_keys():
  text = _help("train")
  examples = re.findall(r"--set ([\w.]+=\S+)", text)
  assert examples, text
  tiny = resolve_config("tiny", "train")
  for ex in examples:
    C.load_config(tiny, [ex])  # an unknown key raises ConfigError naming it


def test_readme_config_paths_work_from_any_folder(tmp_path, monkeypatch):
  text = (ROOT / "README.md").read_text()
  uses = re.findall(r"scaleopt (train|sweep|study) --config ([^\s`]+)", text)
  assert any("/" in name for _, name in uses), uses  # a path form is among them
  monkeypatch.chdir(tmp_path)
  for kind, name in uses:
    assert resolve_config(name, KINDS[kind]).is_file(), (kind, name)
  got = resolve_config("configs/train/qwen2.5-0.5b.yaml", "train")
  assert got.resolve() == (configs_dir() / "train" / "qwen2.5-0.5b.yaml").resolve()
  with pytest.raises(ConfigError, match="configs/train/nope.yaml"):
    resolve_config("configs/train/nope.yaml", "train")


def _sched(steps, **sched):
  raw = tiny_raw(run={"steps": steps})
  raw["optimizer"]["schedule"] = sched
  return to_dict(C.from_dict(raw).optimizer.schedule)


def test_short_run_fits_the_warmup_with_a_notice(capsys):
  assert _sched(10, kind="cosine", warmup_steps=30)["warmup_steps"] == 10
  assert "optimizer.schedule.warmup_steps=30" in capsys.readouterr().err
  # wsd keeps its decay (round(0.2 * 10) = 2 steps): warmup fits the 8 steps before it
  assert _sched(10, kind="wsd", warmup_steps=30, decay_fraction=0.2)["warmup_steps"] == 8
  assert _sched(10, kind="constant", warmup_steps=30)["warmup_steps"] == 30
  assert _sched(40, kind="cosine", warmup_steps=30)["warmup_steps"] == 30
  assert capsys.readouterr().err.count("note:") == 1  # the wsd case only
  with pytest.raises(ConfigError, match="warmup_steps=30 must be <= .*total_steps=12"):
    _sched(10, kind="cosine", warmup_steps=30, total_steps=12)  # set by hand: not changed
  # a schedule set to end with the run (as config.yaml records it) is fitted like an unset one
  assert _sched(10, kind="cosine", warmup_steps=30, total_steps=10)["warmup_steps"] == 10


@pytest.mark.integration  # a training run: the second tier
def test_quiet_run_prints_a_line_per_log_and_fits_its_warmup(tmp_path, capsys):
  """``run.progress=false`` (batch jobs): one line every ``log_every`` steps; a warmup longer
  than the run trains over the whole run (lr = peak * t / steps at step t)."""
  raw = tiny_raw(run={"steps": 4, "log_every": 2, "eval_every": 0, "checkpoint_every": 0,
                      "progress": False, "tensorboard": False})
  raw["optimizer"]["schedule"] = {"kind": "cosine", "warmup_steps": 30, "min_lr_ratio": 0.1}
  cfg = tmp_path / "smoke.yaml"
  cfg.write_text(yaml.safe_dump(raw))
  assert cli.main(["train", "--config", str(cfg), "--out", str(tmp_path / "run")]) == 0
  io = capsys.readouterr()
  lines = [l for l in io.out.splitlines() if l.startswith("step ")]
  assert [l.split()[1] for l in lines] == ["2/4", "4/4"], io.out
  assert all(re.search(r" loss \d+\.\d{4} ", l) for l in lines), lines
  assert "eval " in lines[-1]  # the last step evaluates
  assert "warmup_steps=30 does not fit run.steps=4" in io.err
  rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
  peak = raw["optimizer"]["learning_rate"]
  for row in rows:  # the row of step t used the schedule at t - 1
    assert row["lr"] == pytest.approx(peak * (row["step"] - 1) / 4, rel=1e-6), row
