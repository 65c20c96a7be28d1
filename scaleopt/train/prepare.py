"""``scaleopt data prepare``: text, JSONL, Parquet and Arrow inputs -> token shards.

Inputs (a file or a folder, walked in sorted order of relative paths):

  *.jsonl, *.ndjson (.gz, .zst)   one JSON object per line; the document is its ``text_field``
  *.parquet                       the document is the ``text_field`` column of each row
  *.arrow                         Arrow IPC files (stream or file format), the same column;
                                  a Hugging Face ``datasets.save_to_disk`` folder is such files
                                  plus ``state.json`` / ``dataset_info.json`` (left out; a
                                  ``DatasetDict``'s splits are all read, its
                                  ``dataset_dict.json`` left out)
  anything else (.gz, .zst)       text: the whole file is one document

Everything streams: a text file is read in pieces of about ``PIECE_BYTES`` cut after a line
break with no other white space on either side (the GPT-2, Qwen2 and Llama 3 pre-tokenizers
split there anyway, so a byte-level BPE gives the ids of the whole file), JSONL
line by line, Parquet and Arrow one record batch at a time. Memory is bounded by the pieces of
one encoding batch plus one shard, whatever the size of a file.

Held-out split, by document: a document is held out (``val``) iff the first 8 bytes of
``blake2b(key)`` as a big-endian integer are below ``val_fraction * 2**64``. The key of a record
(JSONL, Parquet, Arrow) is its text, so duplicated records fall on one side; the key of a text
file is its relative path, so its pieces stay together. A lone text file is one document; its
last ``val_fraction`` of lines are held out instead.

Restart: after each training shard the position in the inputs is saved under ``OUT/.prepare/``
(with the few tokens past the shard's end, and the validation tokens so far written as a
validation shard); running the same command again continues from there and writes the same
shards as an uninterrupted run. A finished run writes ``OUT/manifest.json``: the input files
and bytes, tokens per split, each shard's sha256 and a content hash over shards and tokenizer.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import gzip
import contextlib
import hashlib
import io
import json
import os
import pathlib
import queue
import sys
import threading
import time
from typing import Callable, Iterator, Optional

import numpy as np

from scaleopt.train import tokenizers
from scaleopt.train.data import DataError, shard_dtype, shard_header

PIECE_BYTES = 1 << 20  # a text file's piece
BATCH_BYTES = 16 << 20  # text per encoding batch (the Rust encoder spreads it over the cores)
BATCH_UNITS = 1024  # records per encoding batch
SKIP_DIRS = (".git",)  # never descended into
SKIP_SUFFIXES = (".pyc",)
HF_METADATA = ("state.json", "dataset_info.json", "dataset_dict.json")  # datasets' folders
STATE_DIR = ".prepare"
MANIFEST = "manifest.json"


@dataclasses.dataclass(frozen=True)
class Options:
  """``text_field``: the JSONL field / Parquet and Arrow column; ``val_fraction``: held-out
  share of documents; ``shard_tokens``: training tokens per shard; ``include``: glob patterns
  of file names to read in a folder (all when empty); ``bpe_sample_mb``: text a ``bpe:VOCAB``
  tokenizer is trained on (all the training text when None); ``progress``: a line on stderr
  every few seconds."""
  text_field: str = "text"
  val_fraction: float = 0.05
  shard_tokens: int = 1 << 28
  include: tuple = ()
  bpe_sample_mb: Optional[float] = None
  progress: bool = False


def is_heldout(key: bytes, fraction: float) -> bool:
  """The document split: blake2b(key)'s first 8 bytes below ``fraction * 2**64``."""
  h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
  return h < fraction * 2.0 ** 64


def is_binary(data: bytes) -> bool:
  """Not text: a NUL byte (git's rule) or not UTF-8."""
  if b"\0" in data:
    return True
  try:
    data.decode("utf-8")
  except UnicodeDecodeError:
    return True
  return False


# ---------------------------------------------------------------------------------------------
# Input files and their formats.


def file_format(name: str) -> tuple[str, Optional[str]]:
  """(format, compression) of a file name: format jsonl | parquet | arrow | text, compression
  gz | zst | None."""
  comp = next((c for c in ("gz", "zst") if name.endswith("." + c)), None)
  base = name[:-len(comp) - 1] if comp else name
  for fmt, suffixes in (("jsonl", (".jsonl", ".ndjson")), ("parquet", (".parquet",)),
                        ("arrow", (".arrow",))):
    if base.endswith(suffixes):
      return fmt, comp
  return "text", comp


