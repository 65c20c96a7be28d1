"""Embedded corpus split, shards and the batch iterator (tokenizers: test_tokenizers.py)."""

import json
import sysconfig
import zlib

import numpy as np
import pytest

from scaleopt.train import data as D
from train_helpers import heldout


def test_embedded_split_deterministic_and_disjoint():
  a = D.split_files(D.stdlib_files())
  b = D.split_files(D.stdlib_files())
  assert [r for r, _ in a["train"]] == [r for r, _ in b["train"]]
  assert [r for r, _ in a["val"]] == [r for r, _ in b["val"]]
  train, val = {r for r, _ in a["train"]}, {r for r, _ in a["val"]}
  assert train and val and not train & val
  # the fixed rule, recomputed here from the definition
  for r in list(train)[:50] + list(val):
    assert (zlib.crc32(r.encode()) % 20 == 0) == (r in val)
  root = sysconfig.get_paths()["stdlib"]
  assert all(str(p).startswith(root) for _, p in a["train"][:10])
  assert 0.01 < len(val) / (len(val) + len(train)) < 0.15
  # tokens are the bytes of the files, separated by 0
  first = a["val"][0][1].read_bytes()
  toks = D.embedded_tokens("val")
  assert bytes(toks[:len(first)]) == first and toks[len(first)] == D.SEP


def _write_text_dir(tmp_path, n=40):
  src = tmp_path / "src"
  src.mkdir()
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "delta", "def", "return", "(", ")", ":", "\n"]
  for i in range(n):
    (src / f"f{i:02d}.txt").write_text(" ".join(rng.choice(words, 400)))
  return src


def test_prepare_bytes_roundtrip(tmp_path):
  src = _write_text_dir(tmp_path)
  out = tmp_path / "shards"
  assert D.prepare_main(str(src), str(out), "bytes") == 0
  head = json.loads((out / "train_000.json").read_text())
  assert head["dtype"] == "uint16" and head["vocab_size"] == 256
  arrs, vocab = D.load_shards(out, "train")
  assert vocab == 256
  expect = b"".join((src / f"f{i:02d}.txt").read_bytes() + b"\0" for i in range(40)
                    if not heldout(f"f{i:02d}.txt"))
  assert bytes(np.asarray(arrs[0]).astype(np.uint8)) == expect


def test_missing_truncated_and_corrupt_shards(tmp_path):
  src = _write_text_dir(tmp_path)
  out = tmp_path / "shards"
  D.prepare(src, out)
  with pytest.raises(D.DataError, match="does not exist"):
    D.load_shards(tmp_path / "nope", "train")
  with pytest.raises(D.DataError, match="no train"):
    D.load_shards(src, "train")
  b = out / "train_000.bin"
  b.write_bytes(b.read_bytes()[:-3])
  with pytest.raises(D.DataError) as e:
    D.load_shards(out, "train")
  assert str(b) in str(e.value) and "truncated" in str(e.value)
  (out / "val_000.json").write_text("{not json")
  with pytest.raises(D.DataError) as e:
    D.load_shards(out, "val")
  assert "val_000.json" in str(e.value) and "corrupt" in str(e.value)
  (out / "val_000.json").unlink()
  with pytest.raises(D.DataError, match="val_000.json"):
    D.load_shards(out, "val")


def _windows():
  a = np.arange(6000, dtype=np.uint16)
  b = np.arange(20_000, 24_000, dtype=np.uint16)  # a jump: a window across shards would show it
  return D.Windows([a, b], seq_len=16)


def test_windows_do_not_cross_shards():
  w = _windows()
  assert w.n == (6000 - 1) // 16 + (4000 - 1) // 16
  x = w.get(np.arange(w.n))
  # every window is consecutive tokens (mod 1000) -> it never spans the shard boundary
  assert np.all(np.diff(x.astype(np.int64), axis=1) == 1)


def test_iterator_deterministic_resumable_and_sharded():
  w = _windows()
  mk = lambda **kw: D.Batches(w, batch_size=8, microbatches=2, seed=3, **kw)
  a, b = mk(), mk()
  seq_a = [a.next()["tokens"] for _ in range(100)]  # > 1 epoch (622 windows / 8 per step)
  seq_b = [b.next()["tokens"] for _ in range(100)]
  assert all(np.array_equal(x, y) for x, y in zip(seq_a, seq_b))
  assert seq_a[0].shape == (2, 4, 17)
  assert not np.array_equal(seq_a[0], seq_a[1])
  other = D.Batches(w, batch_size=8, microbatches=2, seed=4).next()["tokens"]
  assert not np.array_equal(other, seq_a[0])
  # one epoch visits every window exactly once
  firsts = np.concatenate([s.reshape(-1, 17) for s in seq_a])[:w.n]
  starts = {int(r[0]) for r in firsts}
  assert len(starts) == w.n
  # resume from a saved position
  c = mk()
  for _ in range(37):
    c.next()
  st = c.state()
  d = mk()
  d.restore(json.loads(json.dumps(st)))
  assert np.array_equal(d.next()["tokens"], seq_a[37])
  # two processes together read exactly the single-process batch
  p0 = mk(process_index=0, process_count=2).next()["tokens"]
  p1 = mk(process_index=1, process_count=2).next()["tokens"]
  assert p0.shape == (2, 2, 17)
  assert np.array_equal(np.concatenate([p0, p1], axis=1), seq_a[0])


