"""The token shard format: written by ``scaleopt data prepare`` (``scaleopt.train.prepare``),
read by the trainer (``scaleopt.train.data``); easy to write from other tools.

  DIR/train_000.bin   raw little-endian tokens, uint16 (vocab <= 65536) or uint32
  DIR/train_000.json  {"format": "scaleopt-tokens", "version": 1, "dtype": "uint16",
                       "num_tokens": N, "vocab_size": V, "tokenizer": "bytes",
                       "separator": 0}
  DIR/val_000.bin, DIR/val_000.json   the validation split, same format
  DIR/tokenizer.json  (BPE tokenizers) the Hugging Face tokenizer, for decoding
  DIR/manifest.json   (written by ``data prepare``) inputs, tokens, shard hashes, content hash

``vocab_size`` is the tokenizer's (max id + 1); a model must have at least that many rows.
``DIR`` may be a URL (``gs://``, ``s3://``, ``memory://``, any fsspec file system): shards are
then read by byte ranges (``RemoteTokens``).

A ``.bin`` must hold exactly ``num_tokens * itemsize`` bytes; anything else is an error that
names the file. nanoGPT-style ``train.bin``/``val.bin`` work once a ``.json`` is put next to
them. Documents are separated by the tokenizer's separator token (``0`` for bytes).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

FORMAT = "scaleopt-tokens"


class DataError(ValueError):
  """Missing, corrupt or truncated data; the message names the path."""



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
                    f".json header; see scaleopt/train/shards.py for the format)")
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

  Reads the shard once, ``chunk`` tokens at a time.
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
