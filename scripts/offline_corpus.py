"""Builds a token corpus from what an offline machine already holds: its Python's source.

The text is every UTF-8 source and documentation file (``SUFFIXES``: Python and its stubs,
Markdown, reStructuredText, plain text, C/C++/CUDA) under the running interpreter's
site-packages and standard library (exact duplicates, e.g. vendored copies and
license texts, kept once), written as one JSONL document per file, then tokenized by
``scaleopt data prepare`` with a byte-level BPE trained on a sample of it (``--dedup``: near-
duplicate files, e.g. another version of a module, on one side of the held-out split):

  PYTHONPATH=. python scripts/offline_corpus.py --out $OUT/corpus

  OUT/corpus/train_*.bin, val_*.bin, tokenizer.json   the shards (data.source=shards)
  OUT/corpus/manifest.json                            data prepare's manifest (shards, tokens,
                                                      content hash)
  OUT/corpus/sources.json                             every source file: root, path, bytes,
                                                      sha256; totals; a hash over them all

The run prints the training tokens and the epochs a run of ``--run-tokens`` makes over them,
and exits 1 when the corpus is smaller than ``--min-tokens`` or the vocabulary than
``--min-vocab``. Nothing is downloaded. The same environment gives the same sources hash;
the BPE is trained with Hugging Face ``tokenizers`` (multi-threaded).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import site
import sys
import sysconfig
import tempfile
import time

SUFFIXES = (".py", ".pyi", ".md", ".rst", ".txt", ".c", ".h", ".cc", ".cpp", ".hpp", ".cu", ".cuh")
SKIP_DIRS = {"__pycache__", ".git"}


def default_roots() -> list[pathlib.Path]:
  """site-packages (every one the interpreter knows) and the standard library."""
  paths = sysconfig.get_paths()
  roots = [paths["purelib"], paths["platlib"], *site.getsitepackages(), paths["stdlib"]]
  out: list[pathlib.Path] = []
  for r in roots:
    p = pathlib.Path(r).resolve()
    if p.is_dir() and p not in out:
      out.append(p)
  return out


def collect(roots: list[pathlib.Path], jsonl: pathlib.Path, suffixes=SUFFIXES) -> dict:
  """Writes one JSONL line {"text", "path"} per distinct UTF-8 text file; returns the source
  list (root, path, bytes, sha256) and its totals."""
  seen: set[str] = set()
  files, dup, skipped = [], 0, 0
  with open(jsonl, "w", encoding="utf-8") as f:
    for k, root in enumerate(roots):
      for dirpath, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for n in sorted(names):
          if not n.endswith(suffixes):
            continue
          p = pathlib.Path(dirpath) / n
          try:
            data = p.read_bytes()
            text = data.decode("utf-8")
          except (OSError, UnicodeDecodeError):
            skipped += 1
            continue
          if not text.strip() or "\0" in text:
            skipped += 1
            continue
          digest = hashlib.sha256(data).hexdigest()
          if digest in seen:
            dup += 1
            continue
          seen.add(digest)
          rel = p.relative_to(root).as_posix()
          files.append({"root": k, "path": rel, "bytes": len(data), "sha256": digest})
          f.write(json.dumps({"text": text, "path": rel}, ensure_ascii=False) + "\n")
  h = hashlib.sha256()
  for x in files:
    h.update(f"{x['root']}/{x['path']}\0{x['sha256']}\n".encode())
  return {"roots": [str(r) for r in roots], "suffixes": list(suffixes), "files": files,
          "num_files": len(files), "bytes": sum(x["bytes"] for x in files),
          "duplicates_dropped": dup, "unreadable_or_empty": skipped,
          "sources_sha256": h.hexdigest()}


def build(out: pathlib.Path, roots: list[pathlib.Path], vocab: int, bpe_sample_mb: float,
          val_fraction: float, shard_tokens: int, work: pathlib.Path,
          dedup: float | None = None) -> dict:
  from scaleopt.train import prepare as P
  work.mkdir(parents=True, exist_ok=True)
  jsonl = work / "sources.jsonl"
  t0 = time.perf_counter()
  sources = collect(roots, jsonl)
  t1 = time.perf_counter()
  print(f"collected {sources['num_files']:,} files, {sources['bytes'] / 1e6:,.1f} MB "
        f"({sources['duplicates_dropped']:,} duplicates dropped) in {t1 - t0:.1f} s",
        flush=True)
  try:
    s = P.prepare(jsonl, out, f"bpe:{vocab}", opts=P.Options(
        val_fraction=val_fraction, shard_tokens=shard_tokens, bpe_sample_mb=bpe_sample_mb,
        progress=True, dedup=dedup))
  finally:
    jsonl.unlink(missing_ok=True)
  (out / "sources.json").write_text(json.dumps(sources, indent=1))
  return {**s, "collect_seconds": t1 - t0, "total_seconds": time.perf_counter() - t0,
          "sources_sha256": sources["sources_sha256"], "source_files": sources["num_files"],
          "source_bytes": sources["bytes"]}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--out", required=True, help="folder for the shards (e.g. $OUT/corpus)")
  ap.add_argument("--roots", nargs="*", default=None,
                  help="folders to read (default: site-packages and the standard library)")
  ap.add_argument("--vocab", type=int, default=32768)
  ap.add_argument("--bpe-sample-mb", type=float, default=100.0)
  ap.add_argument("--val-fraction", type=float, default=0.01)
  ap.add_argument("--shard-tokens", type=int, default=1 << 26)
  ap.add_argument("--work", default=None, help="scratch folder for the JSONL (default: a "
                  "temporary folder)")
  ap.add_argument("--dedup", nargs="?", type=float, const=0.8, default=None, metavar="SHARE",
                  help="keep near-duplicate files (sharing >= SHARE of their lines, default 0.8) "
                  "on one side of the split (data prepare --dedup)")
  ap.add_argument("--run-tokens", type=float, default=262_144_000,
                  help="training tokens of the run to count epochs for")
  ap.add_argument("--min-tokens", type=float, default=100e6)
  ap.add_argument("--min-vocab", type=int, default=32000)
  a = ap.parse_args(argv)
  roots = [pathlib.Path(r).resolve() for r in a.roots] if a.roots else default_roots()
  if a.work:
    pathlib.Path(a.work).mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=a.work) as work:
    s = build(pathlib.Path(a.out), roots, a.vocab, a.bpe_sample_mb, a.val_fraction,
              a.shard_tokens, pathlib.Path(work), a.dedup)
  epochs = a.run_tokens / s["train_tokens"]
  print(f"corpus {a.out}: {s['train_tokens']:,} train / {s['val_tokens']:,} val tokens, "
        f"vocab {s['vocab_size']:,}, from {s['source_files']:,} files "
        f"({s['source_bytes'] / 1e6:,.1f} MB; sources sha256 {s['sources_sha256'][:16]}); "
        f"content hash {s['content_hash'][:16]}; tokenized at {s['mb_per_s']:.2f} MB/s on "
        f"{os.cpu_count()} cores; {s['total_seconds']:.0f} s in all; a run of "
        f"{a.run_tokens:,.0f} tokens makes {epochs:.2f} epochs")
  short = []
  if s["train_tokens"] < a.min_tokens:
    short.append(f"{s['train_tokens']:,} training tokens < --min-tokens {a.min_tokens:,.0f}")
  if s["vocab_size"] < a.min_vocab:
    short.append(f"vocabulary {s['vocab_size']:,} < --min-vocab {a.min_vocab:,}")
  if short:
    print("error: " + "; ".join(short), file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
