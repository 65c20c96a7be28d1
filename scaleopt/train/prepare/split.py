"""The held-out split of ``scaleopt data prepare``, by document: a document is held out
(``val``) iff the first 8 bytes of ``blake2b(key)`` as a big-endian integer are below
``val_fraction * 2**64``. The key of a record (JSONL, Parquet, Arrow) is its text, so duplicated
records fall on one side; the key of a text file is its relative path, so its pieces stay
together. A lone text file is one document; its last ``val_fraction`` of lines are held out
instead (``Unit.split``, set by the reader).
"""

from __future__ import annotations

import hashlib

from scaleopt.train.prepare.readers import Unit


def is_heldout(key: bytes, fraction: float) -> bool:
  """The document split: blake2b(key)'s first 8 bytes below ``fraction * 2**64``."""
  h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
  return h < fraction * 2.0 ** 64


def split_of(u: Unit, fraction: float) -> str:
  """``train`` or ``val``: the reader's forced split, else the hash rule."""
  return u.split or ("val" if is_heldout(u.key, fraction) else "train")
