"""Tokenizing for ``scaleopt data prepare``: the tokenizer (a ``bpe:VOCAB`` one learned from the
training text) and the encoding batches it is given."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Callable, Iterator, Optional

from scaleopt.train import tokenizers
from scaleopt.train.prepare.options import Options
from scaleopt.train.prepare.readers import BATCH_UNITS, units
from scaleopt.train.prepare.split import is_heldout, split_of
from scaleopt.train.shards import DataError

BATCH_BYTES = 16 << 20  # text per encoding batch (the Rust encoder spreads it over the cores)


def make_tokenizer(spec: str, out: pathlib.Path, files: list, opts: Options, resumed: bool,
                   groups: Optional[dict] = None):
  """The tokenizer of ``spec``; a resumed ``bpe:VOCAB`` run reloads the one it learned
  (``groups``: the ``--dedup`` split, ``split.near_duplicate_split``)."""
  try:
    if resumed and (out / "tokenizer.json").is_file() and spec.startswith("bpe:"):
      tok = tokenizers.load_tokenizer(out / "tokenizer.json", tokenizers.BPE_SEPARATOR)
      return dataclasses.replace(tok, kind="bpe", source=spec[4:])
    return tokenizers.from_spec(spec, train_texts=bpe_sample(files, opts, groups))
  except tokenizers.TokenizerError as e:
    raise DataError(str(e)) from None


def bpe_sample(files: list, opts: Options, groups: Optional[dict] = None
               ) -> Callable[[], Iterator[bytes]]:
  """The training text a ``bpe:VOCAB`` tokenizer learns from: every training document, or a
  hashed sample of about ``bpe_sample_mb`` MB spread over the inputs."""
  size = sum(p.stat().st_size for _, p in files)
  cap = None if opts.bpe_sample_mb is None else opts.bpe_sample_mb * 1e6
  share = 1.0 if cap is None else min(1.0, 1.25 * cap / max(size, 1))

  def texts():
    seen = 0
    for _, u in units(files, opts.text_field, opts.val_fraction,
                      skip_bad=opts.skip_bad_records):
      if u.skip or split_of(u, opts.val_fraction, groups) != "train" or (
          share < 1 and not is_heldout(u.key + u.text[:64], share)):
        continue
      yield u.text
      seen += len(u.text)
      if cap is not None and seen >= cap:
        return
  return texts


def encoding_batches(positioned: Iterator) -> Iterator[list]:
  """(position, unit) pairs grouped into batches of about ``BATCH_BYTES`` of text."""
  batch, size = [], 0
  for pos, u in positioned:
    batch.append((pos, u))
    size += len(u.text)
    if size >= BATCH_BYTES or len(batch) >= BATCH_UNITS:
      yield batch
      batch, size = [], 0
  if batch:
    yield batch
