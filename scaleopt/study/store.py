"""A study's finished cells in one file: ``DIR/cells.jsonl``, one JSON object per line.

Each line is one finished cell::

  {"cell":    {"id", "arm", "grid", "lr", "seed", "stage"},   the cell's key
   "config":  {the cell's training config, flattened, without cosmetic keys}
   "result":  {status, val_loss, test_loss, gradient_passes, ...},   one results.csv row
   "summary": {the run's summary.json},
   "provenance": {commit, dirty, corpus hashes, versions, XLA flags, deterministic, devices}
                (scaleopt.train.provenance; the summary's, null for cells recorded before it),
   "curves":  {"loss": [[step, value], ...], "eval_loss": [[step, value], ...],
               "bc_correction/<group>": [[step, value], ...]}}   (the last on telemetry steps)

A cell trains in a work folder ``DIR/cells/<arm>/<key>/`` (config, metrics, checkpoints); once
its ``result.json`` is written the runner folds the folder into the store (``absorb``) and
deletes it, unless the study keeps checkpoints (``engine.keep_checkpoints``: the whole folder
stays). Only the curves the report draws are stored; the other metrics columns go with the
folder. Finished folders the store lacks (a crash between the two steps, or a study folder of
the older one-folder-per-cell layout) are folded in, and left in place, at the start of every
run; ``python -m scaleopt.study.convert DIR --remove`` folds them in once and deletes them.

Writers append under an exclusive ``flock`` of ``cells.jsonl`` and skip cells already
present, so workers sharing one ``--out`` never write a cell twice or interleave lines; readers
take the shared lock. Store files of different machines merge by concatenation: a cell id seen
twice counts once (the first line).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import pathlib
import shutil
import sys
from typing import Iterator

STORE = "cells.jsonl"
CURVE_KEYS = ("loss", "eval_loss")
# Telemetry curves kept per group (``run.telemetry_every``): the variance correction's size.
TELEMETRY_PREFIXES = ("bc_correction/",)
CELL_KEYS = ("id", "arm", "grid", "lr", "seed", "stage")


def _clean(v):
  """JSON without NaN/inf (written as null), recursively."""
  if isinstance(v, float) and not math.isfinite(v):
    return None
  if isinstance(v, dict):
    return {k: _clean(x) for k, x in v.items()}
  if isinstance(v, (list, tuple)):
    return [_clean(x) for x in v]
  return v


@contextlib.contextmanager
def _locked(out: pathlib.Path, mode: int) -> Iterator[None]:
  if mode == fcntl.LOCK_EX:
    out.mkdir(parents=True, exist_ok=True)
  # the lock is on the store file itself; readers open it read-only (a read-only checkout)
  with open(out / STORE, "a" if mode == fcntl.LOCK_EX else "r") as fh:
    fcntl.flock(fh, mode)
    try:
      yield
    finally:
      fcntl.flock(fh, fcntl.LOCK_UN)


def _read_unlocked(out: pathlib.Path) -> list[dict]:
  p = out / STORE
  if not p.is_file():
    return []
  recs, seen = [], set()
  for n, line in enumerate(p.read_text().splitlines(), 1):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
      cid = rec["cell"]["id"]
    except (ValueError, KeyError, TypeError):
      print(f"warning: {p}:{n} is not a cell record; skipped (that cell will be rerun)",
            file=sys.stderr)
      continue
    if cid not in seen:
      seen.add(cid)
      recs.append(rec)
  return recs


def read(out: pathlib.Path) -> list[dict]:
  """The finished cells of study folder ``out``, in the order they were recorded."""
  out = pathlib.Path(out)
  if not (out / STORE).is_file():
    return []
  with _locked(out, fcntl.LOCK_SH):
    return _read_unlocked(out)


def append(out: pathlib.Path, recs: list[dict]) -> int:
  """Appends the records whose cell id is not yet stored; returns how many were written."""
  out = pathlib.Path(out)
  with _locked(out, fcntl.LOCK_EX):
    have = {r["cell"]["id"] for r in _read_unlocked(out)}
    new, lines = set(), []
    for r in recs:
      cid = r["cell"]["id"]
      if cid not in have and cid not in new:
        new.add(cid)
        lines.append(json.dumps(_clean(r), separators=(",", ":")) + "\n")
    if lines:
      p = out / STORE
      lead = "\n" if p.is_file() and p.stat().st_size and not p.read_bytes().endswith(b"\n") \
          else ""  # a line cut by a crash stays on its own line (and is skipped on read)
      with open(p, "a") as fh:
        fh.write(lead + "".join(lines))
        fh.flush()
  return len(lines)


def _curves(metrics: pathlib.Path) -> dict:
  out = {k: [] for k in CURVE_KEYS}
  if metrics.is_file():
    for line in metrics.read_text().splitlines():
      if line.strip():
        r = json.loads(line)
        for k, v in r.items():
          if v is not None and (k in CURVE_KEYS or k.startswith(TELEMETRY_PREFIXES)):
            out.setdefault(k, []).append([r["step"], v])
  return out


def record(d: pathlib.Path) -> dict:
  """The store record of a finished cell folder (``result.json`` present)."""
  res = json.loads((d / "result.json").read_text())
  meta = json.loads((d / "cell.json").read_text()) if (d / "cell.json").is_file() else {}
  cell = {k: meta[k] for k in CELL_KEYS if k in meta} or {
      k: res[k] for k in CELL_KEYS if k in res}
  cell.setdefault("id", res["id"])
  summ = d / "summary.json"
  summary = json.loads(summ.read_text()) if summ.is_file() else {}
  return {"cell": cell, "config": meta.get("config"), "result": res, "summary": summary,
          "provenance": summary.get("provenance"), "curves": _curves(d / "metrics.jsonl")}


def finished_folders(out: pathlib.Path) -> list[pathlib.Path]:
  return sorted(p.parent for p in (pathlib.Path(out) / "cells").glob("*/*/result.json"))


def absorb(out: pathlib.Path, folders: list[pathlib.Path] | None = None,
           remove: bool = False) -> int:
  """Folds finished cell folders (every ``DIR/cells/*/*`` with a ``result.json`` when
  ``folders`` is None) into the store, then, with ``remove``, deletes those folders. Returns
  the cells added."""
  out = pathlib.Path(out)
  folders = finished_folders(out) if folders is None else folders
  n = append(out, [record(d) for d in folders])
  if remove:
    for d in folders:
      shutil.rmtree(d, ignore_errors=True)
      for parent in (d.parent, d.parent.parent):  # the arm's folder and cells/, once empty
        with contextlib.suppress(OSError):
          parent.rmdir()
  return n


def finished(out: pathlib.Path) -> list[dict]:
  """Every finished cell: the store's records, then those of finished folders not yet in it."""
  recs = read(out)
  have = {r["cell"]["id"] for r in recs}
  for d in finished_folders(out):
    rec = record(d)
    if rec["cell"]["id"] not in have:
      have.add(rec["cell"]["id"])
      recs.append(rec)
  return recs


def rows(out: pathlib.Path) -> list[dict]:
  """One dict per finished cell (``finished``): its result (NaN for missing losses), its
  ``curves``, its ``config`` fingerprint and its ``provenance``."""
  out_rows = []
  for rec in finished(out):
    r = dict(rec["result"])
    for k in ("val_loss", "test_loss", "train_loss"):
      if r.get(k) is None:
        r[k] = math.nan
    curves = rec.get("curves") or {}
    r["curves"] = {k: {s: v for s, v in curves.get(k, [])}
                   for k in dict.fromkeys(CURVE_KEYS + tuple(curves))}
    r["config"] = rec.get("config")
    r["provenance"] = rec.get("provenance") or rec.get("summary", {}).get("provenance")
    out_rows.append(r)
  return out_rows


def convert(study: pathlib.Path, remove: bool = False) -> str:
  """Folds every finished cell folder of ``study`` into its store; with ``remove``, deletes
  them once each is there (unfinished folders, e.g. checkpoints of a cell still training,
  stay). Returns a one-line account."""
  folders = finished_folders(study)
  added = absorb(study, folders)
  stored = {r["cell"]["id"] for r in read(study)}
  lost = [d for d in folders if json.loads((d / "result.json").read_text())["id"] not in stored]
  if lost:
    raise OSError(f"{lost[0]}: not found in {study / STORE} after writing it; nothing removed")
  if remove:
    absorb(study, folders, remove=True)
  return (f"{study}: {added} cell(s) added, {len(stored)} in {STORE}"
          + (f", {len(folders)} folder(s) removed" if remove else ""))

