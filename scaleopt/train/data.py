"""Token data: the embedded corpus, the splits of token shards, the batch iterator and the
fixed evaluation sets.

Embedded corpus (no network): the ``.py`` files of the running interpreter's standard library
(``sysconfig.get_paths()["stdlib"]``, without ``site-packages``, ``test``/``tests``,
``idlelib`` and ``__pycache__``), sorted by relative path, byte-tokenized (vocab 256) with a
``0`` byte between files. A file is in the validation split iff
``zlib.crc32(relative_path.encode()) % 20 == 0`` (about 5%), so the rule -- and, for one
Python version, the split -- is the same on every machine.

Token shards: the format is :mod:`scaleopt.train.shards` (its names are also reached here:
``DataError``, ``read_shard``, ``load_shards``, ...), written by ``scaleopt data prepare``
(:mod:`scaleopt.train.prepare`: readers of text, JSONL, Parquet and Arrow, tokenizing, the
document split); tokenizers live in :mod:`scaleopt.train.tokenizers`.

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

import dataclasses
import hashlib
import json
import pathlib
import sysconfig
import zlib
from typing import Iterator, Optional

import numpy as np

from scaleopt.train import tokenizers
# the shard format's names, also reached through this module
from scaleopt.train.shards import (FORMAT, DataError, RemoteTokens, check_token_range,  # noqa: F401
                                   is_url, load_shards, read_shard, shard_dtype,
                                   shard_header, write_shard)

SEP = 0  # document separator token for the byte tokenizer
_EXCLUDE = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


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
