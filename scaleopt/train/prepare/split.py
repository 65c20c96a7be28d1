"""The held-out split of ``scaleopt data prepare``, by document: a document is held out
(``val``) iff the first 8 bytes of ``blake2b(key)`` as a big-endian integer are below
``val_fraction * 2**64``. The key of a record (JSONL, Parquet, Arrow) is its text, so duplicated
records fall on one side; the key of a text file is its relative path, so its pieces stay
together. A lone text file is one document; its last ``val_fraction`` of lines are held out
instead (``Unit.split``, set by the reader).

With ``--dedup`` (``near_duplicate_split``) every document is read once first and near-duplicate
documents are grouped (``scaleopt.train.dedup``); a document then goes to the side of its
group's first document, so near-copies land together (a group of one: the rule above).
"""

from __future__ import annotations

import hashlib
import sys
import time
from typing import Optional

from scaleopt.train.prepare.options import Options
from scaleopt.train.prepare.readers import Unit, file_format, units
from scaleopt.train.shards import DataError


def is_heldout(key: bytes, fraction: float) -> bool:
  """The document split: blake2b(key)'s first 8 bytes below ``fraction * 2**64``."""
  h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")
  return h < fraction * 2.0 ** 64


def split_of(u: Unit, fraction: float, groups: Optional[dict] = None) -> str:
  """``train`` or ``val``: the reader's forced split, else the hash rule (with ``groups``, from
  ``near_duplicate_split``: the side of the document's group)."""
  if u.split:
    return u.split
  if groups is not None:
    held = groups[int.from_bytes(hashlib.blake2b(u.key, digest_size=8).digest(), "big")]
  else:
    held = is_heldout(u.key, fraction)
  return "val" if held else "train"


def near_duplicate_split(files: list, opts: Options) -> tuple[dict, dict]:
  """``--dedup``: {key digest: held out} for every document of ``files``, each near-duplicate
  group on the side of its first document, and the manifest's record of the grouping."""
  if not 0 < opts.dedup <= 1:
    raise DataError(f"--dedup {opts.dedup}: the share of lines must be in (0, 1]")
  if len(files) == 1 and file_format(files[0][1].name)[0] == "text":
    raise DataError("--dedup: the input is one text file, one document (its held-out part is "
                    "its last lines); there is nothing to group")
  try:
    import datasketch  # noqa: F401  (MinHash and LSH)
  except ImportError:  # pragma: no cover - datasketch is in the data and dev extras
    raise DataError("--dedup needs datasketch: pip install 'scaleopt[data]'") from None
  from scaleopt.train import dedup
  t0 = time.perf_counter()
  docs = dedup.Documents.read((u.key, u.text) for _, u in units(
      files, opts.text_field, opts.val_fraction, skip_bad=opts.skip_bad_records) if not u.skip)
  g = dedup.groups(docs.sets, threshold=opts.dedup)
  record = {"threshold": opts.dedup, "jaccard": dedup.JACCARD, "lsh_jaccard": dedup.LSH_JACCARD,
            "num_perm": dedup.NUM_PERM, **g.summary(),
            "seconds": round(time.perf_counter() - t0, 1)}
  if opts.progress:
    print(f"prepare: --dedup {record['documents']:,} documents, {record['grouped_documents']:,} "
          f"in {record['groups']:,} groups (largest {record['largest_group']:,}) in "
          f"{record['seconds']:.0f} s", file=sys.stderr, flush=True)
  return dedup.heldout_by_digest(docs, g.rep, opts.val_fraction), record
