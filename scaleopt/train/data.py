"""Token data: the embedded corpus, token shards, ``scaleopt data prepare`` and the iterator.

Embedded corpus (no network): the ``.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``, without ``site-packages``, ``test``/``tests``,
``idlelib`` and ``__pycache__``), sorted by relative path, byte-tokenized (vocab 256) with a
``0`` byte between files. A file is in the validation split iff
``zlib.crc32(relative_path.encode()) % 20 == 0`` (about 5%), so the rule -- and, for one
Python version, the split -- is the same on every machine.

Shard format (written by ``scaleopt data prepare``, easy to write from other tools):

  DIR/train_000.bin   raw little-endian tokens, uint16 (vocab <= 65536) or uint32
  DIR/train_000.json  {"format": "scaleopt-tokens", "version": 1, "dtype": "uint16",
                       "num_tokens": N, "vocab_size": V, "tokenizer": "bytes",
                       "separator": 0}
  DIR/val_000.bin, DIR/val_000.json   the validation split, same format
  DIR/tokenizer.json  (BPE tokenizers) the Hugging Face tokenizer, for decoding

``vocab_size`` is the tokenizer's (max id + 1); a model must have at least that many rows.
Tokenizers live in :mod:`scaleopt.train.tokenizers`.

A ``.bin`` must hold exactly ``num_tokens * itemsize`` bytes; anything else is an error that
names the file. nanoGPT-style ``train.bin``/``val.bin`` work once a ``.json`` is put next to
them. Documents are separated by the tokenizer's separator token (``0`` for bytes).

Batches: the token stream of a split is cut into non-overlapping windows of ``seq_len + 1``
tokens (stride ``seq_len``; windows never cross a shard boundary). Epoch ``e`` visits the
windows in the order ``default_rng([seed, e]).permutation``; chunk ``k`` is global sequences
``[k C, (k+1) C)`` of that endless order. The iterator state is the next chunk index, so the
same seed gives the same batches and resuming is exact. Each process reads only its rows.

Evaluation: ``eval_set`` picks a fixed list of validation windows by the data alone (a fixed
permutation, never the batch size or a run's seed) and hashes it; ``heldout_part`` cuts the
validation split by document into the ``val`` and ``test`` parts studies use.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import sys
import sysconfig
import zlib
from typing import Callable, Iterator, Optional

import numpy as np

from scaleopt.train import tokenizers

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
# Shards.


def write_shard(path: pathlib.Path, tokens: np.ndarray, vocab_size: int, tokenizer: str,
                **extra) -> None:
  """``PATH.bin`` (uint16 when vocab_size <= 65536, else uint32) and its ``PATH.json``."""
  dtype = np.uint16 if vocab_size <= 65536 else np.uint32
  arr = np.asarray(tokens).astype(dtype)
  path = pathlib.Path(path)
  path.with_suffix(".bin").write_bytes(arr.astype(arr.dtype.newbyteorder("<")).tobytes())
  header = dict(format=FORMAT, version=1, dtype=np.dtype(dtype).name, num_tokens=int(arr.size),
                vocab_size=int(vocab_size), tokenizer=tokenizer, **extra)
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
  arr = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n,))
  check_token_range(arr, int(head["vocab_size"]), bin_path)
  return arr, head


def check_token_range(arr: np.ndarray, vocab_size: int, path, chunk: int = 1 << 24) -> None:
  """DataError naming the file and the first position of a token >= ``vocab_size``.

  Reads the shard once, ``chunk`` tokens at a time (about 1 s per GB from the page cache).
  """
  for i in range(0, arr.size, chunk):
    part = np.asarray(arr[i:i + chunk])
    if part.size and part.max() >= vocab_size:
      j = int(np.argmax(part >= vocab_size))
      raise DataError(f"token shard {str(path)!r} holds token {int(part[j])} at position "
                      f"{i + j}, outside its header's vocab_size={vocab_size}")


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


SKIP_DIRS = (".git",)  # never descended into
SKIP_SUFFIXES = (".pyc",)


def is_binary(data: bytes) -> bool:
  """A file that is not text: it holds a NUL byte (git's rule) or is not valid UTF-8."""
  if b"\0" in data:
    return True
  try:
    data.decode("utf-8")
  except UnicodeDecodeError:
    return True
  return False


def input_files(inp: pathlib.Path) -> tuple[list[tuple[str, pathlib.Path]],
                                            collections.Counter]:
  """(relative path, path) of the input files, sorted, and counts of what was skipped
  (``.git/`` directories and ``.git`` files, ``.pyc`` files; binary files are counted when
  read)."""
  skipped: collections.Counter = collections.Counter()
  if inp.is_file():
    return [(inp.name, inp)], skipped
  if not inp.is_dir():
    raise DataError(f"input {str(inp)!r} is neither a file nor a directory")
  out = []
  for root, dirs, names in os.walk(inp):
    for d in [d for d in dirs if d in SKIP_DIRS]:
      dirs.remove(d)
      skipped[f"{d}/ directories"] += 1
    for n in names:
      p = pathlib.Path(root) / n
      if n in SKIP_DIRS:  # a worktree's or submodule's .git file
        skipped[f"{n} files"] += 1
      elif p.suffix in SKIP_SUFFIXES:
        skipped[f"{p.suffix} files"] += 1
      elif p.is_file():
        out.append((p.relative_to(inp).as_posix(), p))
  return sorted(out), skipped


def _documents(files: list, skipped: Optional[collections.Counter] = None) -> Iterator[bytes]:
  """The text of each file, binary files left out (and counted in ``skipped``)."""
  for _, p in files:
    text = p.read_bytes()
    if is_binary(text):
      if skipped is not None:
        skipped["binary files"] += 1
      continue
    yield text


def _split_documents(files: list, skipped: collections.Counter) -> tuple[Callable, list[bytes]]:
  """(train documents factory, validation documents). One file: its last ~5% of lines are
  validation; a directory: the crc32 file rule of ``is_val``."""
  if len(files) == 1:
    text = files[0][1].read_bytes()
    if is_binary(text):
      raise DataError(f"input {str(files[0][1])!r} is a binary file (a NUL byte or not UTF-8)")
    lines = text.splitlines(keepends=True)
    cut = max(1, int(len(lines) * 0.95))
    train, val = b"".join(lines[:cut]), b"".join(lines[cut:])
    return (lambda skipped=None: iter([train])), [val] if val else []
  sp = split_files(files)
  return (lambda skipped=None: _documents(sp["train"], skipped)), list(
      _documents(sp["val"], skipped))


class _ShardWriter:
  """Cuts a stream of token arrays into ``SPLIT_000.bin``, ``SPLIT_001.bin``, ..."""

  def __init__(self, out: pathlib.Path, split: str, tok, shard_tokens: int):
    for old in list(out.glob(f"{split}_*.bin")) + list(out.glob(f"{split}_*.json")):
      old.unlink()
    self.out, self.split, self.tok, self.size = out, split, tok, shard_tokens
    self.buf: list[np.ndarray] = []
    self.n = self.total = self.shards = 0

  def add(self, arr: np.ndarray) -> None:
    self.buf.append(arr)
    self.n += arr.size
    self.total += arr.size
    while self.n >= self.size:
      cat = np.concatenate(self.buf)
      self._write(cat[:self.size])
      self.buf, self.n = [cat[self.size:]], cat.size - self.size

  def _write(self, toks: np.ndarray) -> None:
    write_shard(self.out / f"{self.split}_{self.shards:03d}", toks, self.tok.vocab_size,
                self.tok.name, separator=self.tok.sep)
    self.shards += 1

  def close(self) -> int:
    if self.n or not self.shards:
      self._write(np.concatenate(self.buf) if self.buf else np.zeros((0,), np.uint32))
    return self.total


def prepare(inp: str | pathlib.Path, out: str | pathlib.Path, tokenizer: str = "bytes",
            shard_tokens: int = 1 << 28) -> dict:
  """Tokenizes a text file or directory into shards; returns a summary dict.

  Skips ``.git/``, ``.pyc`` and binary files (counted in ``summary["skipped"]``); refuses an
  empty validation or training split. ``tokenizer`` is a spec of
  :func:`scaleopt.train.tokenizers.from_spec` (``bytes``, ``bpe:VOCAB``, a tokenizer.json).
  """
  inp, out = pathlib.Path(inp), pathlib.Path(out)
  files, skipped = input_files(inp)
  if not files:
    raise DataError(f"input {str(inp)!r} holds no usable files (skipped: {dict(skipped)})")
  train_docs, val_docs = _split_documents(files, skipped)
  if not any(val_docs):
    raise DataError(
        f"input {str(inp)!r}: the validation split would be empty (a directory's files go to "
        "validation when crc32(relative path) % 20 == 0, a single file gives its last 5% of "
        f"lines; {len(files)} files here); add files or lines")
  try:
    tok = tokenizers.from_spec(tokenizer, train_texts=train_docs)
  except tokenizers.TokenizerError as e:
    raise DataError(str(e)) from None
  out.mkdir(parents=True, exist_ok=True)
  (out / "tokenizer.json").unlink(missing_ok=True)
  tok.save(out)
  summary = {"vocab_size": tok.vocab_size, "tokenizer": tok.name, "files": len(files)}
  for split, docs in (("val", val_docs), ("train", train_docs(skipped))):
    w = _ShardWriter(out, split, tok, shard_tokens)
    for arr in tok.encode_docs(docs):
      w.add(arr)
    summary[f"{split}_tokens"] = w.close()
  if summary["train_tokens"] == 0:
    raise DataError(f"input {str(inp)!r}: the training split is empty")
  summary["skipped"] = dict(skipped)
  return summary


def _check_prepare_args(inp: str, out: str) -> None:
  """The paths, checked before anything is written (the tokenizer spec: ``prepare``)."""
  if not pathlib.Path(inp).exists():
    raise DataError(f"input {inp!r} does not exist")
  if pathlib.Path(out).exists() and not pathlib.Path(out).is_dir():
    raise DataError(f"--out {out!r} is a file, not a directory")


def prepare_main(input: str, out: str, tokenizer: str = "bytes") -> int:
  """``scaleopt data prepare``: tokenize and write shards; 0 on success, 2 on bad input (then
  an output directory this call created is removed again)."""
  created = not pathlib.Path(out).exists()
  try:
    _check_prepare_args(input, out)
    s = prepare(input, out, tokenizer)
  except (DataError, ValueError, OSError) as e:
    if created and pathlib.Path(out).is_dir():
      shutil.rmtree(out, ignore_errors=True)
    print(f"error: {e}", file=sys.stderr)
    return 2
  skipped = ", ".join(f"{n} {what}" for what, n in sorted(s["skipped"].items()))
  print(f"wrote {out}: {s['train_tokens']} train / {s['val_tokens']} val tokens from "
        f"{s['files']} files, vocab {s['vocab_size']} ({s['tokenizer']})"
        + (f"; skipped {skipped}" if skipped else ""))
  return 0

# ---------------------------------------------------------------------------------------------
# The iterator.


class Windows:
  """Non-overlapping (seq_len + 1)-token windows over a list of token arrays."""

  def __init__(self, arrays: list[np.ndarray], seq_len: int, name: str = "data",
               sep: Optional[int] = None):
    self.arrays, self.seq_len, self.sep = arrays, seq_len, sep  # sep: the document separator
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


HELDOUT_PARTS = ("val", "test")


def _documents_of(a: np.ndarray, sep: Optional[int]) -> list[np.ndarray]:
  """The documents of one token array, each with its trailing separator (the whole array
  when ``sep`` is None)."""
  if sep is None:
    return [a] if a.size else []
  ends = np.flatnonzero(np.asarray(a) == sep) + 1
  if not ends.size or ends[-1] != a.size:
    ends = np.append(ends, a.size)
  starts = np.concatenate([[0], ends[:-1]])
  return [a[s:e] for s, e in zip(starts, ends) if e > s]


def heldout_part(windows: Windows, part: str) -> Windows:
  """One of two disjoint parts of the held-out split, for studies that select hyperparameters
  on one part (``"val"``) and report on the other (``"test"``). The split is by document:
  the held-out split's documents (ended by its separator token; each shard is one document
  where the shards name none), numbered in order across its shards, go to ``val`` when even
  and to ``test`` when odd; each part's windows are cut from its own documents, so no
  document and no window is in both. Ordinary training evaluates on the whole split."""
  if part not in HELDOUT_PARTS:
    raise ValueError(f"held-out part {part!r}; allowed: {HELDOUT_PARTS}")
  pick, k, arrays = HELDOUT_PARTS.index(part), 0, []
  for a in windows.arrays:
    docs = _documents_of(a, windows.sep)
    mine = docs[(pick - k) % 2::2]
    k += len(docs)
    arrays.append(np.concatenate(mine) if mine else np.zeros((0,), a.dtype))
  try:
    return Windows(arrays, windows.seq_len, f"held-out {part} part", windows.sep)
  except DataError:
    raise DataError(f"the {part} part of the held-out split (its "
                    f"{'even' if pick == 0 else 'odd'}-numbered documents of {k}) holds no "
                    f"window of seq_len + 1 = {windows.seq_len + 1} tokens; a val/test split "
                    "by document needs more held-out documents") from None


EVAL_SEED = 0x5CA1E  # the fixed order in which evaluation windows are chosen (never a run seed)


@dataclasses.dataclass(frozen=True)
class EvalSet:
  """A fixed list of held-out windows: ``index`` (sorted) into ``windows``; ``ident`` is a
  hash of ``seq_len`` and the windows' tokens, the same for every run scored on this set."""
  windows: Windows
  index: np.ndarray
  ident: str

  @property
  def n(self) -> int:
    return int(self.index.size)

  def microbatches(self, size: int, process_index: int = 0, process_count: int = 1
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 [m, size / process_count, seq_len + 1], valid bool [m, size]): the set
    in microbatches of ``size`` windows (this process's rows of each), the last one padded
    with copies of the first window that ``valid`` marks False."""
    m = -(-self.n // size)
    g = np.arange(m * size).reshape(m, size)
    valid = g < self.n
    local = size // process_count
    mine = g[:, process_index * local:(process_index + 1) * local]
    idx = self.index[np.where(mine < self.n, mine, 0)]
    return self.windows.get(idx.ravel()).reshape(m, local, -1), valid

  def mean(self, ce: np.ndarray) -> float:
    """The set's loss from the eval step's per-window CE ``[..., m, size]`` (padding left
    out; leading axes kept, e.g. vmapped cells)."""
    ce = np.asarray(ce, np.float64)
    flat = ce.reshape(*ce.shape[:-2], -1)[..., :self.n]
    return flat.mean(axis=-1)


def eval_set(windows: Windows, eval_tokens: int) -> Optional[EvalSet]:
  """The evaluation set of ``eval_tokens`` target tokens (``eval_tokens // seq_len`` windows,
  at least one; None for 0): the first windows of the fixed permutation
  ``default_rng(EVAL_SEED).permutation(windows.n)``, in index order. It depends on the data,
  ``seq_len`` and ``eval_tokens`` only (never on the batch size or a run's seed); a smaller
  set is a subset of a larger one; no window is in it twice (a request beyond the split
  takes all of it)."""
  if eval_tokens <= 0:
    return None
  k = min(windows.n, max(1, eval_tokens // windows.seq_len))
  index = np.sort(np.random.default_rng(EVAL_SEED).permutation(windows.n)[:k])
  h = hashlib.sha256(f"scaleopt-eval seq_len={windows.seq_len}\n".encode())
  for lo in range(0, k, 256):
    h.update(windows.get(index[lo:lo + 256]).astype("<i4").tobytes())
  return EvalSet(windows, index, h.hexdigest()[:16])


def heldout_eval_sets(windows: Windows, eval_tokens: int) -> dict:
  """``{"val": EvalSet | None, "test": ...}``: the evaluation set of each held-out part."""
  return {p: eval_set(heldout_part(windows, p), eval_tokens) for p in HELDOUT_PARTS}


def _separator(path: str, split: str) -> Optional[int]:
  """The document separator the split's first shard header names (None: not named)."""
  heads = sorted(pathlib.Path(path).glob(f"{split}*.json"))
  sep = json.loads(heads[0].read_text()).get("separator") if heads else None
  return None if sep is None else int(sep)


def open_split(source: str, path: Optional[str], split: str, seq_len: int
               ) -> tuple[Windows, int]:
  """(windows, vocab size) of one split of the configured source."""
  if source == "embedded":
    return Windows([embedded_tokens(split)], seq_len, f"embedded corpus ({split})", SEP), 256
  arrays, vocab = load_shards(path, split)
  return Windows(arrays, seq_len, f"{path} ({split})", _separator(path, split)), vocab
