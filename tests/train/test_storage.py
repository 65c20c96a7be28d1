"""Shards read from URLs (fsspec's memory:// and file://, no network), run folder URLs other
than gs:// refused (gs://: test_bucket.py), processes of a run agreeing on --out, and the run folder's owner lock."""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from scaleopt.train import config as C
from scaleopt.train import data as D
from scaleopt.train import runfolder
from scaleopt.train.config import ConfigError
from scaleopt.train.main import train_main
from train_helpers import assert_same_windows, tiny_raw

fsspec = pytest.importorskip("fsspec")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _shards(tmp_path, n=30):
  src = tmp_path / "txt"
  src.mkdir()
  for i in range(n):
    (src / f"doc{i}.py").write_text(("def f(x):\n  return x * %d\n" % i) * 40)
  out = tmp_path / "shards"
  D.prepare(src, out, "bytes", shard_tokens=5000)
  assert len(list(out.glob("train_*.bin"))) > 2  # windows from several shards
  return out


def _to_memory(local: pathlib.Path, url: str) -> None:
  fs = fsspec.filesystem("memory")
  for p in local.iterdir():
    fs.pipe(url.removeprefix("memory://") + "/" + p.name, p.read_bytes())


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_shards_from_a_url_give_the_same_batches_and_resume_exactly(tmp_path, scheme):
  local = _shards(tmp_path)
  if scheme == "memory":
    url = f"memory://bucket/{tmp_path.name}/shards"
    _to_memory(local, url)
  else:
    url = local.as_uri()
  for split in ("train", "val"):
    w_local, v1 = D.open_split("shards", str(local), split, 16)
    w_url, v2 = D.open_split("shards", url, split, 16)
    assert v1 == v2 and w_local.n == w_url.n
    idx = np.arange(w_local.n)
    np.testing.assert_array_equal(w_url.get(idx), w_local.get(idx))
  a = D.Batches(D.open_split("shards", url, "train", 16)[0], 8, 2, seed=3)
  ref = D.Batches(D.open_split("shards", str(local), "train", 16)[0], 8, 2, seed=3)
  for _ in range(3):
    np.testing.assert_array_equal(a.next()["tokens"], ref.next()["tokens"])
  b = D.Batches(D.open_split("shards", url, "train", 16)[0], 8, 2, seed=3)
  b.restore(a.state())
  for _ in range(40):  # past an epoch: the permutation of the next epoch too
    np.testing.assert_array_equal(b.next()["tokens"], ref.next()["tokens"])


def test_bad_remote_shards_are_one_line_errors_naming_the_url(tmp_path):
  local = _shards(tmp_path)
  url = f"memory://bucket/{tmp_path.name}/bad"
  _to_memory(local, url)
  fs = fsspec.filesystem("memory")
  with pytest.raises(D.DataError, match="has no val"):
    D.load_shards(url + "-missing", "val")
  fs.pipe(url.removeprefix("memory://") + "/train_001.bin", b"\x01\x00\x02")
  with pytest.raises(D.DataError, match=r"memory://.*train_001.bin' is truncated"):
    D.load_shards(url, "train")
  head = json.loads(fs.cat_file(url.removeprefix("memory://") + "/train_000.json"))
  fs.pipe(url.removeprefix("memory://") + "/train_000.json",
          json.dumps(dict(head, vocab_size=50)).encode())
  with pytest.raises(D.DataError, match="outside its header's vocab_size=50"):
    D.load_shards(url, "train")


def test_the_trainer_takes_a_url_as_data_path(tmp_path):
  """The run's set-up reads the URL as given (not a local path "memory:/..."): its windows are
  the local shards' windows (training on them: the batch tests above)."""
  local = _shards(tmp_path)
  url = f"memory://bucket/{tmp_path.name}/train"
  _to_memory(local, url)
  assert_same_windows(str(local), url)


@pytest.mark.parametrize("dry", [False, True])
def test_a_run_folder_url_other_than_gs_is_refused_in_one_line(tmp_path, capsys, monkeypatch,
                                                               dry):
  monkeypatch.chdir(tmp_path)
  cfg = tmp_path / "c.yaml"
  cfg.write_text(json.dumps(tiny_raw()))
  assert train_main(str(cfg), "s3://bucket/runs/x", dry_run=dry) == 2
  err = capsys.readouterr().err
  assert "'s3://bucket/runs/x'" in err and "not s3://" in err and err.count("\n") == 1
  assert not (tmp_path / "s3:").exists()


