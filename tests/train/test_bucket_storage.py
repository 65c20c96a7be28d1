"""The storage helpers on local folders, the run-folder URL checks, and the bucket owner's
protocol (create-if-absent, stale holders, the lease) on an in-memory object with GCS's
generation preconditions (the same protocol against a GCS emulator: test_bucket.py)."""

import json
import os
import socket
import time

import pytest

from scaleopt.train import runfolder, storage
from scaleopt.train.config import ConfigError


def test_local_paths_stay_pathlib_and_urls_are_recognised(tmp_path):
  assert type(storage.path(tmp_path)) is type(tmp_path)
  assert storage.is_url("gs://b/x") and storage.scheme("s3://b") == "s3"
  assert not storage.is_url("/tmp/gs:/x") and not storage.is_url("runs/a")


@pytest.mark.parametrize("url,words", [
    ("s3://bucket/run", "not s3://"),
    ("memory://bucket/run", "not memory://"),
    ("gs://", "does not name a bucket"),
    ("gs://Bad_Bucket/run", "does not name a bucket"),
])
def test_unusable_run_folder_urls_are_one_line_errors(url, words):
  with pytest.raises(ConfigError, match=words) as e:
    storage.check_run_folder(url)
  assert "\n" not in str(e.value) and repr(url) in str(e.value)


def test_write_text_replaces_at_once_and_append_adds(tmp_path):
  p = tmp_path / "a.json"
  storage.write_text(p, "one")
  storage.write_text(p, "two")
  assert p.read_text() == "two" and sorted(x.name for x in tmp_path.iterdir()) == ["a.json"]
  storage.append_text(p, "+three")
  assert p.read_text() == "two+three"


def test_appender_writes_through_on_flush(tmp_path):
  p = tmp_path / "m.jsonl"
  p.write_text("old\n")
  a = storage.Appender(p)
  a.write("new\n")
  a.flush()
  assert p.read_text() == "old\nnew\n"
  a.close()


def test_files_size_and_move_of_a_folder(tmp_path):
  d = tmp_path / "ck" / "3"
  (d / "state").mkdir(parents=True)
  (d / "state" / "x").write_bytes(b"12345")
  (d / "m.json").write_text("{}")
  assert [p.relative_to(d).as_posix() for p in storage.files(d)] == ["m.json", "state/x"]
  assert storage.size(d / "state" / "x") == 5
  storage.mkdir(tmp_path / "bad")
  storage.move(d, tmp_path / "bad" / "3")
  assert not d.exists() and (tmp_path / "bad" / "3" / "state" / "x").read_bytes() == b"12345"
  storage.rmtree(tmp_path / "bad")
  assert not (tmp_path / "bad").exists()


def test_mirror_of_a_local_folder_is_the_folder(tmp_path):
  m = storage.Mirror(tmp_path / "tb")
  assert m.local == tmp_path / "tb"
  m.sync()
  m.close()


def test_url_folders_are_compared_as_written():
  assert runfolder.path_digest("gs://b/run") == runfolder.path_digest("gs://b/run/")
  assert runfolder.path_digest("gs://b/run") != runfolder.path_digest("gs://b/run2")


class MemoryBlob:
  """One object with GCS's generation preconditions, in memory (shared by name)."""
  objects: dict = {}
  clock = [1000]

  def __init__(self, url):
    self.url = url

  def read(self):
    return self.objects.get(self.url)

  def write(self, data, if_generation):
    have = self.objects.get(self.url)
    if (have[1] if have else 0) != if_generation:
      return None
    self.clock[0] += 1
    self.objects[self.url] = (data, self.clock[0])
    return self.clock[0]

  def delete(self, if_generation):
    have = self.objects.get(self.url)
    if not have or have[1] != if_generation:
      return False
    del self.objects[self.url]
    return True


@pytest.fixture
def mem(monkeypatch):
  MemoryBlob.objects = {}
  monkeypatch.setattr(storage, "Blob", MemoryBlob)
  monkeypatch.setenv("SCALEOPT_OWNER_LEASE_S", "60")
  return MemoryBlob


def _held(mem, url="gs://b/run"):
  data = mem.objects[f"{url}/{runfolder.LOCK}"][0]
  return json.loads(data)


def _plant(mem, **fields):
  rec = {"host": "another-host", "pid": 1, "started": "x", "renewed": time.time(), **fields}
  mem.objects["gs://b/run/" + runfolder.LOCK] = (json.dumps(rec).encode(), 7)


def test_the_owner_object_is_created_held_and_deleted(mem):
  with runfolder.owner("gs://b/run"):
    assert _held(mem)["pid"] == os.getpid() and _held(mem)["host"] == socket.gethostname()
    with pytest.raises(ConfigError, match=f"in use by another run .*pid {os.getpid()}"):
      with runfolder.owner("gs://b/run"):
        pass
  assert mem.objects == {}


def test_a_live_holder_elsewhere_is_refused_and_a_silent_one_taken_over(mem, capsys):
  _plant(mem)
  with pytest.raises(ConfigError, match="host another-host, pid 1") as e:
    with runfolder.owner("gs://b/run"):
      pass
  assert "\n" not in str(e.value)
  _plant(mem, renewed=time.time() - 61)  # older than the lease
  with runfolder.owner("gs://b/run"):
    assert _held(mem)["pid"] == os.getpid()
  assert "took over" in capsys.readouterr().err and mem.objects == {}


def test_a_holder_gone_from_this_host_is_taken_over_at_once(mem):
  import subprocess
  import sys
  p = subprocess.Popen([sys.executable, "-c", "pass"])
  p.wait()  # a pid that no longer runs
  _plant(mem, host=socket.gethostname(), pid=p.pid)
  with runfolder.owner("gs://b/run"):
    assert _held(mem)["pid"] == os.getpid()


def test_a_run_whose_object_was_taken_over_leaves_the_new_owners_object(mem, monkeypatch):
  monkeypatch.setenv("SCALEOPT_OWNER_LEASE_S", "1")
  with runfolder.owner("gs://b/run"):
    time.sleep(0.5)  # renewed at least once: a newer generation
    gen = mem.objects["gs://b/run/" + runfolder.LOCK][1]
    assert gen > 1001
    mem.objects["gs://b/run/" + runfolder.LOCK] = (b'{"pid": 2}', gen + 100)  # another run
    time.sleep(0.5)
  assert mem.objects["gs://b/run/" + runfolder.LOCK][0] == b'{"pid": 2}'


def test_a_bad_lease_setting_is_one_line(mem, monkeypatch):
  monkeypatch.setenv("SCALEOPT_OWNER_LEASE_S", "soon")
  with pytest.raises(ConfigError, match="SCALEOPT_OWNER_LEASE_S='soon'"):
    with runfolder.owner("gs://b/run"):
      pass
