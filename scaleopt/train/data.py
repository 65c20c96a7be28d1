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
  DIR/manifest.json   (written by ``data prepare``) inputs, tokens, shard hashes, content hash

``vocab_size`` is the tokenizer's (max id + 1); a model must have at least that many rows.
Tokenizers live in :mod:`scaleopt.train.tokenizers`, the readers of ``data prepare`` (text,
JSONL, Parquet, Arrow) in :mod:`scaleopt.train.prepare`. ``DIR`` may be a URL (``gs://``,
``s3://``, ``memory://``, any fsspec file system): shards are then read by byte ranges.

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
import sys
import sysconfig
import zlib
from typing import Iterator, Optional

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
  arr = np.asarray(tokens).astype(shard_dtype(vocab_size))
  path = pathlib.Path(path)
  path.with_suffix(".bin").write_bytes(arr.tobytes())
  path.with_suffix(".json").write_text(json.dumps(shard_header(arr.size, vocab_size, tokenizer,
                                                               **extra)))


def shard_dtype(vocab_size: int) -> np.dtype:
  """Little-endian uint16 up to 65,536 ids, else uint32."""
  return np.dtype("<u2" if vocab_size <= 65536 else "<u4")


def shard_header(num_tokens: int, vocab_size: int, tokenizer: str, **extra) -> dict:
  """The ``.json`` header of a shard of ``num_tokens`` tokens."""
  return dict(format=FORMAT, version=1, dtype=shard_dtype(vocab_size).name,
              num_tokens=int(num_tokens), vocab_size=int(vocab_size), tokenizer=tokenizer,
              **extra)


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


def is_url(path) -> bool:
  """``scheme://...`` (gs://, s3://, memory://, file://, ...): read through fsspec."""
  head, sep, _ = str(path).partition("://")
  return bool(sep) and head.replace("+", "").replace("-", "").replace(".", "").isalnum()


def load_shards(directory: str | pathlib.Path, split: str) -> tuple[list[np.ndarray], int]:
  """All shards of a split: (list of memmaps -- or of ``RemoteTokens`` for a URL --, vocab
  size)."""
  if is_url(directory):
    return _load_remote_shards(str(directory), split)
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


class RemoteTokens:
  """One shard on an fsspec file system, read by byte ranges: ``arr[a:b]`` fetches tokens
  ``[a, b)``; ``Windows`` fetches a batch's rows in one ``cat_ranges`` call."""

  def __init__(self, fs, path: str, dtype: np.dtype, n: int):
    self.fs, self.path, self.dtype, self.size = fs, path, dtype, n

  def __getitem__(self, sl: slice) -> np.ndarray:
    a, b, _ = sl.indices(self.size)
    return self.read_many([(self, a, max(a, b))])[0]

  @staticmethod
  def read_many(parts: list) -> list[np.ndarray]:
    """[(shard, first token, end token)] -> token arrays, one request batch per file system."""
    if not parts:
      return []
    fs, k = parts[0][0].fs, parts[0][0].dtype.itemsize
    blobs = fs.cat_ranges([p.path for p, _, _ in parts], [a * k for _, a, _ in parts],
                          [b * k for _, _, b in parts])
    for (p, _, _), blob in zip(parts, blobs):
      if isinstance(blob, Exception):
        raise DataError(f"token shard {p.fs.unstrip_protocol(p.path)!r} cannot be read "
                        f"({blob})")
    return [np.frombuffer(b, p.dtype) for (p, _, _), b in zip(parts, blobs)]


def _load_remote_shards(url: str, split: str) -> tuple[list, int]:
  """The shards of a split under a URL: headers checked as for local shards, tokens read on
  demand (``RemoteTokens``)."""
  try:
    import fsspec
  except ImportError:
    raise DataError(f"data.path {url!r}: reading shards from a URL needs `fsspec` (and its "
                    "gcsfs / s3fs backend)") from None
  try:
    fs, root = fsspec.core.url_to_fs(url)
    bins = sorted(fs.glob(root.rstrip("/") + f"/{split}*.bin"))
  except (ImportError, ValueError, OSError) as e:
    raise DataError(f"data.path {url!r} cannot be listed ({e})") from None
  if not bins:
    raise DataError(f"shard directory {url!r} has no {split}*.bin files (or does not exist)")
  arrays, vocab = [], 0
  for b in bins:
    name = fs.unstrip_protocol(b)
    try:
      head = json.loads(fs.cat_file(b[:-4] + ".json"))
      dtype = np.dtype(head["dtype"]).newbyteorder("<")
      n, v = int(head["num_tokens"]), int(head["vocab_size"])
      size = fs.size(b)
    except FileNotFoundError:
      raise DataError(f"token shard header of {name!r} is missing (every .bin needs a .json "
                      "header)") from None
    except (ValueError, KeyError, TypeError) as e:
      raise DataError(f"token shard header of {name!r} is corrupt ({e!r})") from None
    if dtype.name not in ("uint16", "uint32") or size != n * dtype.itemsize:
      raise DataError(f"token shard {name!r} is truncated or corrupt: {size} bytes, header "
                      f"says {n} tokens of {dtype.name}")
    arr = RemoteTokens(fs, b, dtype, n)
    check_token_range(arr, v, name)
    arrays.append(arr)
    vocab = max(vocab, v)
  return arrays, vocab


def prepare(inp: str | pathlib.Path, out: str | pathlib.Path, tokenizer: str = "bytes",
            shard_tokens: Optional[int] = None, **options) -> dict:
  """Tokenizes text, JSONL, Parquet or Arrow inputs into shards (:mod:`scaleopt.train.prepare`;
  ``options``: the fields of its ``Options``); returns a summary dict."""
  from scaleopt.train import prepare as prep
  return prep.prepare(inp, out, tokenizer, shard_tokens, prep.Options(**options))


def prepare_main(input: str, out: str, tokenizer: str = "bytes", **options) -> int:
  """``scaleopt data prepare`` (:func:`scaleopt.train.prepare.main`): 0, or 2 on bad input."""
  from scaleopt.train import prepare as prep
  return prep.main(input, out, tokenizer, **options)


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
    offsets = (idx - self.starts[shard]) * self.seq_len
    if self.arrays and isinstance(self.arrays[0], RemoteTokens):  # one request batch
      parts = [(self.arrays[s], o, o + self.seq_len + 1) for s, o in zip(shard, offsets)]
      for r, row in enumerate(RemoteTokens.read_many(parts)):
        out[r] = row
      return out
    for r, (s, o) in enumerate(zip(shard, offsets)):
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
  if is_url(path):
    import fsspec
    fs, root = fsspec.core.url_to_fs(path)
    heads = sorted(fs.glob(root.rstrip("/") + f"/{split}*.json"))
    sep = json.loads(fs.cat_file(heads[0])).get("separator") if heads else None
  else:
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
