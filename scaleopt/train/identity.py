"""What a run trained on: ``RUN_DIR/data.json``, written when a run starts, checked on resume.

``describe(cfg)`` records the data of a run's config:

  {"source": "shards", "path": "/abs/path/to/shards" (resolved), "config_path": "as given",
   "splits": {"train": [{"file": "train_000.bin", "bytes": N, "sha256": "..."}, ...],
              "val": [...]},
   "tokenizer": {"name": "bpe:32768", "file": "/abs/.../tokenizer.json" or null,
                 "sha256": "..." or null, "separator": 0}}

(the embedded corpus: ``"source": "embedded"``, the Python version, and one entry per split
holding the hash of its tokens). ``check(out, now)`` compares the contents -- every shard's
hash and size, the tokenizer's hash -- with the record of a run being resumed, and refuses a
difference in one line naming the first file that changed; the folder may have moved (the
paths are kept for the reader, not compared). Hashing reads every shard once (SHA-256, the
files in parallel threads). Shards on a URL are recorded by size
and the file system's key of each file (``fs.ukey``: ETag, generation or modification time)
instead of a hash of their contents.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import pathlib
import sys
from typing import Optional

import numpy as np

from scaleopt.train import data
from scaleopt.train.config import ConfigError, TrainConfig

FILE = "data.json"


def _sha256(path: pathlib.Path, chunk: int = 1 << 23) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    while block := f.read(chunk):
      h.update(block)
  return h.hexdigest()


def _shards(root: pathlib.Path, split: str) -> list[dict]:
  bins = sorted(root.glob(f"{split}*.bin"))
  with concurrent.futures.ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
    sums = list(pool.map(_sha256, bins))
  return [{"file": b.name, "bytes": b.stat().st_size, "sha256": s} for b, s in zip(bins, sums)]


def tokenizer_record(root: pathlib.Path) -> dict:
  """The tokenizer of a shard folder: name and separator (shard headers), tokenizer.json's
  path and hash."""
  heads = sorted(root.glob("train*.json"))
  head = json.loads(heads[0].read_text()) if heads else {}
  tj = root / "tokenizer.json"
  return {"name": head.get("tokenizer"), "file": str(tj) if tj.is_file() else None,
          "sha256": _sha256(tj) if tj.is_file() else None, "separator": head.get("separator")}


def describe(cfg: TrainConfig) -> dict:
  """The record of the data ``cfg`` trains and evaluates on (module docstring)."""
  d = cfg.data
  if d.source == "embedded":
    splits = {s: [{"file": "embedded", "bytes": int(data.embedded_tokens(s).size),
                   "sha256": hashlib.sha256(np.asarray(data.embedded_tokens(s)).tobytes())
                   .hexdigest()}] for s in ("train", "val")}
    return {"source": "embedded", "python": sys.version.split()[0], "splits": splits,
            "tokenizer": {"name": "bytes", "file": None, "sha256": None,
                          "separator": data.SEP}}
  if data.is_url(d.path):
    return _describe_url(d.path)
  root = pathlib.Path(d.path).resolve()
  return {"source": "shards", "path": str(root), "config_path": d.path,
          "splits": {s: _shards(root, s) for s in ("train", "val")},
          "tokenizer": tokenizer_record(root)}


def _describe_url(url: str) -> dict:
  """Shards on an fsspec file system: each file's size and the file system's key of it
  (``ukey``: built from its ETag / generation / modification time), not a content hash, which
  would read the whole corpus over the network."""
  import fsspec
  fs, root = fsspec.core.url_to_fs(url)
  root = root.rstrip("/")
  splits = {s: [{"file": b.rsplit("/", 1)[-1], "bytes": fs.size(b), "ukey": fs.ukey(b)}
                for b in sorted(fs.glob(f"{root}/{s}*.bin"))] for s in ("train", "val")}
  heads = sorted(fs.glob(f"{root}/train*.json"))
  head = json.loads(fs.cat_file(heads[0])) if heads else {}
  tj = f"{root}/tokenizer.json"
  has_tj = fs.exists(tj)
  tok = {"name": head.get("tokenizer"), "file": url.rstrip("/") + "/tokenizer.json" if has_tj
         else None, "sha256": hashlib.sha256(fs.cat_file(tj)).hexdigest() if has_tj else None,
         "separator": head.get("separator")}
  return {"source": "shards", "path": url, "config_path": url, "splits": splits,
          "tokenizer": tok}


def read(out: pathlib.Path) -> Optional[dict]:
  p = pathlib.Path(out) / FILE
  return json.loads(p.read_text()) if p.is_file() else None


def write(out: pathlib.Path, record: dict) -> None:
  p = pathlib.Path(out) / FILE
  tmp = p.with_suffix(".json.tmp")
  tmp.write_text(json.dumps(record, indent=1) + "\n")
  os.replace(tmp, p)


def _first_change(old: dict, now: dict) -> Optional[str]:
  if old.get("source") != now.get("source"):
    return f"data.source was {old.get('source')!r}, is {now.get('source')!r}"
  for split in ("train", "val"):
    a = {e["file"]: e for e in old["splits"].get(split, [])}
    b = {e["file"]: e for e in now["splits"].get(split, [])}
    for name in sorted(set(a) | set(b)):
      if name not in b:
        return f"{name} is gone"
      if name not in a:
        return f"{name} is new"
      key = "sha256" if "sha256" in a[name] else "ukey"  # content hash, or a URL's file key
      if (a[name].get(key), a[name]["bytes"]) != (b[name].get(key), b[name]["bytes"]):
        return (f"{name} changed ({a[name]['bytes']} bytes, {key} {str(a[name].get(key))[:12]} "
                f"-> {b[name]['bytes']} bytes, {key} {str(b[name].get(key))[:12]})")
  ta, tb = old.get("tokenizer") or {}, now.get("tokenizer") or {}
  if (ta.get("name"), ta.get("sha256")) != (tb.get("name"), tb.get("sha256")):
    return f"the tokenizer changed ({ta.get('name')!r} -> {tb.get('name')!r})"
  return None


def check(out: pathlib.Path, now: dict) -> None:
  """ConfigError (one line) when the data differs from what the run at ``out`` recorded
  (nothing to compare: no record, e.g. a run started by an older scaleopt)."""
  old = read(out)
  if old is None:
    return
  change = _first_change(old, now)
  if change is not None:
    where = now.get("path") or "the embedded corpus"
    raise ConfigError(f"--resume: the data differs from what {str(out)!r} trained on: in "
                      f"{where}, {change} (see {FILE}); resume with that data or start a new "
                      "--out")
