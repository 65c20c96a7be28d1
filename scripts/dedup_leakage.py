"""How much of ``scaleopt data prepare``'s held-out split leaks into its training split, with and
without ``--dedup``: the share of held-out bytes in documents that share at least 80% (50%) of
their lines with one training document, and the share of held-out lines found in training
(``scaleopt.train.dedup.leakage``, exact).

  PYTHONPATH=. python scripts/dedup_leakage.py --input CORPUS [--val-fraction 0.01]
  PYTHONPATH=. python scripts/dedup_leakage.py --offline [--roots DIR ...]

(``--offline``: the offline corpus recipe's sources, ``scripts/offline_corpus.py``.) The
documents and their keys are read by data prepare's own readers and split by its rule: each
document by its key digest, or, as ``--dedup`` does (``scaleopt.train.dedup.split_by_group``),
by its near-duplicate group's first document's; nothing is tokenized. Prints one Markdown
table row per split and the groups found.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))


def documents(inp: pathlib.Path, text_field: str, val_fraction: float):
  """The documents data prepare reads from ``inp`` (a lone text file is refused: its split is
  by line, not by document)."""
  from scaleopt.train import dedup
  from scaleopt.train.prepare import readers
  files, _ = readers.input_files(inp)
  if len(files) == 1 and readers.file_format(files[0][1].name)[0] == "text":
    raise SystemExit(f"error: {inp} is one text file: its held-out part is its last lines")
  return dedup.Documents.read((u.key, u.text) for _, u in readers.units(
      files, text_field, val_fraction) if not u.skip)


def measure(docs, val_fraction: float, threshold: float, jaccard: float) -> list[dict]:
  from scaleopt.train import dedup
  t0 = time.perf_counter()
  g = dedup.groups(docs.sets, threshold=threshold, jaccard=jaccard)
  t1 = time.perf_counter()
  rows = []
  for name, rep in (("by document", None), ("--dedup (near-duplicate groups)", g.rep)):
    leak = dedup.summarize(docs.sets, docs.nbytes, docs.digests, val_fraction, rep)
    rows.append({"split": name, "documents": len(docs.sets), **leak})
  rows[1].update(g.summary(), group_seconds=t1 - t0)
  return rows


def table(rows: list[dict], corpus: str) -> str:
  head = ("| corpus | split | documents | held-out documents | held-out bytes at >= 80% of "
          "lines | at >= 50% | held-out lines in training |\n|---|---|---|---|---|---|---|")
  body = [f"| {corpus} | {r['split']} | {r['documents']:,} | {r['heldout_documents']:,} | "
          f"{100 * r['bytes_at_0.8']:.2f}% | {100 * r['bytes_at_0.5']:.2f}% | "
          f"{100 * r['lines_in_training']:.1f}% |" for r in rows]
  return "\n".join([head] + body)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  src = ap.add_mutually_exclusive_group(required=True)
  src.add_argument("--input", help="what data prepare would read (a folder or a file)")
  src.add_argument("--offline", action="store_true",
                   help="the offline corpus recipe's sources (site-packages and stdlib)")
  ap.add_argument("--roots", nargs="*", default=None, help="with --offline: folders to read")
  ap.add_argument("--val-fraction", type=float, default=0.01)
  ap.add_argument("--text-field", default="text")
  ap.add_argument("--threshold", type=float, default=None, help="dedup's share of lines "
                  "(default: scaleopt.train.dedup.THRESHOLD)")
  a = ap.parse_args(argv)
  from scaleopt.train import dedup
  threshold = dedup.THRESHOLD if a.threshold is None else a.threshold
  t0 = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    if a.offline:
      import offline_corpus
      roots = ([pathlib.Path(r).resolve() for r in a.roots] if a.roots
               else offline_corpus.default_roots())
      inp = pathlib.Path(tmp) / "sources.jsonl"
      offline_corpus.collect(roots, inp)
      corpus = "offline corpus (" + ", ".join(str(r) for r in roots) + ")"
    else:
      inp, corpus = pathlib.Path(a.input), a.input
    docs = documents(inp, a.text_field, a.val_fraction)
  t1 = time.perf_counter()
  rows = measure(docs, a.val_fraction, threshold, dedup.JACCARD)
  print(table(rows, corpus))
  g = rows[1]
  print(f"\n{len(docs.sets):,} documents, {sum(docs.nbytes) / 1e6:,.1f} MB, val fraction "
        f"{a.val_fraction}; read and hashed in {t1 - t0:.0f} s; {g['groups']:,} groups "
        f"({g['grouped_documents']:,} documents in groups of 2+, the largest "
        f"{g['largest_group']:,}; {g['joined_pairs']:,} of {g['candidate_pairs']:,} candidate "
        f"pairs joined) in {g['group_seconds']:.0f} s; "
        f"total {time.perf_counter() - t0:.0f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
