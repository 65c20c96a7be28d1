"""The inputs of ``scaleopt data prepare``: which files are read and how each format becomes
``Unit``s (pieces of documents as UTF-8 bytes).

  *.jsonl, *.ndjson (.gz, .zst)   one JSON object per line; the document is its ``text_field``
  *.parquet                       the document is the ``text_field`` column of each row
  *.arrow                         Arrow IPC files (stream or file format), the same column
  anything else (.gz, .zst)       text: the whole file is one document

Everything streams: a text file is read in pieces of about ``PIECE_BYTES`` cut after a line
break with no other white space on either side (the GPT-2, Qwen2 and Llama 3 pre-tokenizers
split there anyway, so a byte-level BPE gives the ids of the whole file), JSONL line by line,
Parquet and Arrow one record batch at a time.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import gzip
import io
import json
import os
import pathlib
from typing import Iterator, Optional

from scaleopt.train.shards import DataError

PIECE_BYTES = 1 << 20  # a text file's piece
BATCH_UNITS = 1024  # records per Parquet / Arrow read and per encoding batch
SKIP_DIRS = (".git",)  # never descended into
SKIP_SUFFIXES = (".pyc",)
HF_METADATA = ("state.json", "dataset_info.json", "dataset_dict.json")  # datasets' folders


def is_binary(data: bytes) -> bool:
  """Not text: a NUL byte (git's rule) or not UTF-8."""
  if b"\0" in data:
    return True
  try:
    data.decode("utf-8")
  except UnicodeDecodeError:
    return True
  return False


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


def open_input(path: pathlib.Path, comp: Optional[str]):
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
  with open_input(path, comp) as f:
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
  with open_input(path, comp) as f:
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
  with open_input(path, comp) as f:
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


def file_units(rel: str, path: pathlib.Path, text_field: str, val_fraction: float,
               lone: bool = False) -> Iterator[Unit]:
  """The units of one input file, in order."""
  fmt, comp = file_format(path.name)
  if fmt == "jsonl":
    return _jsonl_units(path, comp, text_field)
  if fmt in ("parquet", "arrow"):
    if comp:
      raise DataError(f"input {str(path)!r}: compressed {fmt} is not read; decompress it")
    return _columnar_units(path, fmt, text_field)
  if lone:
    n = _count_lines(path, comp)
    cut = max(1, int(n * (1 - val_fraction)))
    return _text_units(rel, path, comp, lines=cut)
  return _text_units(rel, path, comp)


def units(files: list, text_field: str, val_fraction: float, start: tuple = (0, 0)
          ) -> Iterator[tuple[tuple, Unit]]:
  """((file index, unit index) after the unit, unit) from position ``start`` on."""
  lone = len(files) == 1 and file_format(files[0][1].name)[0] == "text"
  for i in range(start[0], len(files)):
    rel, path = files[i]
    for j, u in enumerate(file_units(rel, path, text_field, val_fraction, lone=lone)):
      if (i, j) >= start:
        yield (i, j + 1), u
