"""Data a user names is the data a run trains on: a shard folder without data.source=shards
is refused (it would silently train on the embedded corpus)."""

import pytest

from scaleopt.train import config as C
from scaleopt.train.main import train_main

from train_helpers import tiny_raw


@pytest.mark.parametrize("data", [{"path": "data/bpe"},
                                  {"source": "embedded", "path": "data/bpe"}])
def test_data_path_without_shards_is_refused(data):
  raw = tiny_raw()
  raw["data"] = {k: v for k, v in raw["data"].items() if k != "source"}
  raw["data"].update(data)
  with pytest.raises(C.ConfigError) as e:
    C.from_dict(raw)
  msg = str(e.value)
  assert "data.path" in msg and "data.source=shards" in msg and "embedded" in msg, msg


def test_cli_case_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys):
  """The command of the report: the shipped tiny config, a shard folder named by data.path."""
  out = tmp_path / "x"
  rc = train_main("tiny", str(out), ["data.path=data/bpe", "model.vocab_size=1024",
                                     "run.steps=3"])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and len(err) == 1 and "data.path" in err[0], err
  assert not out.exists()
