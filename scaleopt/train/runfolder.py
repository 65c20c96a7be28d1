"""The run folder (``--out``): a local path or a ``gs://`` bucket folder, the same for every
process of a run, one owner.

* A local folder or ``gs://bucket/path`` (``scaleopt.train.storage``); other URLs are refused
  in one line. Token shards may be any fsspec URL (``data.path``).
* Every process of a multi-process run must name the same folder (compared as an absolute
  path or as the URL, after ``jax.distributed.initialize``): a process given another one would
  write its checkpoint shards elsewhere and leave the others waiting forever in the
  checkpoint's finish.
* One run owns a folder at a time. Locally, process 0 holds an exclusive ``flock`` on
  ``RUN_DIR/owner.lock`` (which names the holder: host, pid, start time) for the run's life.
  A second run on the same folder stops at start with one line naming the holder. The kernel
  drops the lock when its process ends, however it ends, so a crashed run leaves nothing
  stale; the file is removed when the run ends normally.
* On a bucket there are no file locks: process 0 creates ``RUN_DIR/owner.lock`` with the
  store's create-if-absent precondition (``ifGenerationMatch=0``) and renews it as a lease
  (a rewrite conditional on the generation it wrote last) every ``LEASE_S / 3`` seconds. A
  second run stops at start with one line naming the holder. A holder that died leaves the
  object behind; it is taken over, again by a conditional rewrite (of the generation read,
  so of two runs taking over only one wins), when its process is gone from this host or when
  its lease is older than ``LEASE_S`` seconds (``SCALEOPT_OWNER_LEASE_S``, default 120). The
  object is deleted when the run ends normally.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import pathlib
import socket
import sys
import threading
import time
import uuid
from typing import Iterator, Optional

from scaleopt.train import storage
from scaleopt.train.config import ConfigError

LOCK = "owner.lock"


def check_local(out_dir: str) -> None:
  """ConfigError (one line) for a run folder URL that cannot hold a run (``storage``)."""
  storage.check_run_folder(out_dir)


def _canonical(out_dir: str) -> str:
  return str(out_dir).rstrip("/") if storage.is_url(out_dir) else os.path.abspath(out_dir)


def path_digest(out_dir: str) -> int:
  """A 63-bit digest of the folder's absolute path or URL (what the processes compare)."""
  h = hashlib.blake2b(_canonical(out_dir).encode(), digest_size=8).digest()
  return int.from_bytes(h, "big") >> 1


def _jax_gather(value: int) -> list[int]:
  """The value of every process (JAX's all-gather; one process: itself)."""
  import jax
  if jax.process_count() == 1:
    return [value]
  import numpy as np
  from jax.experimental import multihost_utils
  return [int(x) for x in np.asarray(
      multihost_utils.process_allgather(np.array([value], np.int64))).ravel()]


def check_agree(out_dir: str, gather=_jax_gather) -> None:
  """ConfigError (one line, in every process) unless all processes name the same folder.
  ``gather(int) -> list[int]``: the values of all processes."""
  mine = path_digest(out_dir)
  seen = gather(mine)
  if len(set(seen)) > 1:
    others = sum(v != mine for v in seen)
    raise ConfigError(f"--out {_canonical(out_dir)!r}: {others} of the run's {len(seen)} "
                      "processes were given another run folder; start every process with the "
                      "same --out")


def _holder(path: pathlib.Path) -> str:
  try:
    h = json.loads(path.read_text())
    return f"host {h['host']}, pid {h['pid']}, started {h['started']}"
  except (OSError, ValueError, KeyError, TypeError):
    return "a process that has not written its name yet"


@contextlib.contextmanager
def owner(out_dir: str, command: str = "scaleopt train") -> Iterator[None]:
  """Holds ``RUN_DIR/owner.lock`` for the body; ConfigError naming the holder if another
  run holds it. Creates the folder (and removes it again if the body leaves it empty)."""
  if storage.is_url(out_dir):
    with bucket_owner(str(out_dir), command):
      yield
    return
  out = pathlib.Path(out_dir)
  created = not out.exists()
  out.mkdir(parents=True, exist_ok=True)
  path = out / LOCK
  while True:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      os.close(fd)
      raise ConfigError(f"--out {str(out)!r} is in use by another run ({_holder(path)}); wait "
                        "for it to end, stop it, or choose another --out") from None
    try:  # the file may have been removed by its last owner between our open and lock
      same = os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
      same = False
    if same:
      break
    os.close(fd)
  started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
  os.ftruncate(fd, 0)
  os.write(fd, json.dumps({"host": socket.gethostname(), "pid": os.getpid(),
                           "started": started, "command": command}).encode())
  try:
    yield
  finally:
    path.unlink(missing_ok=True)
    os.close(fd)
    if created:
      with contextlib.suppress(OSError):
        out.rmdir()  # only if empty: the run wrote nothing


