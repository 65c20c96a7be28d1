"""Run folders on a local disk or in a Google Cloud Storage bucket (``gs://bucket/run``), alike.

``path(p)`` is a ``pathlib.Path`` for a local folder and an ``etils.epath.Path`` (the pathlib
API over fsspec's ``gcsfs``) for a ``gs://`` URL, so the run's code joins, reads and lists
both the same way. What a bucket does differently is here:

* Writes: one object upload is atomic (readers see the old object or the new one), so
  ``write_text`` needs no temporary file there; ``append_text`` rewrites the object whole
  (objects cannot be appended to).
* Checkpoints go through Orbax, whose arrays TensorStore writes with its own ``gcs`` driver.
* Ownership: ``Blob`` is one object with conditional writes (create-if-absent and
  replace-if-generation-matches), the bucket's replacement for file locks
  (``scaleopt.train.runfolder``).

The clients find their endpoint and credentials in the environment as usual (Application
Default Credentials on Google Cloud; ``STORAGE_EMULATOR_HOST`` and ``TENSORSTORE_GCS_HTTP_URL``
point them at an emulator). The packages: ``pip install 'scaleopt[cloud]'``.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import tempfile
from typing import Any, Optional, Union

from scaleopt.config import ConfigError

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
SCHEMES = ("gs",)  # run folders on object storage (shards may be any fsspec URL: data.py)

Path = Union[pathlib.Path, Any]  # pathlib.Path or etils.epath.Path


def scheme(p: Any) -> Optional[str]:
  """``"gs"`` for ``gs://...``; None for a local path."""
  m = _URL.match(str(p))
  return m.group(1) if m else None


def is_url(p: Any) -> bool:
  return scheme(p) is not None


def check_run_folder(p: Any) -> None:
  """ConfigError (one line) for a URL this module cannot hold a run folder in, or a bucket
  URL whose packages are missing."""
  s = scheme(p)
  if s is None:
    return
  if s not in SCHEMES:
    raise ConfigError(f"--out {str(p)!r}: run folders may be local paths or gs://bucket/path "
                      f"URLs, not {s}://")
  if not re.match(r"^gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/|$)", str(p)):
    raise ConfigError(f"--out {str(p)!r} does not name a bucket (gs://BUCKET/path)")
  for module in ("gcsfs", "google.cloud.storage"):
    try:
      __import__(module)
    except ImportError:
      raise ConfigError(f"--out {str(p)!r} needs the {module} package (pip install "
                        "'scaleopt[cloud]')") from None


def path(p: Any) -> Path:
  """The run folder's path object: pathlib.Path (local) or etils.epath.Path (gs://)."""
  if not is_url(p):
    return pathlib.Path(p)
  _configure_fsspec()
  from etils import epath
  return epath.Path(str(p))


def _configure_fsspec() -> None:
  """Orbax and TensorStore write checkpoint objects behind gcsfs's back, so gcsfs must list
  the bucket afresh every time instead of from its listings cache."""
  import fsspec
  fsspec.config.conf.setdefault("gcs", {}).setdefault("use_listings_cache", False)


def write_text(p: Path, text: str) -> None:
  """Replaces the file at once: readers see the old contents or the new, never a part."""
  if is_url(p):
    p.write_text(text)
    return
  p = pathlib.Path(p)
  tmp = p.with_name(p.name + ".tmp")
  try:
    tmp.write_text(text)
    os.replace(tmp, p)
  except BaseException:
    tmp.unlink(missing_ok=True)
    raise


def append_text(p: Path, text: str) -> None:
  """Appends to the file (on a bucket: rewrites the object with the text added)."""
  if is_url(p):
    old = p.read_text() if p.exists() else ""
    p.write_text(old + text)
    return
  with open(p, "a") as f:
    f.write(text)


class Appender:
  """A text file written by appending: a local file opened for appending, or on a bucket the
  whole object uploaded again by every ``flush`` that has new text."""

  def __init__(self, p: Path):
    self.path, self.url = p, is_url(p)
    if self.url:
      self._text = p.read_text() if p.exists() else ""
      self._dirty = False
    else:
      self._f = open(p, "a")

  def write(self, text: str) -> None:
    if self.url:
      self._text += text
      self._dirty = True
    else:
      self._f.write(text)

  def flush(self) -> None:
    if not self.url:
      self._f.flush()
    elif self._dirty:
      self.path.write_text(self._text)
      self._dirty = False

  def close(self) -> None:
    self.flush()
    if not self.url:
      self._f.close()


