"""Token data: the embedded corpus, token shards, tokenizers and the batch iterator.

Embedded corpus (no network): the ``.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``, without ``site-packages``, ``test``/``tests``,
``idlelib`` and ``__pycache__``), sorted by relative path, byte-tokenized (vocab 256) with a
``0`` byte between files. A file is in the validation split iff
``zlib.crc32(relative_path.encode()) % 20 == 0`` (about 5%), so the rule -- and, for one
Python version, the split -- is the same on every machine.

Shard format (written by ``scaleopt data prepare``, easy to write from other tools):

  DIR/train_000.bin   raw little-endian tokens, uint16 (vocab <= 65536) or uint32
  DIR/train_000.json  {"format": "scaleopt-tokens", "version": 1, "dtype": "uint16",
                       "num_tokens": N, "vocab_size": V, "tokenizer": "bytes"}
  DIR/val_000.bin, DIR/val_000.json   the validation split, same format
  DIR/tokenizer.json  (BPE only) the merges, for decoding

A ``.bin`` must hold exactly ``num_tokens * itemsize`` bytes; anything else is an error that
names the file. nanoGPT-style ``train.bin``/``val.bin`` work once a ``.json`` is put next to
them. Documents are separated by the tokenizer's separator token (``0`` for bytes).

Batches: the token stream of a split is cut into non-overlapping windows of ``seq_len + 1``
tokens (stride ``seq_len``; windows never cross a shard boundary). Epoch ``e`` visits the
windows in the order ``default_rng([seed, e]).permutation``; chunk ``k`` is global sequences
``[k C, (k+1) C)`` of that endless order. The iterator state is the next chunk index, so the
same seed gives the same batches and resuming is exact. Each process reads only its rows.
"""

from __future__ import annotations

import collections
import json
import pathlib
import re
import sys
import sysconfig
import zlib
from typing import Iterator, Optional

import numpy as np

SEP = 0  # document separator token for the byte tokenizer
_EXCLUDE = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
FORMAT = "scaleopt-tokens"


class DataError(ValueError):
  """Missing, corrupt or truncated data; the message names the path."""


# ---------------------------------------------------------------------------------------------
# Embedded corpus.


def is_val(relpath: str) -> bool:
  """The fixed split rule: about 5% of files, by a hash of the relative path."""
  return zlib.crc32(relpath.encode()) % 20 == 0