def lease_s() -> float:
  """How old a bucket owner's last renewal may be before another run takes the folder over."""
  try:
    return max(1.0, float(os.environ.get("SCALEOPT_OWNER_LEASE_S", "120")))
  except ValueError:
    raise ConfigError("SCALEOPT_OWNER_LEASE_S="
                      f"{os.environ['SCALEOPT_OWNER_LEASE_S']!r} is not a number") from None


def _alive_here(h: dict) -> bool:
  """Whether the holder runs on this host (False if it is on another one or gone)."""
  if h.get("host") != socket.gethostname():
    return False
  try:
    os.kill(int(h["pid"]), 0)
  except ProcessLookupError:
    return False
  except (PermissionError, ValueError, TypeError, KeyError):
    return True
  return True


def _stale(h: Optional[dict], now: float, lease: float) -> bool:
  """A holder that may be taken over: unreadable and old, gone from this host, or silent for
  longer than the lease."""
  if h is None:
    return False
  if h.get("host") == socket.gethostname() and not _alive_here(h):
    return True
  return now - float(h.get("renewed", 0)) > lease


def _describe(h: Optional[dict], now: float) -> str:
  if h is None:
    return "a process that has not written its name yet"
  return (f"host {h.get('host')}, pid {h.get('pid')}, started {h.get('started')}, renewed "
          f"{now - float(h.get('renewed', now)):.0f} s ago")


class _Lease:
  """Renews the owner object every ``lease / 3`` s in a thread; ``lost`` once another run has
  taken it over (the renewal's precondition failed)."""

  def __init__(self, blob: storage.Blob, record: dict, generation: int, lease: float):
    self.blob, self.record, self.gen, self.lease = blob, record, generation, lease
    self.lost, self._stop = False, threading.Event()
    self._t = threading.Thread(target=self._run, name="scaleopt-owner-lease", daemon=True)
    self._t.start()

  def _run(self) -> None:
    while not self._stop.wait(self.lease / 3):
      self.record["renewed"] = time.time()
      try:
        gen = self.blob.write(json.dumps(self.record).encode(), self.gen)
      except Exception as e:  # noqa: BLE001 -- a network error: try again next period
        print(f"warning: could not renew {self.blob.url} ({storage._gist(e)})", file=sys.stderr)
        continue
      if gen is None:
        self.lost = True
        print(f"error: another run took over {self.blob.url}; this run no longer owns its "
              "folder", file=sys.stderr)
        return
      self.gen = gen

  def release(self) -> None:
    self._stop.set()
    self._t.join()
    found = None if self.lost else self.blob.read()
    if found is not None and found[1] == self.gen:  # still ours (not taken over meanwhile)
      self.blob.delete(self.gen)


@contextlib.contextmanager
def bucket_owner(out_dir: str, command: str = "scaleopt train") -> Iterator[None]:
  """``owner`` on a bucket: the owner object, created or taken over by conditional writes and
  renewed as a lease (module docstring)."""
  blob = storage.Blob(f"{out_dir.rstrip('/')}/{LOCK}")
  lease = lease_s()
  record = {"host": socket.gethostname(), "pid": os.getpid(), "token": uuid.uuid4().hex,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"), "command": command}
  while True:
    record["renewed"] = time.time()
    data = json.dumps(record).encode()
    gen = blob.write(data, 0)
    if gen is not None:
      break
    found = blob.read()
    if found is None:
      continue  # released meanwhile: create again
    try:
      held = json.loads(found[0])
    except ValueError:
      held = None
    if not _stale(held, time.time(), lease):
      raise ConfigError(f"--out {out_dir!r} is in use by another run "
                        f"({_describe(held, time.time())}); wait for it to end, stop it, or "
                        f"choose another --out")
    gen = blob.write(data, found[1])
    if gen is not None:
      print(f"warning: took over {out_dir!r} from a run that is gone "
            f"({_describe(held, time.time())})", file=sys.stderr)
      break
  keeper = _Lease(blob, record, gen, lease)
  try:
    yield
  finally:
    keeper.release()


@contextlib.contextmanager
def claim(out_dir: str, gather=_jax_gather, process_index: int = 0) -> Iterator[None]:
  """For ``scaleopt train``: the processes agree on the folder, process 0 owns it (``owner``)
  and all of them stop together, in one line each, if it is taken."""
  check_agree(out_dir, gather)
  held, err = contextlib.ExitStack(), None
  with held:
    if process_index == 0:
      try:
        held.enter_context(owner(out_dir))
      except ConfigError as e:
        err = e
    if min(gather(0 if err else 1)) == 0:
      raise err or ConfigError(f"--out {str(out_dir)!r} is in use by another run (process 0 "
                               "holds the details); choose another --out")
    yield
