"""A run knows its data: data.json at the start, --resume refuses changed data."""

import json

import numpy as np
import pytest
import yaml

from scaleopt import cli
from scaleopt.train import data as D, identity

from train_helpers import tiny_raw


def _shards(d, seed):
  rng = np.random.default_rng(seed)
  d.mkdir(parents=True, exist_ok=True)
  for split, n in (("train", 6000), ("val", 2000)):
    toks = rng.integers(1, 256, n)
    toks[::50] = 0  # documents of 50 tokens
    D.write_shard(d / f"{split}_000", toks, 256, "bytes", separator=0)


def _cli(capsys, *argv):
  rc = cli.main([str(a) for a in argv])
  return rc, [l for l in capsys.readouterr().err.splitlines() if l.strip()]


@pytest.mark.integration  # a whole training run (the cheap checks stay in make test)
def test_resume_refuses_changed_data_and_starts_fresh_on_an_empty_folder(capsys, tmp_path):
  shards, run = tmp_path / "shards", tmp_path / "run"
  _shards(shards, 0)
  cfg = tmp_path / "c.yaml"
  raw = tiny_raw(run={"steps": 6, "checkpoint_every": 0, "eval_every": 0, "eval_tokens": 256,
                      "tensorboard": False},
                 data={"source": "shards", "path": str(shards), "batch_size": 4})
  cfg.write_text(yaml.safe_dump(raw))
  # --resume with nothing to resume: a one-line note, then a new run (exit 0)
  rc, err = _cli(capsys, "train", "--config", cfg, "--out", run, "--resume")
  assert rc == 0 and any(l.startswith("note: --resume:") and "no checkpoint" in l for l in err), err
  rec = json.loads((run / "data.json").read_text())
  assert rec["path"] == str(shards.resolve()) and rec["tokenizer"]["separator"] == 0
  assert [e["file"] for e in rec["splits"]["train"]] == ["train_000.bin"]
  # shards re-prepared from another corpus under the same path: refused before anything
  before = (run / "metrics.jsonl").read_text()
  _shards(shards, 1)
  rc, err = _cli(capsys, "train", "--config", cfg, "--out", run, "--resume",
                 "--set", "run.steps=8")
  assert rc == 2 and len(err) == 1 and not any("Traceback" in l for l in err), err
  assert "train_000.bin changed" in err[0] and str(run) in err[0], err
  assert (run / "metrics.jsonl").read_text() == before
  assert json.loads((run / "data.json").read_text()) == rec  # the record is never rewritten


def test_data_record_compares_contents_not_paths(tmp_path):
  a, b = tmp_path / "a", tmp_path / "b"
  _shards(a, 0)
  _shards(b, 0)
  cfg = lambda p: type("C", (), {"data": type("D", (), {"source": "shards", "path": str(p)})})
  ra, rb = identity.describe(cfg(a)), identity.describe(cfg(b))
  assert identity._first_change(ra, rb) is None  # a moved copy of the same data
  (b / "tokenizer.json").write_text("{}")
  assert "tokenizer" in identity._first_change(ra, identity.describe(cfg(b)))
  (b / "val_001.bin").write_bytes(b"\0\0")
  assert identity._first_change(ra, identity.describe(cfg(b))) == "val_001.bin is new"
