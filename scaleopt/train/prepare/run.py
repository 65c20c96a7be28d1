"""``scaleopt data prepare``, the run: inputs read ahead in a thread (``scaleopt.train.prefetch``),
encoded in batches, split by document, written to shards with a restart point after each
training shard, and a manifest at the end."""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import sys
import time
from typing import Optional

import numpy as np

from scaleopt.train import prefetch
from scaleopt.train.prepare import restart
from scaleopt.train.prepare.options import Options
from scaleopt.train.prepare.progress import Progress
from scaleopt.train.prepare.readers import BAD_RECORD, input_files, units
from scaleopt.train.prepare.split import near_duplicate_split, split_of
from scaleopt.train.prepare.tokenize import encoding_batches, make_tokenizer
from scaleopt.train.prepare.writer import MANIFEST, ShardWriter, write_manifest
from scaleopt.train.shards import DataError


def prepare(inp: str | pathlib.Path, out: str | pathlib.Path, tokenizer: str = "bytes",
            shard_tokens: Optional[int] = None, opts: Optional[Options] = None) -> dict:
  """Tokenizes a file or folder into shards (``scaleopt.train.prepare``); returns a summary.

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
  if opts.max_bad_records is not None and not opts.skip_bad_records:
    raise DataError(f"--max-bad-records {opts.max_bad_records} applies with "
                    "--skip-bad-records (without it the first bad record stops the run)")
  if opts.max_bad_records is not None and opts.max_bad_records < 0:
    raise DataError(f"--max-bad-records {opts.max_bad_records}: must be >= 0")
  inp, out = pathlib.Path(inp), pathlib.Path(out)
  files, skipped = input_files(inp, tuple(opts.include))
  if not files:
    raise DataError(f"input {str(inp)!r} holds no usable files (skipped: {skipped})")
  fp = restart.fingerprint(files, tokenizer, opts)
  out.mkdir(parents=True, exist_ok=True)
  state = restart.load_state(out, fp)
  if state is None:
    restart.clear(out)
  groups, dedup = (near_duplicate_split(files, opts) if opts.dedup is not None
                   else (None, None))
  tok = make_tokenizer(tokenizer, out, files, opts, state is not None, groups)
  if state is None:
    tok.save(out)
    state = {"fingerprint": fp, "pos": [0, 0], "shards": {"train": [], "val": []},
             "text_bytes": 0, "skipped": skipped}
    carry = None
  else:
    carry = np.load(out / restart.STATE_DIR / state["carry"])
    skipped = state["skipped"]
    restart.drop_unrecorded(out, state)
  writers = {s: ShardWriter(out, s, tok, opts.shard_tokens, state["shards"][s],
                            carry if s == "train" else None) for s in ("train", "val")}
  prog = Progress(opts.progress)
  prog.bytes = state["text_bytes"]
  positioned = units(files, opts.text_field, opts.val_fraction, tuple(state["pos"]),
                     skip_bad=opts.skip_bad_records)
  batches = prefetch.Ahead(encoding_batches(positioned), name="scaleopt-prepare")
  try:
    for batch in batches:
      ids = tok.encode_docs([u.text for _, u in batch if not u.skip], separators=False)
      for pos, u in batch:
        if u.skip:
          skipped[u.skip] = skipped.get(u.skip, 0) + 1
          if u.skip == BAD_RECORD and skipped[u.skip] > opts.bad_records_cap:
            raise DataError(f"more than {opts.bad_records_cap} bad records, the last {u.why}; "
                            "fix the input, or raise --max-bad-records")
          continue
        arr = next(ids)
        if u.last:
          arr = np.append(arr, np.uint32(tok.sep))
        prog.bytes += len(u.text)
        split = split_of(u, opts.val_fraction, groups)
        if writers[split].add(arr) and split == "train":
          writers["val"].close_shard()
          state.update(pos=list(pos), text_bytes=prog.bytes, skipped=skipped,
                       shards={s: w.shards for s, w in writers.items()})
          restart.save_state(out, state, writers["train"].carry())
      prog.tick(writers)
  finally:
    batches.close()
  prog.tick(writers, force=True)
  return _finish(inp, out, files, tok, writers, skipped, prog, opts, dedup)


def _no_text(inp: pathlib.Path, files: list, skipped: dict) -> DataError:
  """What to say when no input file gave any text: empty, binary, or every record bad."""
  empty = sum(p.stat().st_size == 0 for _, p in files)
  binary = skipped.get("binary files", 0)
  if len(files) == 1 and empty:
    return DataError(f"input {str(inp)!r} is empty")
  if len(files) == 1 and binary:
    return DataError(f"input {str(inp)!r} is not text (it holds a NUL byte or is not UTF-8); "
                     "data prepare reads text, JSONL, Parquet and Arrow")
  parts = [f"{empty} empty"] * bool(empty) + [f"{binary} not text (binary)"] * bool(binary)
  bad = skipped.get(BAD_RECORD, 0)
  parts += [f"{bad} bad records skipped"] * bool(bad)
  return DataError(f"input {str(inp)!r} holds no text to tokenize: of its {len(files)} files "
                   f"{', '.join(parts) or 'none holds a document'}")


def _finish(inp, out, files, tok, writers, skipped, prog, opts, dedup=None) -> dict:
  """Refuses an empty split; writes the manifest, removes the restart point; the summary."""
  if writers["val"].total == 0 and writers["train"].total == 0:
    raise _no_text(inp, files, skipped)
  if writers["val"].total == 0:
    raise DataError(
        f"input {str(inp)!r}: the validation split would be empty (a document is held out with "
        f"probability --val-fraction={opts.val_fraction}, by a hash of its text, or of a text "
        f"file's relative path; a lone text file holds out its last lines; {len(files)} files "
        "here); add documents or raise --val-fraction")
  if writers["train"].total == 0:
    raise DataError(f"input {str(inp)!r}: the training split is empty")
  manifest = write_manifest(out, inp, files, tok, writers, skipped, prog.bytes,
                            opts.text_field, opts.val_fraction, dedup)
  restart.remove(out)
  return {"vocab_size": tok.vocab_size, "tokenizer": tok.name, "files": len(files),
          "train_tokens": writers["train"].total, "val_tokens": writers["val"].total,
          "skipped": skipped, "text_bytes": prog.bytes, "mb_per_s": prog.rate(),
          "seconds": time.perf_counter() - prog.t0, "content_hash": manifest["content_hash"],
          "dedup": dedup}


def _check_args(inp: str, out: str) -> None:
  """The paths, checked before anything is written (the tokenizer spec: ``prepare``)."""
  if "://" in out:
    raise DataError(f"--out {out!r}: shards are written to a local folder (copy them to "
                    "storage afterwards, e.g. gsutil -m cp -r); training reads them from a URL")
  if "://" in inp:
    raise DataError(f"--input {inp!r} is a URL; data prepare reads local files and folders "
                    "(copy it here first, e.g. gsutil -m cp -r or curl -O)")
  if not pathlib.Path(inp).exists():
    raise DataError(f"input {inp!r} does not exist")
  if pathlib.Path(out).exists() and not pathlib.Path(out).is_dir():
    raise DataError(f"--out {out!r} is a file, not a directory")
  src, dst = pathlib.Path(inp).resolve(), pathlib.Path(out).resolve()
  if dst == src:
    raise DataError(f"--out {out!r} is the --input folder: the shards would become input of the "
                    "next prepare of it; name another folder")
  if src.is_dir() and src in dst.parents:
    raise DataError(f"--out {out!r} is inside --input {inp!r}: the shards would become input "
                    "of the next prepare of it; name a folder outside it")
  if src.is_dir() and (src / MANIFEST).is_file() and any(src.glob("train_*.bin")):
    raise DataError(f"input {inp!r} holds shards written by data prepare, not text; train on "
                    f"it with --set data.source=shards --set data.path={inp}")


def main(input: str, out: str, tokenizer: str = "bytes", **options) -> int:
  """``scaleopt data prepare``: 0 on success, 2 on bad input (then an output folder this call
  created is removed again; an interrupted run's folder is kept for the restart)."""
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
