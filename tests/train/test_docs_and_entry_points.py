"""What the user reads and calls: the optimizer list in docs/training.md against the registry,
``train_main`` with a shipped config's name, the CLI's help texts."""

import pathlib
import re

from scaleopt import cli, optim
from scaleopt.train.main import train_main

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _documented_optimizers() -> list[str]:
  """The names after ``name:`` in docs/training.md's optimizer section (the comment on that
  line and its continuation lines)."""
  lines = (ROOT / "docs" / "training.md").read_text().splitlines()
  start = lines.index("optimizer:                  # scaleopt.optim.build's OptimizerConfig")
  i = next(j for j in range(start, len(lines)) if lines[j].lstrip().startswith("name:"))
  text = lines[i].split("#", 1)[1]
  for line in lines[i + 1:]:
    if not line.lstrip().startswith("#"):
      break
    text += " " + line.split("#", 1)[1]
  text = text.replace("one of:", "")
  return [n.strip() for n in text.split("|") if n.strip()]


def test_training_docs_list_every_registered_optimizer():
  assert sorted(_documented_optimizers()) == sorted(optim.names())


def test_train_main_takes_a_shipped_config_name(tmp_path, capsys):
  """As ``scaleopt train --config tiny``: the name resolves to the shipped file."""
  rc = train_main("tiny", str(tmp_path / "run"), ["run.steps=1", "model.n_layers=1"],
                  dry_run=True)
  first = capsys.readouterr()
  assert rc == 0, first.err
  assert train_main("no_such_config", str(tmp_path / "run2")) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "'no_such_config'" in err[0] and "tiny" in err[0]


def _help(*argv) -> str:
  parser = cli.build_parser()
  sub = parser
  for a in argv:
    sub = next(act for act in sub._actions if hasattr(act, "choices") and act.choices
               and a in act.choices).choices[a]
  return " ".join(sub.format_help().split())


def test_help_names_the_default_tokenizer_and_the_export_folder():
  prep = _help("data", "prepare")
  assert re.search(r"--tokenizer TOKENIZER .*default: bytes", prep), prep
  export = _help("convert", "export")
  assert re.search(r"--out OUT .*Hugging Face", export), export
