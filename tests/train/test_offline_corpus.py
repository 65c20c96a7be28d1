"""scripts/offline_corpus.py on a small folder (CPU): sources collected once each, shards and
manifests consistent with each other, epochs counted, the size targets enforced."""

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from scaleopt.train import data as D

pytest.importorskip("tokenizers")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _tree(tmp_path):
  src = tmp_path / "site"
  (src / "pkg" / "__pycache__").mkdir(parents=True)
  texts = {}
  for i in range(40):
    body = "".join(f"def f{j}_{i}(x):\n    return x * {i * j}  # note {j % 7}\n"
                   for j in range(60))
    texts[f"pkg/m{i:02d}.py"] = body
  texts["pkg/README.md"] = "# Package\n\nSome *markdown* about `f` and `g`.\n"
  texts["pkg/types.pyi"] = "def f(x: int) -> int: ...\n"
  for rel, t in texts.items():
    (src / rel).write_text(t)
  (src / "vendored.py").write_text(texts["pkg/m00.py"])  # a duplicate: kept once
  (src / "pkg" / "__pycache__" / "m00.py").write_text("cached copy")  # never read
  (src / "data.bin.txt").write_bytes(b"\xff\xfe not utf-8")
  (src / "lib.so").write_bytes(b"\x7fELF")
  return src, texts


def _run(tmp_path, src, *extra):
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  return subprocess.run(
      [sys.executable, str(ROOT / "scripts" / "offline_corpus.py"), "--out",
       str(tmp_path / "corpus"), "--roots", str(src), "--vocab", "400", "--bpe-sample-mb",
       "0.05", "--val-fraction", "0.1", "--shard-tokens", "20000", "--min-vocab", "300",
       "--work", str(tmp_path), *extra], capture_output=True, text=True, env=env, timeout=300)


def test_offline_corpus_recipe_on_a_small_folder(tmp_path):
  src, texts = _tree(tmp_path)
  r = _run(tmp_path, src, "--min-tokens", "1000", "--run-tokens", "1000000")
  assert r.returncode == 0, r.stderr
  out = tmp_path / "corpus"
  sources = json.loads((out / "sources.json").read_text())
  kept = sorted(set(texts) - {"pkg/m00.py"} | {"vendored.py"})  # a folder's files first
  assert sorted(f["path"] for f in sources["files"]) == kept
  assert sources["duplicates_dropped"] == 1 and sources["bytes"] == sum(
      len(t.encode()) for t in texts.values())
  for f in sources["files"]:
    assert f["sha256"] == hashlib.sha256((src / f["path"]).read_bytes()).hexdigest()
  man = json.loads((out / "manifest.json").read_text())
  tokens = {s: sum(int(np.asarray(a).size) for a in D.load_shards(out, s)[0])
            for s in ("train", "val")}
  assert {s: man["splits"][s]["tokens"] for s in tokens} == tokens
  assert tokens["val"] > 0 and 300 <= man["vocab_size"] <= 400
  for s in ("train", "val"):
    for sh in man["splits"][s]["shards"]:
      assert sh["sha256"] == hashlib.sha256((out / sh["file"]).read_bytes()).hexdigest()
  assert f"{1_000_000 / tokens['train']:.2f} epochs" in r.stdout
  assert not list(tmp_path.glob("tmp*/sources.jsonl"))  # the scratch JSONL is gone
  # the recipe is reproducible: the same sources give the same corpus
  (tmp_path / "again").mkdir()
  r2 = _run(tmp_path / "again", src, "--min-tokens", "1000")
  assert r2.returncode == 0, r2.stderr
  man2 = json.loads((tmp_path / "again" / "corpus" / "manifest.json").read_text())
  assert man2["content_hash"] == man["content_hash"]


def test_offline_corpus_below_its_target_exits_1(tmp_path):
  src, _ = _tree(tmp_path)
  r = _run(tmp_path, src, "--min-tokens", "1e9")
  assert r.returncode == 1 and "--min-tokens" in r.stderr
