"""Converts study folders of the one-folder-per-cell layout (``cells/<arm>/<key>/`` with
``result.json``, ``metrics.jsonl``, ...) into their ``cells.jsonl`` (``scaleopt.study.store``)::

  python -m scaleopt.study.convert STUDY_DIR [STUDY_DIR ...] [--remove]

Cells already in the store are left as they are, so a second run adds nothing; ``--remove``
deletes each finished folder once it is stored (unfinished folders stay).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from scaleopt.study import store


def main(argv: list[str] | None = None) -> int:
  """``python -m scaleopt.study.convert STUDY_DIR ... [--remove]``: converts study folders of
  the one-folder-per-cell layout; then rebuild each report with ``scaleopt study --config ...
  --out STUDY_DIR --report-only``."""
  ap = argparse.ArgumentParser(prog="python -m scaleopt.study.convert",
                               description="fold finished cell folders into cells.jsonl")
  ap.add_argument("studies", nargs="+", type=pathlib.Path)
  ap.add_argument("--remove", action="store_true",
                  help="delete each finished cell folder once it is in cells.jsonl")
  args = ap.parse_args(argv)
  for s in args.studies:
    if not (s / "cells").is_dir():
      print(f"error: {s}: no cells/ folder to convert", file=sys.stderr)
      return 2
  for s in args.studies:
    print(store.convert(s, args.remove))
  return 0


if __name__ == "__main__":
  sys.exit(main())