def input_files(inp: pathlib.Path, include: tuple = ()) -> tuple[list, dict]:
  """(relative path, path) of the input files, sorted, and counts of what was left out
  (``.git/``, ``.pyc``, names outside ``include``, Hugging Face metadata next to .arrow)."""
  skipped: dict = {}
  count = lambda what: skipped.__setitem__(what, skipped.get(what, 0) + 1)
  if inp.is_file():
    return [(inp.name, inp)], skipped
  if not inp.is_dir():
    raise DataError(f"input {str(inp)!r} is neither a file nor a directory")
  out = []
  for root, dirs, names in os.walk(inp):
    for d in sorted(d for d in dirs if d in SKIP_DIRS):
      dirs.remove(d)
      count(f"{d}/ directories")
    arrow_here = any(n.endswith(".arrow") for n in names)
    for n in names:
      p = pathlib.Path(root) / n
      if n in SKIP_DIRS:  # a worktree's or submodule's .git file
        count(f"{n} files")
      elif p.suffix in SKIP_SUFFIXES:
        count(f"{p.suffix} files")
      elif n in HF_METADATA and (arrow_here or n == "dataset_dict.json"):
        count("datasets metadata files")
      elif include and not any(fnmatch.fnmatch(n, g) for g in include):
        count("files outside --include")
      elif p.is_file():
        out.append((p.relative_to(inp).as_posix(), p))
  return sorted(out), skipped


def _open(path: pathlib.Path, comp: Optional[str]):
  """A binary file object, decompressed as it is read."""
  if comp == "gz":
    return gzip.open(path, "rb")
  if comp == "zst":
    try:
      import zstandard
    except ImportError:
      raise DataError(f"input {str(path)!r}: .zst files need the `zstandard` package "
                      "(pip install zstandard)") from None
    raw = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
    return io.BufferedReader(raw, 1 << 20)  # readline
  return open(path, "rb")


@dataclasses.dataclass
class Unit:
  """A piece of input: ``text`` (UTF-8 bytes) of the document keyed ``key``; ``last``: the
  document ends here (a separator follows); ``split``: forced split (a lone text file);
  ``skip``: no text, a file left out (what to count it as)."""
  key: bytes
  text: bytes
  last: bool = True
  split: Optional[str] = None
  skip: Optional[str] = None


def _text_pieces(f, limit: Optional[int] = None) -> Iterator[bytes]:
  """The file in pieces of >= ``limit`` bytes (but the last), each cut after a line break
  with no white space on either side (or, past 4 x ``limit``, after any line break)."""
  limit = limit or PIECE_BYTES
  buf, size = [], 0
  while True:
    line = f.readline(limit)
    if not line:
      break
    if size >= limit and buf[-1].endswith(b"\n") and (
        size >= 4 * limit or (not line[:1].isspace() and not buf[-1][-2:-1].isspace())):
      yield b"".join(buf)
      buf, size = [], 0
    buf.append(line)
    size += len(line)
  if buf:
    yield b"".join(buf)


def _text_units(rel: str, path: pathlib.Path, comp, lines=None) -> Iterator[Unit]:
  """A text file as one document; ``lines`` = (cut, fraction) holds out its lines past cut."""
  with _open(path, comp) as f:
    first, n_line = True, 0
    pieces = ((p, None) for p in _text_pieces(f)) if lines is None else _line_pieces(f, lines)
    prev = None
    for piece, split in pieces:
      if is_binary(piece):
        if first:
          yield Unit(rel.encode(), b"", skip="binary files")
          return
        raise DataError(f"input {str(path)!r} is not UTF-8 text (or holds a NUL byte) after "
                        f"its first {n_line} bytes")
      first = False
      n_line += len(piece)
      if prev is not None:
        yield Unit(rel.encode(), prev[0], last=prev[1] != split, split=prev[1])
      prev = (piece, split)
    if prev is not None:
      yield Unit(rel.encode(), prev[0], last=True, split=prev[1])