def test_processes_given_different_folders_disagree_in_every_process(tmp_path):
  a, b = str(tmp_path / "a"), str(tmp_path / "b")
  digests = [runfolder.path_digest(a), runfolder.path_digest(b)]
  runfolder.check_agree(a, gather=lambda v: [v, v])
  for mine in (a, b):
    with pytest.raises(ConfigError, match="1 of the run's 2 processes were given another"):
      runfolder.check_agree(mine, gather=lambda v: digests)
  assert runfolder.path_digest(str(tmp_path / "a" / ".." / "a")) == digests[0]


CHILD = r"""
import sys
from scaleopt.train import mesh, runfolder
from scaleopt.train.config import ConfigError
mesh.maybe_initialize_distributed("auto")
import jax
try:
  with runfolder.claim(sys.argv[1], process_index=jax.process_index()):
    print("claimed", flush=True)
except ConfigError as e:
  print(f"error: {e}", file=sys.stderr)
  sys.exit(2)
"""


def _two_processes(tmp_path, outs):
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  procs = []
  for i, out in enumerate(outs):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
               JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i))
    procs.append(subprocess.Popen([sys.executable, "-c", CHILD, str(out)], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  return [(p.wait(timeout=120), *p.communicate()) for p in procs]


@pytest.mark.integration  # two processes: the second tier
def test_two_processes_with_different_folders_both_stop_at_start(tmp_path):
  res = _two_processes(tmp_path, [tmp_path / "a", tmp_path / "b"])
  for rc, out, err in res:
    assert rc == 2 and "given another run folder" in err, (rc, out, err)
  res = _two_processes(tmp_path, [tmp_path / "same", tmp_path / "same"])
  assert [r[0] for r in res] == [0, 0] and all("claimed" in r[1] for r in res), res


HOLDER = r"""
import sys, time
from scaleopt.train import runfolder
with runfolder.owner(sys.argv[1]):
  print("held", flush=True)
  time.sleep(120)
"""


def test_a_second_run_meets_the_holder_and_a_killed_holder_leaves_no_stale_lock(tmp_path,
                                                                                 capsys):
  run = tmp_path / "run"
  holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "held"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps(tiny_raw()))
    assert train_main(str(cfg), str(run)) == 2
    err = capsys.readouterr().err
    assert f"pid {holder.pid}" in err and socket.gethostname() in err and "started" in err
    assert err.count("\n") == 1 and not (run / "metrics.jsonl").exists()
  finally:
    holder.send_signal(signal.SIGKILL)  # a crash: no clean-up ran
    holder.wait()
  assert (run / runfolder.LOCK).exists()  # left behind, but no longer held
  with runfolder.owner(str(run)):
    held = json.loads((run / runfolder.LOCK).read_text())
    assert held["pid"] == os.getpid()
  assert not (run / runfolder.LOCK).exists()


def test_the_lock_is_exclusive_within_a_process_too(tmp_path):
  with runfolder.owner(str(tmp_path / "r")):
    with pytest.raises(ConfigError, match=f"in use by another run .*pid {os.getpid()}"):
      with runfolder.owner(str(tmp_path / "r")):
        pass
  assert not (tmp_path / "r").exists()  # created here, nothing written: removed again


def test_data_prepare_refuses_a_url_out_without_making_a_folder(tmp_path, capsys, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "a.txt").write_text("some text\n" * 100)
  assert D.prepare_main(str(tmp_path / "a.txt"), "gs://bucket/shards") == 2
  err = capsys.readouterr().err
  assert "'gs://bucket/shards'" in err and "local folder" in err and err.count("\n") == 1
  assert not (tmp_path / "gs:").exists()


def test_a_run_on_url_shards_records_them_and_a_changed_shard_is_named(tmp_path):
  from scaleopt.train import identity
  local = _shards(tmp_path)
  url = f"memory://bucket/{tmp_path.name}/ident"
  _to_memory(local, url)
  assert D._separator(url, "train") == D._separator(str(local), "train") is not None
  cfg = C.from_dict(tiny_raw(data={"source": "shards", "path": url}))
  old = identity.describe(cfg)
  assert old["path"] == url and len(old["splits"]["train"]) > 2
  assert identity._first_change(old, identity.describe(cfg)) is None
  fs = fsspec.filesystem("memory")
  first = old["splits"]["train"][0]["file"]
  path = url.removeprefix("memory://") + "/" + first
  blob = bytearray(fs.cat_file(path))
  blob[0] ^= 1  # same size, other contents: the file system's key changes
  time.sleep(0.01)
  fs.pipe(path, bytes(blob))
  assert first in identity._first_change(old, identity.describe(cfg))
