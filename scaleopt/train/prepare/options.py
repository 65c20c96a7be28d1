"""The options of ``scaleopt data prepare`` (its command-line flags)."""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class Options:
  """``text_field``: the JSONL field / Parquet and Arrow column; ``val_fraction``: held-out
  share of documents; ``shard_tokens``: training tokens per shard; ``include``: glob patterns
  of file names to read in a folder (all when empty); ``bpe_sample_mb``: text a ``bpe:VOCAB``
  tokenizer is trained on (all the training text when None); ``progress``: a line on stderr
  every few seconds; ``skip_bad_records``: leave out records that cannot be read (a line that
  is not a JSON object, a text field that is null or not a string), counted, instead of
  stopping at the first; ``max_bad_records``: stop after more than this many of them
  (``BAD_RECORDS_CAP`` when None); ``dedup``: near-duplicate documents (sharing at least
  this share of their lines, ``scaleopt.train.dedup``) go to one side of the split together
  (None: off)."""
  text_field: str = "text"
  val_fraction: float = 0.05
  shard_tokens: int = 1 << 28
  include: tuple = ()
  bpe_sample_mb: Optional[float] = None
  progress: bool = False
  skip_bad_records: bool = False
  max_bad_records: Optional[int] = None
  dedup: Optional[float] = None

  @property
  def bad_records_cap(self) -> int:
    return BAD_RECORDS_CAP if self.max_bad_records is None else self.max_bad_records


BAD_RECORDS_CAP = 1000  # --skip-bad-records without --max-bad-records