class Mirror:
  """A local folder for writers that need one (TensorBoard, the profiler, W&B): the run's
  folder itself when it is local; else a temporary folder whose new or changed files
  ``sync`` uploads to the bucket folder (``close`` syncs and removes it)."""

  def __init__(self, target: Path):
    self.target, self.url = target, is_url(target)
    self.local = pathlib.Path(tempfile.mkdtemp(prefix="scaleopt-")) if self.url else target
    self._sent: dict[str, tuple] = {}

  def sync(self) -> None:
    if not self.url:
      return
    fs = _fs()
    for f in sorted(self.local.rglob("*")):
      if not f.is_file():
        continue
      rel = f.relative_to(self.local).as_posix()
      st = f.stat()
      if self._sent.get(rel) != (st.st_size, st.st_mtime_ns):
        fs.put_file(str(f), f"{str(self.target).rstrip('/')}/{rel}")
        self._sent[rel] = (st.st_size, st.st_mtime_ns)

  def close(self) -> None:
    if self.url:
      try:
        self.sync()
      finally:
        shutil.rmtree(self.local, ignore_errors=True)


def files(root: Path) -> list:
  """Every file below ``root`` (at any depth), sorted."""
  if not is_url(root):
    return sorted(p for p in pathlib.Path(root).rglob("*") if p.is_file())
  base = str(root).rstrip("/")
  return sorted(path(f"gs://{f}") for f in _fs().find(base.removeprefix("gs://")))


def size(p: Path) -> int:
  """The file's size in bytes."""
  st = p.stat()
  return st.st_size if hasattr(st, "st_size") else int(st.length)


def move(src: Path, dst: Path) -> None:
  """Moves a file or folder (on a bucket: copies its objects, then deletes them)."""
  if is_url(src):
    fs = _fs()
    fs.mv(str(src), str(dst), recursive=True)
  else:
    shutil.move(str(src), str(dst))


def rmtree(p: Path) -> None:
  """Deletes a folder and everything in it; nothing if it is not there."""
  if is_url(p):
    fs = _fs()
    if fs.exists(str(p)):
      fs.rm(str(p), recursive=True)
  else:
    shutil.rmtree(p, ignore_errors=True)


def mkdir(p: Path) -> None:
  """Creates the folder (a bucket has no folders: nothing to do there)."""
  if not is_url(p):
    pathlib.Path(p).mkdir(parents=True, exist_ok=True)


def _fs():
  _configure_fsspec()
  import fsspec
  return fsspec.filesystem("gcs")


def check_writable(p: Path) -> None:
  """ConfigError (one line) unless an object can be written to and deleted from the bucket
  folder (missing bucket, no credentials, no permission)."""
  import uuid
  probe = Blob(f"{str(p).rstrip('/')}/.write-probe-{uuid.uuid4().hex}")  # one per process
  try:
    probe.bucket().blob(probe.name).upload_from_string(b"", timeout=30)
    probe.bucket().blob(probe.name).delete(timeout=30)
  except Exception as e:  # noqa: BLE001 -- the client raises many kinds; all mean "unusable"
    raise ConfigError(f"--out {str(p)!r} is not writable ({_gist(e)})") from None


def _gist(e: BaseException, limit: int = 160) -> str:
  msg = " ".join(str(e).split()) or type(e).__name__
  return msg if len(msg) <= limit else msg[:limit] + "..."


class Blob:
  """One object with conditional writes: the bucket's building block for ownership. Every
  method returns the new generation, or None when the precondition failed."""

  def __init__(self, url: str):
    m = re.match(r"^gs://([^/]+)/(.+)$", url)
    if not m:
      raise ConfigError(f"{url!r} is not gs://BUCKET/OBJECT")
    self.url, self.bucket_name, self.name = url, m.group(1), m.group(2)

  def bucket(self):
    from google.cloud import storage
    return _client(storage).bucket(self.bucket_name)

  def read(self) -> Optional[tuple[bytes, int]]:
    """(contents, generation), or None if there is no such object."""
    from google.api_core import exceptions
    blob = self.bucket().get_blob(self.name)
    if blob is None:
      return None
    try:
      return blob.download_as_bytes(if_generation_match=blob.generation), blob.generation
    except (exceptions.NotFound, exceptions.PreconditionFailed):
      return self.read()  # replaced or deleted between the two requests

  def write(self, data: bytes, if_generation: int) -> Optional[int]:
    """Writes the object if its generation is ``if_generation`` (0: only if absent)."""
    from google.api_core import exceptions
    blob = self.bucket().blob(self.name)
    try:
      blob.upload_from_string(data, if_generation_match=if_generation)
    except exceptions.PreconditionFailed:
      return None
    return blob.generation

  def delete(self, if_generation: int) -> bool:
    from google.api_core import exceptions
    try:
      self.bucket().blob(self.name).delete(if_generation_match=if_generation)
    except (exceptions.PreconditionFailed, exceptions.NotFound):
      return False
    return True


_CLIENTS: dict = {}


def _client(storage):
  """One client per process (and per emulator address, which tests change)."""
  key = (os.getpid(), os.environ.get("STORAGE_EMULATOR_HOST"))
  if key not in _CLIENTS:
    _CLIENTS[key] = storage.Client()
  return _CLIENTS[key]
