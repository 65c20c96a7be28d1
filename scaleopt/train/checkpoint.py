"""Orbax checkpoints: every N steps, asynchronous, atomic, verified on restore.

A checkpoint ``RUN_DIR/checkpoints/<step>/`` holds two items, ``state`` (the whole
``TrainState``: step, float32 params, optimizer state, RNG, skip counters) and ``data`` (the
iterator position, JSON), which Orbax writes to a temporary directory and renames when
complete. Once the rename is done, ``manifest.json`` is added: size and CRC-32 of every file,
and the state's health at that step (``consec``, ``param_norm``).

**Restore** (``restore_latest``) tries the checkpoints newest first and takes the first intact
one: its files match the manifest (when it has one: the newest checkpoint of a killed run with
asynchronous saves may not), Orbax restores it into the current shardings, every float leaf is
finite and the data position is readable. Unusable newer checkpoints are moved to
``RUN_DIR/checkpoints.corrupt/`` with a one-line warning each (new saves then reuse their
steps); if none is intact, ``CheckpointError`` names every failure and nothing is moved.

**Retention**: the newest ``keep`` checkpoints plus the newest *healthy* one, which rotation
never deletes. Healthy: ``consec == 0`` (the step's update was applied) and a finite
parameter norm at most ``GROWTH`` times that of the previous healthy checkpoint (or of the
initial parameters), so a state that is finite but has blown up is not healthy.

**State format**: the ``data`` item also records ``state_format``, what the state's arrays mean
beyond their shapes (``state_format``); a restore whose recorded format is not the run's is a
ConfigError naming the checkpoint (``check_state_format``).
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
import re
import shutil
import sys
import zlib
from typing import Any, Optional

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from scaleopt.config import ConfigError

MANIFEST = "manifest.json"
GROWTH = 10.0  # parameter-norm growth between healthy checkpoints beyond which a state "exploded"


class CheckpointError(RuntimeError):
  """A checkpoint could not be written, or no intact one could be read; names the path."""


def _one_line(e: BaseException, limit: int = 200) -> str:
  """The gist of an Orbax / TensorStore error: its OS error if it names one, else the message."""
  msg = " ".join(str(e).split()) or type(e).__name__
  code = re.search(r"os_error_code='(\d+)'", msg)
  if code:
    return f"{os.strerror(int(code.group(1)))}, errno {code.group(1)}"
  return msg if len(msg) <= limit else msg[:limit] + "..."


def _crc(path: pathlib.Path) -> str:
  c = 0
  with open(path, "rb") as f:
    while chunk := f.read(1 << 22):
      c = zlib.crc32(chunk, c)
  return f"{c:08x}"


def _files(step_dir: pathlib.Path) -> dict[str, list]:
  return {p.relative_to(step_dir).as_posix(): [p.stat().st_size, _crc(p)]
          for p in sorted(step_dir.rglob("*")) if p.is_file() and p.name != MANIFEST}


def _all_finite(tree: Any) -> bool:
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  if not leaves:
    return True
  return bool(jax.jit(lambda ls: jnp.all(jnp.stack([jnp.isfinite(x).all() for x in ls])))(leaves))


class _DropOrbaxErrors(logging.Filter):
  """Orbax logs a traceback for a failed save or restore; every such failure surfaces here as a
  one-line CheckpointError (which quotes Orbax's message), so the traceback is dropped."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


_FILTER = _DropOrbaxErrors()


def _barrier(name: str) -> None:
  """All processes wait here (multi-host: process 0 writes manifests and moves directories)."""
  if jax.process_count() > 1:
    ocp.multihost.sync_global_processes(name)


class Checkpointer:
  """Saves, verifies, restores and rotates the checkpoints of one run.

  Args:
    directory: ``RUN_DIR/checkpoints``.
    keep: how many of the newest checkpoints to keep (the newest healthy one is kept too).
    use_async: write in the background (training continues while a save is written).
    init_norm: parameter norm of the initial state, the growth reference until a healthy
      checkpoint exists (None: no growth check then).
  """

  def __init__(self, directory: pathlib.Path, keep: int, use_async: bool = True,
               init_norm: Optional[float] = None):
    self.dir = pathlib.Path(directory).absolute()
    self.keep, self.use_async, self.init_norm = keep, use_async, init_norm
    self.is_main = jax.process_index() == 0
    logging.getLogger("absl").addFilter(_FILTER)  # idempotent
    opts = ocp.CheckpointManagerOptions(max_to_keep=None, create=True,
                                        enable_async_checkpointing=use_async)
    self.mngr = ocp.CheckpointManager(self.dir, options=opts)
    self._pending: Optional[tuple[int, dict]] = None  # saved, manifest not yet written

  # -- health ------------------------------------------------------------------------------

  def manifest(self, step: int) -> Optional[dict]:
    p = self.dir / str(step) / MANIFEST
    try:
      return json.loads(p.read_text())
    except (OSError, ValueError):
      return None

  def last_good_step(self) -> Optional[int]:
    """The newest checkpoint whose manifest says healthy."""
    for s in sorted(self.mngr.all_steps(), reverse=True):
      m = self.manifest(s)
      if m is not None and m.get("healthy"):
        return s
    return None

  def _reference_norm(self) -> Optional[float]:
    good = self.last_good_step()
    return self.manifest(good)["param_norm"] if good is not None else self.init_norm

  def exploded(self, param_norm: float) -> bool:
    """Non-finite, or more than GROWTH x the last healthy checkpoint's parameter norm."""
    ref = self._reference_norm()
    return not math.isfinite(param_norm) or (ref is not None and param_norm > GROWTH * ref)

  def healthy(self, consec: int, param_norm: float) -> bool:
    return consec == 0 and not self.exploded(param_norm)

  # -- save --------------------------------------------------------------------------------

  def latest_step(self) -> Optional[int]:
    return self.mngr.latest_step()

  def save(self, step: int, state: Any, data_state: dict, *, consec: int = 0,
           param_norm: float = float("nan")) -> None:
    """Starts saving (returns once the state is copied off the devices when async).

    Raises CheckpointError when the checkpoint cannot be written (disk full, permissions);
    the checkpoints written before stay intact.
    """
    self._finalize()
    if step in self.mngr.all_steps():
      return
    health = {"consec": int(consec), "param_norm": float(param_norm),
              "healthy": self.healthy(consec, param_norm)}
    try:
      self.mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                   data=ocp.args.JsonSave(data_state)),
                     force=True)
    except Exception as e:  # Orbax/TensorStore raise OSError, ValueError or bare Exception
      self._failed(step, e)
    self._pending = (step, health)
    if not self.use_async:
      self._finalize()

  def _failed(self, step: int, e: BaseException):
    for tmp in self.dir.glob(f"{step}.orbax-checkpoint-tmp*"):  # free what the failed save took
      shutil.rmtree(tmp, ignore_errors=True)
    self._pending = None
    self.mngr.reload()
    raise CheckpointError(f"could not write checkpoint {self.dir}/{step} ({_one_line(e)}); the "
                          "earlier checkpoints are intact, continue with --resume once there is "
                          "space") from None

  def _finalize(self) -> None:
    """Waits for the save in flight, writes its manifest, then applies the retention rule."""
    if self._pending is None:
      return
    step, health = self._pending
    try:
      self.mngr.wait_until_finished()
    except Exception as e:
      self._failed(step, e)
    self._pending = None
    step_dir = self.dir / str(step)
    if self.is_main and step_dir.is_dir():
      man = {"step": step, **health, "files": _files(step_dir)}
      tmp = step_dir / (MANIFEST + ".tmp")
      try:
        tmp.write_text(json.dumps(man))
        os.replace(tmp, step_dir / MANIFEST)
      except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"could not write {step_dir / MANIFEST} ({_one_line(e)})") from None
    _barrier(f"scaleopt_manifest_{step}")
    self._prune()

  def _prune(self) -> None:
    steps = sorted(self.mngr.all_steps())
    keep = set(steps[-self.keep:])
    good = self.last_good_step()
    if good is not None:
      keep.add(good)
    for s in steps:
      if s not in keep:
        self.mngr.delete(s)

  # -- restore -----------------------------------------------------------------------------

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    """(state, data_state) of one step, unverified; ``abstract_state`` is a tree of
    ShapeDtypeStruct with shardings."""
    out = self.mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    return out["state"], out["data"]

  def verify_files(self, step: int) -> None:
    """Raises CheckpointError when a file differs from the manifest (no manifest: no check)."""
    step_dir = self.dir / str(step)
    m = self.manifest(step)
    if m is None:
      if (step_dir / MANIFEST).exists():
        raise CheckpointError(f"{MANIFEST} is unreadable")
      return
    for rel, (size, crc) in m["files"].items():
      p = step_dir / rel
      if not p.is_file():
        raise CheckpointError(f"{rel} is missing")
      if p.stat().st_size != size:
        raise CheckpointError(f"{rel} has {p.stat().st_size} bytes, {size} were written")
      if _crc(p) != crc:
        raise CheckpointError(f"{rel} does not match its checksum")

  def restore_verified(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    """Like ``restore``, but any failure (files, Orbax, structure, non-finite values, data
    position) raises CheckpointError with a one-line reason."""
    self.verify_files(step)
    try:
      state, data_state = self.restore(step, abstract_state)
    except Exception as e:  # truncated / deleted files, missing items, structure mismatch
      if "tree structures do not match" in str(e):  # e.g. an optimizer state with new fields
        raise CheckpointError("its state has another structure than this run's (written by "
                              "another scaleopt version or config): " + _one_line(e)) from None
      raise CheckpointError(_one_line(e)) from None
    if not _all_finite(state):
      raise CheckpointError("the restored state holds non-finite values")
    if not isinstance(data_state, dict) or not isinstance(data_state.get("chunk"), int):
      raise CheckpointError(f"the data position {data_state!r} is unreadable")
    return state, data_state

  def restore_latest(self, abstract_state: Any) -> Optional[tuple[int, Any, dict]]:
    """(step, state, data_state) of the newest intact checkpoint, None if there is none at all.

    Newer unusable checkpoints are moved to ``checkpoints.corrupt/`` with a one-line warning;
    CheckpointError if checkpoints exist but none is intact (then nothing is moved).
    """
    self._finalize()
    self.mngr.reload()
    steps = sorted(self.mngr.all_steps(), reverse=True)
    bad: list[tuple[int, str]] = []
    for s in steps:
      try:
        state, data_state = self.restore_verified(s, abstract_state)
      except CheckpointError as e:
        bad.append((s, str(e)))
        continue
      for b, why in bad:
        self._quarantine(b, why, s)
      if bad:
        _barrier(f"scaleopt_quarantine_{s}")
        self.mngr.reload()
      return s, state, data_state
    if bad:
      raise CheckpointError(f"no intact checkpoint in {self.dir}: " + "; ".join(
          f"step {s}: {why}" for s, why in bad) + " (move the directory away to start over)")
    return None

  def _quarantine(self, step: int, why: str, used: int) -> None:
    dest_root = self.dir.parent / (self.dir.name + ".corrupt")
    dest = dest_root / str(step)
    k = 1
    while dest.exists():
      dest, k = dest_root / f"{step}-{k}", k + 1
    if self.is_main:
      dest_root.mkdir(parents=True, exist_ok=True)
      shutil.move(str(self.dir / str(step)), str(dest))
    print(f"warning: checkpoint {self.dir}/{step} is unusable ({why}); moved it to {dest} and "
          f"resumed from step {used}", file=sys.stderr)

  def wait(self) -> None:
    self._finalize()

  def close(self) -> None:
    try:
      self._finalize()
    finally:
      self.mngr.close()


def abstract(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


STATE_FORMAT = "state_format"  # key of the checkpoint's data item that describes the state


def state_format(cfg) -> dict:
  """What a checkpoint's arrays mean beyond their shapes, for a ``TrainConfig``:
  ``shampoo_blocks``, the order of Shampoo's factor blocks (``major``: by the model's FSDP
  dims, ``models.fsdp_dims``; ``layers``: stacked layers first, ``optimizer.extra.block_major:
  layers``). A checkpoint without the record holds the ``layers`` order."""
  opt = cfg.optimizer
  if not opt.name.startswith("shampoo"):
    return {}
  return {"shampoo_blocks": "layers" if opt.hyperparameters().block_major == "layers"
          else "major"}


def with_state_format(cfg, data_state: dict) -> dict:
  """The checkpoint's data item: the iterator position and ``state_format``."""
  return {**data_state, STATE_FORMAT: state_format(cfg)}


def check_state_format(cfg, data_state: dict, where: str) -> dict:
  """The iterator position of a restored data item; ConfigError (one line naming ``where``)
  when its state format is not this run's."""
  data_state = dict(data_state)
  saved = data_state.pop(STATE_FORMAT, {}).get("shampoo_blocks", "layers")
  want = state_format(cfg).get("shampoo_blocks", "layers")
  if saved != want:
    fix = ("set optimizer.extra.block_major: layers" if saved == "layers"
           else "remove optimizer.extra.block_major")
    raise ConfigError(f"{where} holds Shampoo factors in the {saved!r} block order and this run "
                      f"orders them {want!r}; {fix} to resume it")
  return data_state
