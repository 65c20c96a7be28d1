"""``scaleopt study``: run the cells of a study (resumably, in pieces), then report.

Folder layout (``--out DIR``)::

  DIR/study.yaml                 the study as run (after --set)
  DIR/cells.jsonl                one line per finished cell: key, config, result, summary,
                                 loss curves (``scaleopt.study.store``)
  DIR/results.csv DIR/summary.md DIR/curves.png DIR/lr.png   the report, rebuilt from it
  DIR/cells/<arm>/<k=v,...,lr=..,seed=..>/     a cell while it trains:
      cell.json                  the cell and its config fingerprint (checked on every run)
      config.yaml metrics.jsonl summary.json checkpoints/   (a training run)
      result.json                written last: the cell is finished; the folder then goes into
                                 cells.jsonl and is deleted (kept with engine.keep_checkpoints)
  DIR/at_once/<group>            cells of a compile group that fit at once (after an OOM)

A cell in ``cells.jsonl`` is skipped; one with checkpoints resumes from the latest. Cells of
one condition (arm x grid point) always go to the same ``--shard i/n`` (condition k -> shard
k mod n), so the extra seeds at the best learning rate are known where the search ran; folders
from different machines merge by concatenating their ``cells.jsonl`` (a cell listed twice
counts once), and a rerun (or ``--report-only``) rebuilds the report from every finished
cell present. A vmapped unit that runs out of device
memory is split in halves (and the group's limit kept in ``DIR/at_once``), down to one cell.

Several workers on one machine (one per GPU) share one ``--out`` with ``--claim TOKEN``: each
worker takes whole conditions (vmap engine) or single cells (loop engine), the next unfinished
one first, by creating ``DIR/claims/TOKEN/<k>`` (condition k; ``<k>_<hash of the cell id>``
for a cell) with an atomic ``mkdir``, so slow and fast conditions balance themselves.
All workers of one launch use the same token; a new launch uses a new token, so claims of an
interrupted launch never block it. Whatever the tokens, a cell trains in one process at a time:
a worker takes the owner lock of the cell's folder (``scaleopt.train.runfolder.owner``) without
waiting and skips a cell that another live process holds. Claiming workers leave the report
to one ``--report-only`` run at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import hashlib
import json
import math
import os
import pathlib
import signal
import sys
import threading
import time
from typing import Optional

import yaml

from scaleopt.study import config as study_config
from scaleopt.study import report, seedplan, store
from scaleopt.study.config import Cell, ConfigError, Study
from scaleopt.train import runfolder

EXIT_OK, EXIT_CONFIG, EXIT_SIGNAL = 0, 2, 143


def cell_dir(out: pathlib.Path, cell: Cell) -> pathlib.Path:
  return out / "cells" / cell.id


def latest_checkpoint(d: pathlib.Path) -> Optional[int]:
  ck = d / "checkpoints"
  steps = [int(p.name) for p in ck.iterdir() if p.is_dir() and p.name.isdigit()] \
      if ck.is_dir() else []
  return max(steps) if steps else None


def check_cell_folder(st: Study, cell: Cell, d: pathlib.Path) -> None:
  """A folder from an earlier run must hold the same cell config (else: ConfigError)."""
  meta = d / "cell.json"
  if not meta.is_file():
    return
  old = study_config.without_cosmetic(json.loads(meta.read_text())["config"])
  old = {**{k: v for k, v in study_config.ADDED_KEYS.items() if k not in old}, **old}
  new = study_config.fingerprint(st.cell_config(cell).to_dict())
  for k in sorted(set(old) | set(new)):
    if old.get(k, "<absent>") != new.get(k, "<absent>"):
      raise ConfigError(f"cell folder {str(d)!r} was run with {k}={old.get(k, '<absent>')!r}, "
                        f"the study now says {new.get(k, '<absent>')!r}; use another --out")


def write_cell_meta(st: Study, cell: Cell, d: pathlib.Path) -> None:
  d.mkdir(parents=True, exist_ok=True)
  meta = {"id": cell.id, "arm": cell.arm, "grid": dict(cell.grid), "lr": cell.lr,
          "seed": cell.seed, "stage": cell.stage,
          "config": study_config.fingerprint(st.cell_config(cell).to_dict())}
  (d / "cell.json").write_text(json.dumps(meta, indent=1) + "\n")


def write_result(d: pathlib.Path, result: dict) -> None:
  tmp = d / "result.json.tmp"
  tmp.write_text(json.dumps(report.clean(result), indent=1) + "\n")
  os.replace(tmp, d / "result.json")


def plan(st: Study, out: pathlib.Path) -> list[Cell]:
  """Unfinished cells: the learning-rate search, plus the extra seeds at the best lr of every
  condition whose search is complete, plus (``sequential``) the next seeds of the contrasts
  whose interval is still wider than the target (``seedplan.sequential_cells``)."""
  done = report.finished_ids(out)
  todo = [c for c in st.search_cells() if c.id not in done]
  if st.best_lr_seeds or st.sequential:
    rows = report.read_rows(out)
    for cond in dict.fromkeys(c.condition for c in st.search_cells()):
      best = report.best_lr(st, rows, cond)
      if best is not None:
        todo += [c for c in st.best_lr_cells(cond[0], cond[1], best) if c.id not in done]
    if st.sequential:
      todo += [c for c in seedplan.sequential_cells(st, report.analyse(st, rows))
               if c.id not in done]
  once: dict = {}
  for c in todo:  # a cell wanted by two stages runs once, under the first
    once.setdefault(c.id, c)
  return list(once.values())


def conditions(st: Study) -> list[tuple]:
  return list(dict.fromkeys(c.condition for c in st.search_cells()))


def fits(out: pathlib.Path, group: str) -> int:
  """How many cells of compile group ``group`` fit on the device at once, as learned from an
  out-of-memory error (``DIR/at_once/<group>``; unbounded when absent)."""
  f = out / "at_once" / group
  return int(f.read_text()) if f.is_file() else 1 << 30


def units(st: Study, cells: list[Cell], out: pathlib.Path) -> list[list[Cell]]:
  """Cells grouped for execution: with the vmap engine, cells of one compile group (equal
  config up to lr and seed) and equal checkpoint step, at most ``cells_at_once`` per unit
  (one for optimizers outside ``engines.VMAP_SAFE``); with the loop engine, one cell each."""
  from scaleopt.study import engines
  if st.engine == "loop":
    return [[c] for c in cells]
  groups: dict = {}
  for c in cells:
    cfg = st.cell_config(c)
    k = (study_config.group_key(cfg), latest_checkpoint(cell_dir(out, c)))
    groups.setdefault(k, []).append(c)
  out_units = []
  for (gk, _), cs in groups.items():
    cfg = st.cell_config(cs[0])
    size = (min(st.cells_at_once, fits(out, gk)) if cfg.optimizer.name in engines.VMAP_SAFE
            and engines.vmap_ok(cfg) else 1)
    out_units += [cs[i:i + size] for i in range(0, len(cs), size)]
  return out_units


class _Stop:
  """The study's stop flag: a deadline (``--max-minutes``) or SIGTERM/SIGINT.

  The vmap engine polls the flag every step. While a loop-engine cell trains,
  ``scaleopt.train.loop`` owns SIGTERM/SIGINT (it checkpoints and raises ``Interrupted``), so
  at the deadline a watcher thread sends this process one SIGTERM if, and only if, the loop's
  handler is installed (a second signal would make the loop exit at once); between cells the
  flag alone stops the study.
  """

  def __init__(self, max_minutes: Optional[float]):
    self.deadline = time.time() + 60 * max_minutes if max_minutes else None
    self.signal, self.expired = None, False
    self._old, self._thread, self._done = {}, None, threading.Event()
    self._lock = threading.Lock()  # no signal once __exit__ has begun restoring handlers
    self._handler = self._handle  # one bound-method object, to recognise it in getsignal

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGTERM, signal.SIGINT):
        self._old[sig] = signal.signal(sig, self._handler)
    if self.deadline is not None:
      self._thread = threading.Thread(target=self._watch, daemon=True)
      self._thread.start()
    return self

  def _watch(self) -> None:
    while not self._done.wait(min(1.0, max(0.2, self.deadline - time.time()))):
      if time.time() < self.deadline:
        continue
      self.expired = True
      with self._lock:
        if self._done.is_set():
          return
        if self._old and signal.getsignal(signal.SIGTERM) is not self._handler:
          os.kill(os.getpid(), signal.SIGTERM)  # the training loop's handler: checkpoint, stop
          return

  def _handle(self, signum, _frame):
    if not self.expired:
      self.signal = signal.Signals(signum).name

  def __call__(self) -> bool:
    return self.signal is not None or self.expired or (
        self.deadline is not None and time.time() >= self.deadline)

  def reason(self) -> Optional[str]:
    if self.signal is not None:
      return self.signal
    return "deadline" if self() else None

  def __exit__(self, *exc):
    with self._lock:
      self._done.set()
    for sig, old in self._old.items():
      signal.signal(sig, old)


def take_cells(cells: list[Cell], out: pathlib.Path, held: contextlib.ExitStack) -> list[Cell]:
  """The cells whose folder's owner lock (``scaleopt.train.runfolder.owner``) this process now
  holds, in ``held``, without waiting; a cell another live process trains, or that finished
  meanwhile, is left out. All taken cells resume from the same checkpoint step."""
  taken = []
  for c in cells:
    try:
      held.enter_context(runfolder.owner(str(cell_dir(out, c)), command="scaleopt study"))
    except ConfigError:
      continue
    taken.append(c)
  done = report.finished_ids(out)
  taken = [c for c in taken if c.id not in done]
  step = latest_checkpoint(cell_dir(out, taken[0])) if taken else None
  return [c for c in taken if latest_checkpoint(cell_dir(out, c)) == step]


def run_unit(st: Study, cells: list[Cell], out: pathlib.Path, stop: _Stop) -> list[str]:
  """Trains one unit; records every finished cell in ``cells.jsonl``; returns the statuses
  ("busy" for a cell another process holds: ``take_cells``)."""
  with contextlib.ExitStack() as held:
    taken = take_cells(cells, out, held)
    res = dict(zip(taken, _run_taken(st, taken, out, stop))) if taken else {}
  return [res.get(c, "busy") for c in cells]


def _run_taken(st: Study, cells: list[Cell], out: pathlib.Path, stop: _Stop) -> list[str]:
  from scaleopt.study import engines
  dirs = [cell_dir(out, c) for c in cells]
  for c, d in zip(cells, dirs):
    check_cell_folder(st, c, d)
    write_cell_meta(st, c, d)
  cfgs = [st.cell_config(c) for c in cells]
  step = latest_checkpoint(dirs[0])
  t0 = time.time()
  if st.engine == "vmap" and engines.vmap_ok(cfgs[0]):
    res, group = None, study_config.group_key(cfgs[0])
    try:
      res = engines.run_vmapped(cfgs, dirs, step, stop, key=group)
    except Exception as e:  # noqa: BLE001 - only out-of-memory is handled; the rest re-raises
      if len(cells) == 1 or "RESOURCE_EXHAUSTED" not in str(e):
        raise
    if res is None:  # outside the except block: the failed unit's arrays are freed by now
      half = (len(cells) + 1) // 2
      (out / "at_once").mkdir(exist_ok=True)
      (out / "at_once" / group).write_text(f"{half}\n")
      print(f"[study {st.name}] {len(cells)} cells at once do not fit in device memory; "
            f"running {half} and {len(cells) - half}", flush=True)
      return (_run_taken(st, cells[:half], out, stop)
              + _run_taken(st, cells[half:], out, stop))
  else:
    res = [{"status": "interrupted"} if stop() else
           engines.run_loop(cfg, d, latest_checkpoint(d) is not None)
           for cfg, d in zip(cfgs, dirs)]
  finished = []
  for c, d, r in zip(cells, dirs, res):
    if r["status"] != "interrupted":
      write_result(d, {"id": c.id, "arm": c.arm, **dict(c.grid), "lr": c.lr, "seed": c.seed,
                       "stage": c.stage, **r})
      finished.append(d)
  store.absorb(out, finished, remove=not st.keep_checkpoints)
  print(f"[study {st.name}] {len(cells)} cell(s) in {time.time() - t0:.0f} s: "
        + ", ".join(f"{c.id} {r['status']} val {r.get('val_loss', math.nan):.4f}"
                    for c, r in zip(cells, res)), flush=True)
  return [r["status"] for r in res]


def parse_shard(shard: Optional[str]) -> tuple[int, int]:
  if not shard:
    return 0, 1
  try:
    i, n = (int(x) for x in shard.split("/"))
  except ValueError:
    raise ConfigError(f"--shard {shard!r} must look like i/n (0 <= i < n)") from None
  if not 0 <= i < n:
    raise ConfigError(f"--shard {shard!r} must look like i/n (0 <= i < n)")
  return i, n


def select(st: Study, cells: list[Cell], shard: Optional[str], patterns: Optional[list[str]]
           ) -> list[Cell]:
  """This shard's cells (condition k of the study goes to shard k mod n) that match one of the
  glob ``patterns`` (all when None)."""
  si, sn = parse_shard(shard)
  index = {c: k for k, c in enumerate(conditions(st))}
  return [c for c in cells if index[c.condition] % sn == si and (
      not patterns or any(fnmatch.fnmatch(c.id, p) for p in patterns))]


class _Claims:
  """What this worker holds under ``DIR/claims/TOKEN`` (``--claim``): whole conditions with
  the vmap engine (a condition's cells train as one compile group), single cells with the loop
  engine (one cell per process anyway, so the GPUs stay busy to the end of a study)."""

  def __init__(self, st: Study, out: pathlib.Path, token: str):
    if not token or not all(ch.isalnum() or ch in "-_." for ch in token) or token[0] == ".":
      raise ConfigError(f"--claim {token!r} must be a name of letters, digits, - _ .")
    self.dir = out / "claims" / token
    self.index = {c: k for k, c in enumerate(conditions(st))}
    self.per_cell = st.engine == "loop"
    self.held: set = set()

  def _key(self, c: Cell) -> str:
    """``<k>`` (condition k) or, per cell, ``<k>_<hash of the cell id>`` (a short name whatever
    the grid: a cell id can be longer than a file name may be)."""
    k = str(self.index[c.condition])
    return f"{k}_{hashlib.sha1(c.id.encode()).hexdigest()[:16]}" if self.per_cell else k

  def mine(self, todo: list[Cell]) -> list[Cell]:
    """The cells this worker holds; when none are left, claims the first free condition (or
    cell) with unfinished cells."""
    own = [c for c in todo if self._key(c) in self.held]
    if own:
      return own
    self.dir.mkdir(parents=True, exist_ok=True)
    in_order = sorted(todo, key=lambda c: self.index[c.condition])  # stable: plan order within
    for k in dict.fromkeys(map(self._key, in_order)):
      if k in self.held:
        continue
      try:
        (self.dir / k).mkdir()
      except FileExistsError:
        continue
      self.held.add(k)
      return [c for c in todo if self._key(c) == k]
    return []


def run_study(st: Study, out: pathlib.Path, *, cells: Optional[list[str]] = None,
              max_minutes: Optional[float] = None, shard: Optional[str] = None,
              train: bool = True, claim: Optional[str] = None) -> dict:
  """Runs what is left of a study (this shard, matching ``cells``; with ``claim``, the
  conditions this worker claims), then writes the report (not while claiming).

  Returns {"ran": n, "left": n, "stopped": reason or None}.
  """
  parse_shard(shard)
  out.mkdir(parents=True, exist_ok=True)
  claims = _Claims(st, out, claim) if claim is not None else None
  if claims is None or not (out / "study.yaml").is_file():
    (out / "study.yaml").write_text(yaml.safe_dump(st.raw, sort_keys=False))
  store.absorb(out)  # finished folders the store lacks (kept in place)
  ran, stopped, busy = 0, None, set()
  with _Stop(max_minutes) as stop:
    while train:
      todo = [c for c in select(st, plan(st, out), shard, cells) if c.id not in busy]
      if claims is not None:
        todo = claims.mine(todo)
      if not todo:
        break
      progress = False
      for u in units(st, todo, out):
        if stop():
          break
        statuses = run_unit(st, u, out, stop)
        held = {c.id for c, s in zip(u, statuses) if s == "busy"}  # by another process
        n_done = sum(s not in ("interrupted", "busy") for s in statuses)
        ran += n_done
        progress |= n_done > 0 or bool(held - busy)  # new busy cells: plan without them
        busy |= held
        if "interrupted" in statuses:
          if not stop():  # the training loop caught SIGTERM/SIGINT itself
            stop.signal = "SIGTERM/SIGINT"
          break
      if stop():
        stopped = stop.reason()
        break
      if not progress:
        break
  left = len(select(st, plan(st, out), shard, cells))
  if claims is None:
    report.write_report(st, out)
  return {"ran": ran, "left": left, "stopped": stopped}


def study_main(config: str, out: str, overrides: Optional[list[str]] = None,
               cells: Optional[list[str]] = None, max_minutes: Optional[float] = None,
               shard: Optional[str] = None, report_only: bool = False,
               list_only: bool = False, claim: Optional[str] = None) -> int:
  """``scaleopt study``: 0 when done or cut by --max-minutes, 2 on a config error, 143 when
  stopped by SIGTERM/SIGINT (everything checkpointed; rerun to continue). ``list_only``
  prints what is left for this shard, unit by unit, and trains nothing."""
  from scaleopt.train.data import DataError
  try:
    st = study_config.load(config, overrides)
    from scaleopt.train import determinism  # one process trains many cells: flags for all
    determinism.prepare(any(determinism.wanted(st.cell_raw(c)) for c in st.search_cells()))
    if max_minutes is not None and max_minutes <= 0:
      raise ConfigError(f"--max-minutes {max_minutes} must be > 0")
    if list_only:
      todo = select(st, plan(st, pathlib.Path(out)), shard, cells)
      for u in units(st, todo, pathlib.Path(out)):
        print(f"{len(u)} at once: " + " ".join(c.id for c in u))
      print(f"study {st.name}: {len(todo)} cell(s) left (this shard; extra seeds at the best lr "
            "appear once a condition's search is finished"
            + (", sequential seeds once a contrast's seeds are finished)" if st.sequential
               else ")"))
      return EXIT_OK
    res = run_study(st, pathlib.Path(out), cells=cells, max_minutes=max_minutes, shard=shard,
                    train=not report_only, claim=None if report_only else claim)
  except (ConfigError, DataError) as e:
    print(f"config error: {e}", file=sys.stderr)
    return EXIT_CONFIG
  msg = f"study {st.name}: {res['ran']} cell(s) trained now, {res['left']} left"
  if res["stopped"]:
    msg += f" (stopped: {res['stopped']}; rerun the same command to continue)"
  print(f"{msg}; " + ("report: rerun with --report-only once every worker is done"
                      if claim and not report_only else f"report in {out}/summary.md"))
  return EXIT_SIGNAL if res["stopped"] not in (None, "deadline") else EXIT_OK