def _line_pieces(f, cut: int) -> Iterator[tuple[bytes, str]]:
  """(piece, split) of a lone text file: lines [0, cut) train, the rest val."""
  buf, size, n = [], 0, 0
  split = "train" if cut > 0 else "val"
  while True:
    line = f.readline(PIECE_BYTES)
    if not line:
      break
    now = "train" if n < cut else "val"
    if buf and (now != split or size >= PIECE_BYTES and buf[-1].endswith(b"\n")):
      yield b"".join(buf), split
      buf, size = [], 0
    split = now
    buf.append(line)
    size += len(line)
    n += line.endswith(b"\n")
  if buf:
    yield b"".join(buf), split


def _count_lines(path: pathlib.Path, comp) -> int:
  n, last = 0, b"\n"
  with _open(path, comp) as f:
    while block := f.read(1 << 20):
      n += block.count(b"\n")
      last = block[-1:]
  return n + (last != b"\n")


def _record(text, where: str, field: str) -> Unit:
  if not isinstance(text, str):
    raise DataError(f"{where}: field {field!r} holds {type(text).__name__}, not text; name the "
                    "text with --text-field")
  data = text.encode("utf-8", "replace")
  return Unit(data, data)


def _jsonl_units(path: pathlib.Path, comp, field: str) -> Iterator[Unit]:
  with _open(path, comp) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
      except ValueError as e:
        raise DataError(f"input {str(path)!r} line {n} is not JSON ({e}); JSONL needs one "
                        "object per line") from None
      if not isinstance(obj, dict) or field not in obj:
        keys = sorted(obj)[:8] if isinstance(obj, dict) else type(obj).__name__
        raise DataError(f"input {str(path)!r} line {n} has no field {field!r} (it has "
                        f"{keys}); name the text field with --text-field")
      yield _record(obj[field], f"input {str(path)!r} line {n}", field)


def _columnar_units(path: pathlib.Path, fmt: str, field: str) -> Iterator[Unit]:
  try:
    import pyarrow as pa
    import pyarrow.parquet as pq
  except ImportError:
    raise DataError(f"input {str(path)!r}: Parquet and Arrow files need `pyarrow` (pip "
                    "install 'scaleopt[data]')") from None
  try:
    if fmt == "parquet":
      pf = pq.ParquetFile(path)
      names = pf.schema_arrow.names
      batches = lambda: pf.iter_batches(batch_size=BATCH_UNITS, columns=[field])
    else:
      src = pa.memory_map(str(path))
      try:
        reader = pa.ipc.open_stream(src)
      except pa.ArrowInvalid:
        src.seek(0)
        reader = pa.ipc.open_file(src)
        reader = _file_batches(reader)
      names = reader.schema.names
      batches = lambda: reader
  except (pa.ArrowInvalid, OSError) as e:
    raise DataError(f"input {str(path)!r} cannot be read as {fmt} ({e})") from None
  if field not in names:
    raise DataError(f"input {str(path)!r} has no column {field!r} (it has {names[:8]}); name "
                    "the text column with --text-field")
  for n, batch in enumerate(batches()):
    for i, text in enumerate(batch.column(field).to_pylist()):
      if text is not None:
        yield _record(text, f"input {str(path)!r} batch {n} row {i}", field)


class _file_batches:
  """An Arrow IPC file reader as a stream of record batches with a schema."""

  def __init__(self, reader):
    self.r, self.schema = reader, reader.schema

  def __iter__(self):
    return (self.r.get_batch(i) for i in range(self.r.num_record_batches))


def file_units(rel: str, path: pathlib.Path, opts: Options, lone: bool = False
               ) -> Iterator[Unit]:
  """The units of one input file, in order."""
  fmt, comp = file_format(path.name)
  if fmt == "jsonl":
    return _jsonl_units(path, comp, opts.text_field)
  if fmt in ("parquet", "arrow"):
    if comp:
      raise DataError(f"input {str(path)!r}: compressed {fmt} is not read; decompress it")
    return _columnar_units(path, fmt, opts.text_field)
  if lone:
    n = _count_lines(path, comp)
    cut = max(1, int(n * (1 - opts.val_fraction)))
    return _text_units(rel, path, comp, lines=cut)
  return _text_units(rel, path, comp)


# ---------------------------------------------------------------------------------------------
# Shards, progress, restart.


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


