"""The run folder (``--out``): local only, the same for every process of a run, one owner.

* A URL (``gs://...``, ``s3://...``) is refused in one line: checkpoints, metrics and the
  owner lock need a POSIX file system (mount a bucket, e.g. with gcsfuse, to use it as one).
  Token shards may be URLs (``data.path``, read through fsspec).
* Every process of a multi-process run must name the same folder (compared as an absolute
  path, after ``jax.distributed.initialize``): a process given another one would write its
  checkpoint shards elsewhere and leave the others waiting forever in the checkpoint's finish.
* One run owns a folder at a time: process 0 holds an exclusive ``flock`` on
  ``RUN_DIR/owner.lock`` (which names the holder: host, pid, start time) for the run's life.
  A second run on the same folder stops at start with one line naming the holder. The kernel
  drops the lock when its process ends, however it ends, so a crashed run leaves nothing
  stale; the file is removed when the run ends normally.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
import pathlib
import re
import socket
from typing import Iterator

from scaleopt.train.config import ConfigError

LOCK = "owner.lock"
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def check_local(out_dir: str) -> None:
  """ConfigError (one line) for a run folder given as a URL."""
  if _URL.match(str(out_dir)):
    raise ConfigError(f"--out {str(out_dir)!r} is a URL; run folders must be on a local or "
                      "mounted file system (e.g. a gcsfuse mount of the bucket); token shards "
                      "may be URLs (data.path)")


def path_digest(out_dir: str) -> int:
  """A 63-bit digest of the folder's absolute path (what the processes compare)."""
  h = hashlib.blake2b(os.path.abspath(out_dir).encode(), digest_size=8).digest()
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
    raise ConfigError(f"--out {os.path.abspath(out_dir)!r}: {others} of the run's {len(seen)} "
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