def test_layouts_ab_and_rolling_b():
  w = _windows()
  ab = D.Batches(w, batch_size=8, microbatches=2, groups=2, seed=0)
  x = ab.next()["tokens"]
  assert x.shape == (4, 4, 17)  # groups A and B, 2 microbatches each
  roll = D.Batches(w, batch_size=8, microbatches=2, rolling_b=True, seed=0)
  s0, s1 = roll.next(), roll.next()
  assert s0["tokens"].shape == s0["b_tokens"].shape == (2, 4, 17)
  assert np.array_equal(s0["b_tokens"], s1["tokens"])  # step t's B is step t+1's A
  plain = D.Batches(w, batch_size=8, microbatches=2, seed=0)
  assert np.array_equal(plain.next()["tokens"], s0["tokens"])  # same examples as std


def test_seed_mismatch_on_restore():
  w = _windows()
  with pytest.raises(D.DataError, match="seed"):
    D.Batches(w, 8, 2, seed=1).restore({"chunk": 3, "seed": 2})


def test_prepare_main_reports_bad_input(tmp_path, capsys):
  assert D.prepare_main(str(tmp_path / "nope"), str(tmp_path / "out")) == 2
  assert "nope" in capsys.readouterr().err
  (tmp_path / "a.txt").write_text("hello\nworld\n")
  assert D.prepare_main(str(tmp_path / "a.txt"), str(tmp_path / "out"), "wordpiece") == 2
  assert "bytes, bpe:VOCAB_SIZE" in capsys.readouterr().err


class _Rows:
  """An iterator of numbered batches that fails at batch ``fail_at``."""

  def __init__(self, fail_at=None):
    self.chunk, self.fail_at = 0, fail_at

  def next(self):
    if self.chunk == self.fail_at:
      raise D.DataError(f"bad shard at chunk {self.chunk}")
    self.chunk += 1
    return {"tokens": np.full((1, 2, 3), self.chunk - 1)}

  def state(self):
    return {"chunk": self.chunk}


def test_batches_made_ahead_keep_order_position_and_errors():
  """The trainer's background batches: handed out in order, ``state()`` the position after the
  batches handed out (not after those made ahead), an iterator error raised by the ``next()``
  that reaches it, never earlier; ``close()`` returns while the thread waits on a full queue."""
  from scaleopt.train.prefetch import Prefetch
  rows = _Rows(fail_at=3)
  feed = Prefetch(rows, lambda b: b, count=10)
  assert feed.state() == {"chunk": 0}
  for k in range(3):
    assert int(feed.next()["tokens"][0, 0, 0]) == k
    assert feed.state() == {"chunk": k + 1}
  with pytest.raises(D.DataError, match="chunk 3"):
    feed.next()
  feed.close()
  full = Prefetch(_Rows(), lambda b: b, count=100, depth=1)
  assert int(full.next()["tokens"][0, 0, 0]) == 0
  full.close()
  assert not full._thread.is_alive()
  done = Prefetch(_Rows(), lambda b: b, count=1)
  done.next()
  with pytest.raises(RuntimeError, match="more batches asked"):
    done.next()


def test_no_copy_is_in_flight_or_starts_while_quiet():
  """``Prefetch.quiet()`` waits for the copy in flight to land, and no copy starts until the
  block ends; the host work on the next batch goes on meanwhile."""
  import threading
  import time
  from scaleopt.train.prefetch import Prefetch
  events, rows = [], _Rows()
  third = threading.Event()

  def put(batch):
    events.append(("start", time.monotonic()))
    if len(events) == 5:  # the third copy (two queued)
      third.set()
    time.sleep(0.05)
    events.append(("landed", time.monotonic()))
    return batch

  feed = Prefetch(rows, put, count=50, depth=2)
  assert third.wait(5)
  with feed.quiet():
    t0 = time.monotonic()
    assert int(feed.next()["tokens"][0, 0, 0]) == 0  # a queued batch; frees a place
    time.sleep(0.3)
    t1 = time.monotonic()
    assert rows.chunk == 4  # the thread took the next batch from the iterator
  assert all(t <= t0 or t >= t1 for _, t in events), events  # nothing during the block
  assert [k for k, t in events if t <= t0] == ["start", "landed"] * 3  # the third landed first
  assert [int(feed.next()["tokens"][0, 0, 0]) for _ in range(3)] == [1, 2, 3]  # copies go on
  feed.close()