def _clear(out: pathlib.Path) -> None:
  for pat in ("train_*.bin", "train_*.json", "val_*.bin", "val_*.json", STATE_DIR + "/*"):
    for old in out.glob(pat):
      old.unlink()
  for name in ("tokenizer.json", MANIFEST):
    (out / name).unlink(missing_ok=True)


def _fingerprint(files: list, tokenizer: str, opts: Options) -> dict:
  """What a restart must share with the interrupted run."""
  st = [(rel, p.stat().st_size, p.stat().st_mtime_ns) for rel, p in files]
  return {"files": st, "tokenizer": tokenizer, "text_field": opts.text_field,
          "val_fraction": opts.val_fraction, "shard_tokens": opts.shard_tokens,
          "bpe_sample_mb": opts.bpe_sample_mb}


def _load_state(out: pathlib.Path, fp: dict) -> Optional[dict]:
  path = out / STATE_DIR / "state.json"
  try:
    state = json.loads(path.read_text())
  except (OSError, ValueError):
    return None
  if state.get("fingerprint") != json.loads(json.dumps(fp)):
    return None
  return state


def _save_state(out: pathlib.Path, state: dict, carry: np.ndarray) -> None:
  d = out / STATE_DIR
  d.mkdir(exist_ok=True)
  name = f"carry_{len(state['shards']['train']):05d}.npy"
  np.save(d / name, carry)
  state["carry"] = name
  tmp = d / "state.json.tmp"
  tmp.write_text(json.dumps(state))
  tmp.replace(d / "state.json")
  for old in d.glob("carry_*.npy"):
    if old.name != name:
      old.unlink()