def stdlib_files() -> list[tuple[str, pathlib.Path]]:
  """(relative path, path) of every embedded-corpus file, sorted."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  out = []
  for p in root.rglob("*.py"):
    rel = p.relative_to(root)
    if _EXCLUDE & set(rel.parts[:-1]) or not p.is_file():
      continue
    out.append((rel.as_posix(), p))
  return sorted(out)


def split_files(files: list[tuple[str, pathlib.Path]]) -> dict[str, list]:
  return {"train": [f for f in files if not is_val(f[0])],
          "val": [f for f in files if is_val(f[0])]}


def _join_bytes(paths: list[pathlib.Path]) -> np.ndarray:
  parts = []
  for p in paths:
    parts.append(p.read_bytes())
    parts.append(bytes([SEP]))
  return np.frombuffer(b"".join(parts), np.uint8)


_EMBEDDED: dict[str, np.ndarray] = {}


def embedded_tokens(split: str) -> np.ndarray:
  """Byte tokens (uint8) of one split of the embedded corpus (cached per process)."""
  if split not in ("train", "val"):
    raise ValueError(f"split={split!r}; allowed: 'train', 'val'")
  if split not in _EMBEDDED:
    files = split_files(stdlib_files())
    for k, fs in files.items():
      _EMBEDDED[k] = _join_bytes([p for _, p in fs])
  return _EMBEDDED[split]


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
  """Entropy (nats) of the token frequencies: the loss of the best context-free model."""
  c = np.bincount(np.asarray(tokens).ravel(), minlength=vocab_size).astype(np.float64)
  p = c[c > 0] / c.sum()
  return float(-(p * np.log(p)).sum())


# ---------------------------------------------------------------------------------------------
# Tokenizers: bytes and a small locally trained byte-level BPE.

_PRETOK = re.compile(rb"\s?[A-Za-z_]+|\s?[0-9]+|\s+(?!\S)|\s+|[^\sA-Za-z_0-9]+")


def train_bpe(data: bytes, vocab_size: int) -> list[tuple[int, int]]:
  """Byte-level BPE merges learned on ``data`` (ids 256.. are merges, in order).

  Words (regex pre-tokens) are counted once; pair counts are kept per word type and updated
  only for the words a merge touches, so training is fast enough for a few MB in Python.
  """
  if vocab_size <= 256 or vocab_size > 65536:
    raise ValueError(f"bpe vocab size must be in (256, 65536], got {vocab_size}")
  words = collections.Counter(_PRETOK.findall(data))
  seqs = [list(w) for w in words]
  freq = [words[w] for w in words]
  pairs: collections.Counter = collections.Counter()
  where: dict[tuple[int, int], set] = collections.defaultdict(set)
  for i, s in enumerate(seqs):
    for a, b in zip(s, s[1:]):
      pairs[(a, b)] += freq[i]
      where[(a, b)].add(i)
  merges = []
  for new in range(256, vocab_size):
    if not pairs:
      break
    best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
    if pairs[best] <= 0:
      break
    merges.append(best)
    for i in list(where.pop(best, ())):
      s = seqs[i]
      for a, b in zip(s, s[1:]):
        pairs[(a, b)] -= freq[i]
        if pairs[(a, b)] <= 0:
          del pairs[(a, b)]
      j, out = 0, []
      while j < len(s):
        if j + 1 < len(s) and (s[j], s[j + 1]) == best:
          out.append(new); j += 2
        else:
          out.append(s[j]); j += 1
      seqs[i] = out
      for a, b in zip(out, out[1:]):
        pairs[(a, b)] += freq[i]
        where[(a, b)].add(i)
  return merges


def bpe_encode(data: bytes, merges: list[tuple[int, int]]) -> np.ndarray:
  """Encodes bytes with learned merges (word by word, cached per word type)."""
  rank = {p: 256 + r for r, p in enumerate(merges)}
  cache: dict[bytes, list[int]] = {}
  out: list[int] = []
  for w in _PRETOK.findall(data):
    ids = cache.get(w)
    if ids is None:
      ids = list(w)
      while len(ids) > 1:
        cand = [(rank.get((a, b), 1 << 30), k) for k, (a, b) in enumerate(zip(ids, ids[1:]))]
        r, k = min(cand)
        if r == 1 << 30:
          break
        ids = ids[:k] + [r] + ids[k + 2:]
      cache[w] = ids
    out.extend(ids)
  return np.asarray(out, np.uint32)


def bpe_decode(ids, merges: list[tuple[int, int]]) -> bytes:
  table = {i: bytes([i]) for i in range(256)}
  for r, (a, b) in enumerate(merges):
    table[256 + r] = table[a] + table[b]
  return b"".join(table[int(i)] for i in ids)


# ---------------------------------------------------------------------------------------------
# Shards.


def write_shard(path: pathlib.Path, tokens: np.ndarray, vocab_size: int, tokenizer: str):
  dtype = np.uint16 if vocab_size <= 65536 else np.uint32
  arr = np.asarray(tokens).astype(dtype)
  path = pathlib.Path(path)
  path.with_suffix(".bin").write_bytes(arr.astype(arr.dtype.newbyteorder("<")).tobytes())
  header = dict(format=FORMAT, version=1, dtype=np.dtype(dtype).name, num_tokens=int(arr.size),
                vocab_size=int(vocab_size), tokenizer=tokenizer)
  path.with_suffix(".json").write_text(json.dumps(header))


def read_shard(bin_path: pathlib.Path) -> tuple[np.ndarray, dict]:
  """Memory-maps one shard after checking its header and size."""
  bin_path = pathlib.Path(bin_path)
  head_path = bin_path.with_suffix(".json")
  if not bin_path.is_file():
    raise DataError(f"token shard {str(bin_path)!r} is missing")
  if not head_path.is_file():
    raise DataError(f"token shard header {str(head_path)!r} is missing (every .bin needs a "
                    f".json header; see scaleopt/train/data.py for the format)")
  try:
    head = json.loads(head_path.read_text())
    dtype = np.dtype(head["dtype"]).newbyteorder("<")
    n = int(head["num_tokens"])
    int(head["vocab_size"])
  except (ValueError, KeyError, TypeError) as e:
    raise DataError(f"token shard header {str(head_path)!r} is corrupt ({e!r}); it needs "
                    "dtype (uint16|uint32), num_tokens and vocab_size") from None
  if dtype.name not in ("uint16", "uint32"):
    raise DataError(f"token shard header {str(head_path)!r}: dtype {dtype.name!r}; allowed: "
                    "uint16, uint32")
  size = bin_path.stat().st_size
  if size != n * dtype.itemsize:
    raise DataError(f"token shard {str(bin_path)!r} is truncated or corrupt: {size} bytes, "
                    f"header says {n} tokens x {dtype.itemsize} bytes = {n * dtype.itemsize}")
  if n == 0:
    return np.zeros((0,), dtype), head
  return np.memmap(bin_path, dtype=dtype, mode="r", shape=(n,)), head


def load_shards(directory: str | pathlib.Path, split: str) -> tuple[list[np.ndarray], int]:
  """All shards of a split: (list of memmaps, vocab size)."""
  d = pathlib.Path(directory)
  if not d.is_dir():
    raise DataError(f"shard directory {str(d)!r} does not exist")
  bins = sorted(d.glob(f"{split}*.bin"))
  if not bins:
    raise DataError(f"shard directory {str(d)!r} has no {split}*.bin files (write them with "
                    "`scaleopt data prepare`)")
  arrays, vocab = [], 0
  for b in bins:
    arr, head = read_shard(b)
    arrays.append(arr)
    vocab = max(vocab, int(head["vocab_size"]))
  return arrays, vocab


def _input_files(inp: pathlib.Path) -> list[tuple[str, pathlib.Path]]:
  if inp.is_file():
    return [(inp.name, inp)]
  if inp.is_dir():
    return sorted((p.relative_to(inp).as_posix(), p) for p in inp.rglob("*") if p.is_file())
  raise DataError(f"input {str(inp)!r} is neither a file nor a directory")


def prepare(inp: str | pathlib.Path, out: str | pathlib.Path, tokenizer: str = "bytes",
            shard_tokens: int = 1 << 28) -> dict:
  """Tokenizes a text file or directory into shards; returns a summary dict."""
  inp, out = pathlib.Path(inp), pathlib.Path(out)
  if tokenizer == "bytes":
    vocab, merges = 256, None
  elif tokenizer.startswith("bpe:"):
    try:
      vocab = int(tokenizer[4:])
    except ValueError:
      raise DataError(f"--tokenizer {tokenizer!r}: expected bytes or bpe:VOCAB_SIZE") from None
    merges = []
  else:
    raise DataError(f"--tokenizer {tokenizer!r} is not allowed; choose bytes or bpe:VOCAB_SIZE")
  files = _input_files(inp)
  if not files:
    raise DataError(f"input {str(inp)!r} holds no files")
  if len(files) == 1:  # one file: the last ~5% of its lines are the validation split
    lines = files[0][1].read_bytes().splitlines(keepends=True)
    cut = max(1, int(len(lines) * 0.95)) if len(lines) > 1 else len(lines)
    texts = {"train": b"".join(lines[:cut]), "val": b"".join(lines[cut:])}
  else:
    sp = split_files(files)
    texts = {k: b"".join(p.read_bytes() + bytes([SEP]) for _, p in fs) for k, fs in sp.items()}
  out.mkdir(parents=True, exist_ok=True)
  if merges is not None:
    merges = train_bpe(texts["train"], vocab)
    vocab = 256 + len(merges)
    (out / "tokenizer.json").write_text(json.dumps({"kind": "bpe", "merges": merges}))
  summary = {"vocab_size": vocab, "tokenizer": tokenizer}
  for split, text in texts.items():
    toks = (np.frombuffer(text, np.uint8) if merges is None else bpe_encode(text, merges))
    for old in out.glob(f"{split}_*.bin"):
      old.unlink()
    n_shards = max(1, -(-toks.size // shard_tokens))
    for s in range(n_shards):
      write_shard(out / f"{split}_{s:03d}", toks[s * shard_tokens:(s + 1) * shard_tokens],
                  vocab, tokenizer)
    summary[f"{split}_tokens"] = int(toks.size)
  return summary


def prepare_main(input: str, out: str, tokenizer: str = "bytes") -> int:
  """``scaleopt data prepare``: tokenize and write shards; 0 on success, 2 on bad input."""
  try:
    s = prepare(input, out, tokenizer)
  except DataError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {out}: {s['train_tokens']} train / {s['val_tokens']} val tokens, "
        f"vocab {s['vocab_size']} ({s['tokenizer']})")
  return 0


# ---------------------------------------------------------------------------------------------
# The iterator.


class Windows:
  """Non-overlapping (seq_len + 1)-token windows over a list of token arrays."""

  def __init__(self, arrays: list[np.ndarray], seq_len: int, name: str = "data"):
    self.arrays, self.seq_len = arrays, seq_len
    counts = np.array([max(0, (a.size - 1) // seq_len) for a in arrays], np.int64)
    self.starts = np.concatenate([[0], np.cumsum(counts)])
    self.n = int(self.starts[-1])
    if self.n == 0:
      total = sum(a.size for a in arrays)
      raise DataError(f"{name}: {total} tokens hold no window of seq_len + 1 = {seq_len + 1} "
                      "tokens")

  def get(self, idx: np.ndarray) -> np.ndarray:
    """Windows ``idx`` (int array) as int32 [len(idx), seq_len + 1]."""
    out = np.empty((idx.size, self.seq_len + 1), np.int32)
    shard = np.searchsorted(self.starts, idx, side="right") - 1
    for r, (s, i) in enumerate(zip(shard, idx)):
      o = (i - self.starts[s]) * self.seq_len
      out[r] = self.arrays[s][o:o + self.seq_len + 1]
    return out


class Batches:
  """Deterministic, resumable batches in the microbatch layout the optimizer asks for.

  ``next()`` returns ``{"tokens": int32 [m, b_local, seq_len + 1]}`` (plus ``"b_tokens"`` of
  the same shape for rolling-B), where m = microbatches x groups and b_local is this
  process's share of the microbatch size. ``state()``/``restore()`` carry the position.

  Args:
    windows: the training split.
    batch_size: sequences per group and step.
    microbatches: microbatches per group.
    groups: groups per step (2 for the A/B and symmetric layouts, else 1).
    rolling_b: step t gets chunk t as A and chunk t+1 as B (one chunk per step).
    seed: shuffling seed.
    process_index, process_count: this process's rows of every microbatch.
  """

  def __init__(self, windows: Windows, batch_size: int, microbatches: int, *, groups: int = 1,
               rolling_b: bool = False, seed: int = 0, process_index: int = 0,
               process_count: int = 1):
    mb = batch_size // microbatches
    if batch_size % microbatches:
      raise DataError(f"batch_size={batch_size} is not divisible by microbatches={microbatches}")
    if mb % process_count:
      raise DataError(f"microbatch size {mb} is not divisible by the process count "
                      f"{process_count}")
    self.w, self.seed, self.rolling_b = windows, seed, rolling_b
    self.m = microbatches * groups
    self.mb, self.local = mb, mb // process_count
    self.p = process_index
    self.chunk = 0
    self._perm_epoch, self._perm = -1, None

  def _perm_for(self, epoch: int) -> np.ndarray:
    if epoch != self._perm_epoch:
      self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.w.n)
      self._perm_epoch = epoch
    return self._perm

  def _rows(self, k: int) -> np.ndarray:
    """Local rows of chunk k: [m, b_local, seq_len + 1]."""
    j = np.arange(self.m)[:, None] * self.mb + self.p * self.local + np.arange(self.local)
    g = k * self.m * self.mb + j.ravel()  # global sequence numbers
    epoch, pos = np.divmod(g, self.w.n)
    idx = np.empty_like(g)
    for e in np.unique(epoch):
      sel = epoch == e
      idx[sel] = self._perm_for(int(e))[pos[sel]]
    return self.w.get(idx).reshape(self.m, self.local, -1)

  def next(self) -> dict:
    out = {"tokens": self._rows(self.chunk)}
    if self.rolling_b:
      out["b_tokens"] = self._rows(self.chunk + 1)
    self.chunk += 1
    return out

  def __iter__(self) -> Iterator[dict]:
    while True:
      yield self.next()

  def state(self) -> dict:
    return {"chunk": int(self.chunk), "seed": int(self.seed)}

  def restore(self, state: dict) -> None:
    if int(state.get("seed", self.seed)) != self.seed:
      raise DataError(f"checkpointed data seed {state['seed']} != configured seed {self.seed}")
    self.chunk = int(state["chunk"])


def eval_batches(windows: Windows, batch_size: int, num: int, process_index: int = 0,
                 process_count: int = 1) -> list[np.ndarray]:
  """The fixed evaluation set: the first ``num * batch_size`` windows (wrapping), in order."""
  local = batch_size // process_count
  out = []
  for k in range(num):
    g = k * batch_size + process_index * local + np.arange(local)
    out.append(windows.get(g % windows.n))
  return out


def open_split(source: str, path: Optional[str], split: str, seq_len: int
               ) -> tuple[Windows, int]:
  """(windows, vocab size) of one split of the configured source."""
  if source == "embedded":
    return Windows([embedded_tokens(split)], seq_len, f"embedded corpus ({split})"), 256
  arrays, vocab = load_shards(path, split)
  return Windows(arrays, seq_len, f"{path} ({split})"), vocab
