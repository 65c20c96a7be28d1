"""The shard writer of ``scaleopt data prepare`` (the format: ``scaleopt.train.shards``) and the
manifest a finished run writes: the input files and bytes, tokens per split, each shard's sha256
and a content hash over shards and tokenizer."""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Optional

import numpy as np

from scaleopt.train.shards import shard_dtype, shard_header

MANIFEST = "manifest.json"


class ShardWriter:
  """Streams token arrays into ``SPLIT_000.bin``, ``SPLIT_001.bin``, ... of ``size`` tokens
  (the last one shorter), never holding more than the array being added; keeps each shard's
  (file, tokens, sha256). ``carry()``: the tokens of the open shard when a shard was closed
  during the last ``add`` (they came from that array), for a restart point."""

  def __init__(self, out: pathlib.Path, split: str, tok, size: int, shards=(),
               carry: Optional[np.ndarray] = None):
    self.out, self.split, self.tok, self.size = out, split, tok, size
    self.dtype = shard_dtype(tok.vocab_size)
    self.shards = list(shards)
    self.total = sum(s["tokens"] for s in self.shards)
    self.f = None
    self.n = 0
    self._carry: list = []
    if carry is not None and carry.size:
      self.add(carry)

  def _open(self) -> None:
    self.name = f"{self.split}_{len(self.shards):03d}"
    self.f, self.n, self.sha = open(self.out / f"{self.name}.bin", "wb"), 0, hashlib.sha256()

  def add(self, arr: np.ndarray) -> bool:
    """Adds tokens; True when a shard was completed."""
    closed = False
    while arr.size:
      if self.f is None:
        self._open()
      part, arr = arr[:self.size - self.n], arr[self.size - self.n:]
      data = part.astype(self.dtype).tobytes()
      self.f.write(data)
      self.sha.update(data)
      self.n += part.size
      self.total += part.size
      if closed:
        self._carry.append(part)
      if self.n == self.size:
        self.close_shard()
        closed, self._carry = True, []
    return closed

  def carry(self) -> np.ndarray:
    return np.concatenate(self._carry) if self._carry else np.zeros((0,), np.uint32)

  def close_shard(self, final: bool = False) -> None:
    """Completes the open shard (at the end: also writes an empty split's one shard)."""
    if self.f is None and final and not self.shards:
      self._open()
    if self.f is None:
      return
    self.f.close()
    self.f = None
    header = shard_header(self.n, self.tok.vocab_size, self.tok.name, separator=self.tok.sep)
    (self.out / f"{self.name}.json").write_text(json.dumps(header))
    self.shards.append({"file": f"{self.name}.bin", "tokens": self.n,
                        "sha256": self.sha.hexdigest()})


def write_manifest(out: pathlib.Path, inp: pathlib.Path, files: list, tok, writers: dict,
                   skipped: dict, text_bytes: int, text_field: str, val_fraction: float,
                   dedup: Optional[dict] = None) -> dict:
  """Closes the writers' last shards and writes ``OUT/manifest.json``; returns it. ``dedup``
  (the ``--dedup`` record) is written too and enters the content hash."""
  for w in writers.values():
    w.close_shard(final=True)
  tok_hash = (hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
              if (out / "tokenizer.json").is_file() else tok.name)
  content = hashlib.sha256(tok_hash.encode())
  for s in ("train", "val"):
    for sh in writers[s].shards:
      content.update(sh["sha256"].encode())
  if dedup is not None:
    content.update(f"dedup {dedup['threshold']} {dedup['jaccard']} {dedup['lsh_jaccard']} "
                   f"{dedup['num_perm']}".encode())
  input_bytes = sum(p.stat().st_size for _, p in files)
  manifest = {
      "format": "scaleopt-corpus", "version": 1, "input": str(inp),
      "files": [{"path": rel, "bytes": p.stat().st_size} for rel, p in files],
      "input_bytes": input_bytes, "text_bytes": text_bytes, "tokenizer": tok.name,
      "tokenizer_sha256": tok_hash, "vocab_size": tok.vocab_size, "separator": tok.sep,
      "text_field": text_field, "val_fraction": val_fraction,
      "splits": {s: {"tokens": w.total, "shards": w.shards} for s, w in writers.items()},
      "skipped": skipped, **({"dedup": dedup} if dedup is not None else {}),
      "content_hash": content.hexdigest()}
  (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
  return manifest