class Progress:
  """A line on stderr every ``every`` seconds: text read, MB/s, tokens."""

  def __init__(self, on: bool, every: float = 5.0):
    self.on, self.every, self.t0 = on, every, time.perf_counter()
    self.last, self.bytes = self.t0, 0

  def rate(self) -> float:
    return self.bytes / 1e6 / max(time.perf_counter() - self.t0, 1e-9)

  def tick(self, writers: dict, force: bool = False) -> None:
    now = time.perf_counter()
    if self.on and (force or now - self.last >= self.every):
      self.last = now
      toks = ", ".join(f"{s} {w.total:,}" for s, w in writers.items())
      print(f"prepare: {self.bytes / 1e6:,.1f} MB of text, {self.rate():.2f} MB/s, tokens "
            f"{toks}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# The run.


def _units(files: list, opts: Options, start: tuple = (0, 0)) -> Iterator[tuple[tuple, Unit]]:
  """((file index, unit index) after the unit, unit) from position ``start`` on."""
  lone = len(files) == 1 and file_format(files[0][1].name)[0] == "text"
  for i in range(start[0], len(files)):
    rel, path = files[i]
    for j, u in enumerate(file_units(rel, path, opts, lone=lone)):
      if (i, j) >= start:
        yield (i, j + 1), u


def _split_of(u: Unit, fraction: float) -> str:
  return u.split or ("val" if is_heldout(u.key, fraction) else "train")


def _bpe_sample(files: list, opts: Options) -> Callable[[], Iterator[bytes]]:
  """The training text a ``bpe:VOCAB`` tokenizer learns from: every training document, or a
  hashed sample of about ``bpe_sample_mb`` MB spread over the inputs."""
  size = sum(p.stat().st_size for _, p in files)
  cap = None if opts.bpe_sample_mb is None else opts.bpe_sample_mb * 1e6
  share = 1.0 if cap is None else min(1.0, 1.25 * cap / max(size, 1))

  def texts():
    seen = 0
    for _, u in _units(files, opts):
      if u.skip or _split_of(u, opts.val_fraction) != "train" or (
          share < 1 and not is_heldout(u.key + u.text[:64], share)):
        continue
      yield u.text
      seen += len(u.text)
      if cap is not None and seen >= cap:
        return
  return texts


def _batches(units: Iterator, opts: Options) -> Iterator[list]:
  batch, size = [], 0
  for pos, u in units:
    batch.append((pos, u))
    size += len(u.text)
    if size >= BATCH_BYTES or len(batch) >= BATCH_UNITS:
      yield batch
      batch, size = [], 0
  if batch:
    yield batch


def _prefetch(it: Iterator, depth: int = 2) -> Iterator:
  """``it`` run ahead in a thread (reading and parsing overlap the encoder, which releases
  the GIL); its exceptions are raised here, in order."""
  q: queue.Queue = queue.Queue(depth)
  stop = threading.Event()

  def put(item) -> bool:
    while not stop.is_set():
      with contextlib.suppress(queue.Full):
        q.put(item, timeout=0.1)
        return True
    return False

  def work():
    try:
      for x in it:
        if not put((True, x)):
          return
      put((False, None))
    except BaseException as e:  # pylint: disable=broad-except  (re-raised by the consumer)
      put((False, e))

  t = threading.Thread(target=work, daemon=True)
  t.start()
  try:
    while True:
      ok, x = q.get()
      if not ok:
        if x is not None:
          raise x
        return
      yield x
  finally:
    stop.set()
    t.join()


def _tokenizer(spec: str, out: pathlib.Path, files: list, opts: Options, resumed: bool):
  try:
    if resumed and (out / "tokenizer.json").is_file() and spec.startswith("bpe:"):
      tok = tokenizers.load_tokenizer(out / "tokenizer.json", tokenizers.BPE_SEPARATOR)
      return dataclasses.replace(tok, kind="bpe", source=spec[4:])
    return tokenizers.from_spec(spec, train_texts=_bpe_sample(files, opts))
  except tokenizers.TokenizerError as e:
    raise DataError(str(e)) from None


def prepare(inp: str | pathlib.Path, out: str | pathlib.Path, tokenizer: str = "bytes",
            shard_tokens: Optional[int] = None, opts: Optional[Options] = None) -> dict:
  """Tokenizes a file or folder into shards (module docstring); returns a summary dict.

  Refuses an empty validation or training split; continues an interrupted run of the same
  command (same inputs, tokenizer and options) from its last training shard.
  """
  opts = opts or Options()
  if shard_tokens is not None:
    opts = dataclasses.replace(opts, shard_tokens=shard_tokens)
  if not 0 < opts.val_fraction < 1:
    raise DataError(f"--val-fraction {opts.val_fraction}: must be in (0, 1)")
  if opts.shard_tokens < 1:
    raise DataError(f"--shard-tokens {opts.shard_tokens}: must be >= 1")
  inp, out = pathlib.Path(inp), pathlib.Path(out)
  files, skipped = input_files(inp, tuple(opts.include))
  if not files:
    raise DataError(f"input {str(inp)!r} holds no usable files (skipped: {skipped})")
  fp = _fingerprint(files, tokenizer, opts)
  out.mkdir(parents=True, exist_ok=True)
  state = _load_state(out, fp)
  if state is None:
    _clear(out)
  tok = _tokenizer(tokenizer, out, files, opts, state is not None)
  if state is None:
    tok.save(out)
    state = {"fingerprint": fp, "pos": [0, 0], "shards": {"train": [], "val": []},
             "text_bytes": 0, "skipped": skipped}
    carry = None
  else:
    carry = np.load(out / STATE_DIR / state["carry"])
    skipped = state["skipped"]
    _drop_unrecorded(out, state)
  writers = {s: ShardWriter(out, s, tok, opts.shard_tokens, state["shards"][s],
                            carry if s == "train" else None) for s in ("train", "val")}
  prog = Progress(opts.progress)
  prog.bytes = state["text_bytes"]
  units = _units(files, opts, tuple(state["pos"]))
  for batch in _prefetch(_batches(units, opts)):
    ids = tok.encode_docs([u.text for _, u in batch if not u.skip], separators=False)
    for pos, u in batch:
      if u.skip:
        skipped[u.skip] = skipped.get(u.skip, 0) + 1
        continue
      arr = next(ids)
      if u.last:
        arr = np.append(arr, np.uint32(tok.sep))
      prog.bytes += len(u.text)
      split = _split_of(u, opts.val_fraction)
      if writers[split].add(arr) and split == "train":
        writers["val"].close_shard()
        state.update(pos=list(pos), text_bytes=prog.bytes, skipped=skipped,
                     shards={s: w.shards for s, w in writers.items()})
        _save_state(out, state, writers["train"].carry())
    prog.tick(writers)
  prog.tick(writers, force=True)
  return _finish(inp, out, files, tok, writers, skipped, prog, opts)


def _drop_unrecorded(out: pathlib.Path, state: dict) -> None:
  """Shards written after the last saved position (an interrupted run's) are written again."""
  for split, shards in state["shards"].items():
    keep = {s["file"] for s in shards}
    for b in out.glob(f"{split}_*.bin"):
      if b.name not in keep:
        b.unlink()
        b.with_suffix(".json").unlink(missing_ok=True)


def _finish(inp, out, files, tok, writers, skipped, prog, opts) -> dict:
  if writers["val"].total == 0:
    raise DataError(
        f"input {str(inp)!r}: the validation split would be empty (a document is held out with "
        f"probability --val-fraction={opts.val_fraction}, by a hash of its text, or of a text "
        f"file's relative path; a lone text file holds out its last lines; {len(files)} files "
        "here); add documents or raise --val-fraction")
  if writers["train"].total == 0:
    raise DataError(f"input {str(inp)!r}: the training split is empty")
  for w in writers.values():
    w.close_shard(final=True)
  tok_hash = (hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
              if (out / "tokenizer.json").is_file() else tok.name)
  content = hashlib.sha256(tok_hash.encode())
  for s in ("train", "val"):
    for sh in writers[s].shards:
      content.update(sh["sha256"].encode())
  input_bytes = sum(p.stat().st_size for _, p in files)
  manifest = {
      "format": "scaleopt-corpus", "version": 1, "input": str(inp),
      "files": [{"path": rel, "bytes": p.stat().st_size} for rel, p in files],
      "input_bytes": input_bytes, "text_bytes": prog.bytes, "tokenizer": tok.name,
      "tokenizer_sha256": tok_hash, "vocab_size": tok.vocab_size, "separator": tok.sep,
      "text_field": opts.text_field, "val_fraction": opts.val_fraction,
      "splits": {s: {"tokens": w.total, "shards": w.shards} for s, w in writers.items()},
      "skipped": skipped, "content_hash": content.hexdigest()}
  (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
  for old in (out / STATE_DIR).glob("*"):
    old.unlink()
  if (out / STATE_DIR).is_dir():
    (out / STATE_DIR).rmdir()
  return {"vocab_size": tok.vocab_size, "tokenizer": tok.name, "files": len(files),
          "train_tokens": writers["train"].total, "val_tokens": writers["val"].total,
          "skipped": skipped, "text_bytes": prog.bytes, "mb_per_s": prog.rate(),
          "seconds": time.perf_counter() - prog.t0, "content_hash": manifest["content_hash"]}


def _check_args(inp: str, out: str) -> None:
  """The paths, checked before anything is written (the tokenizer spec: ``prepare``)."""
  if "://" in out:
    raise DataError(f"--out {out!r}: shards are written to a local folder (copy them to "
                    "storage afterwards, e.g. gsutil -m cp -r); training reads them from a URL")
  if not pathlib.Path(inp).exists():
    raise DataError(f"input {inp!r} does not exist")
  if pathlib.Path(out).exists() and not pathlib.Path(out).is_dir():
    raise DataError(f"--out {out!r} is a file, not a directory")


def main(input: str, out: str, tokenizer: str = "bytes", **options) -> int:
  """``scaleopt data prepare``: 0 on success, 2 on bad input (then an output folder this call
  created is removed again; an interrupted run's folder is kept for the restart)."""
  import shutil
  created = not pathlib.Path(out).exists()
  try:
    _check_args(input, out)
    s = prepare(input, out, tokenizer, opts=Options(**options))
  except (DataError, ValueError, OSError) as e:
    if created and pathlib.Path(out).is_dir():
      shutil.rmtree(out, ignore_errors=True)
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"interrupted: run the same command again to continue {out} from its last "
          "complete training shard", file=sys.stderr)
    return 130
  skipped = ", ".join(f"{n} {what}" for what, n in sorted(s["skipped"].items()))
  print(f"wrote {out}: {s['train_tokens']} train / {s['val_tokens']} val tokens from "
        f"{s['files']} files, vocab {s['vocab_size']} ({s['tokenizer']}); "
        f"{s['text_bytes'] / 1e6:.1f} MB of text in {s['seconds']:.1f} s = "
        f"{s['mb_per_s']:.2f} MB/s; content hash {s['content_hash'][:16]}"
        + (f"; skipped {skipped}" if skipped else ""))
  return 0
