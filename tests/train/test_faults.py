"""Fault injection: corrupt checkpoints, a full disk, non-finite stops, resuming with a changed
config, bad data and bad command lines. Each case ends in a clean resume or one line + exit 2."""

import json
import os
import pathlib
import resource
import shutil
import signal

import jax
import numpy as np
import pytest
import yaml

from scaleopt import cli
from scaleopt.train import checkpoint, config as C, data as D, faults, loop, metrics, preflight

from train_helpers import reference_run, tiny_raw

RAW = tiny_raw(run={"steps": 12, "checkpoint_every": 4, "keep_checkpoints": 3, "eval_every": 0})


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
  """(config path, run dir): 12 uninterrupted steps, checkpoints at 4, 8 and 12."""
  return reference_run(tmp_path_factory.mktemp("ref"), RAW)


@pytest.fixture(scope="module")
def target():
  """The abstract TrainState (shapes, dtypes, shardings) restores are checked against."""
  fns = loop.compile_fns(loop.setup(C.from_dict(RAW)))
  return checkpoint.abstract(fns.state_shape, fns.state_sh)


def _copy(ref, tmp_path):
  run = tmp_path / "run"
  shutil.copytree(ref[1], run)
  return run


def _ckpt_steps(run):
  return sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())


def _cli(capsys, *argv):
  """(exit code, stderr lines) of the command line, run in this process."""
  rc = cli.main([str(a) for a in argv])
  err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
  return rc, err


def _one_line_error(rc, err, *words):
  """Exit 2, the last stderr line is the only error line, and no traceback."""
  errors = [l for l in err if l.startswith("error")]
  assert rc == 2 and errors == err[-1:] and errors[0].startswith("error: "), (rc, err)
  assert not any("Traceback" in l for l in err), err
  for w in words:
    assert w in errors[0], (w, errors[0])


def _strip(rows):
  return [{k: v for k, v in r.items() if k not in metrics.TIMING} for r in rows]


def _biggest_file(step_dir):
  return max((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _leaves(state):
  return [np.asarray(x) for x in jax.tree.leaves(state)]


# --- corrupt checkpoints ---------------------------------------------------------------------


def _truncate(d):
  f = _biggest_file(d / "state")
  f.write_bytes(f.read_bytes()[:100])


def _delete_file(d):
  _biggest_file(d / "state").unlink()


def _flip_bytes(d):  # same size: only the manifest's checksum can tell
  f = _biggest_file(d / "state")
  b = bytearray(f.read_bytes())
  for i in (len(b) // 3, len(b) // 2, 2 * len(b) // 3):
    b[i] ^= 0xFF
  f.write_bytes(bytes(b))


CORRUPTIONS = {
    "truncated": _truncate,
    "deleted_file": _delete_file,
    "no_METADATA": lambda d: (d / "state" / "_METADATA").unlink(),
    "no_state": lambda d: shutil.rmtree(d / "state"),
    "flipped_bytes": _flip_bytes,
    "no_data_item": lambda d: shutil.rmtree(d / "data"),
}


@pytest.mark.parametrize("mode", sorted(CORRUPTIONS))
@pytest.mark.integration  # a training run: the second tier
def test_corrupt_latest_checkpoint_falls_back(ref, target, tmp_path, capsys, mode):
  run = _copy(ref, tmp_path)
  CORRUPTIONS[mode](run / "checkpoints" / "12")
  ck = checkpoint.Checkpointer(run / "checkpoints", 3, False)
  step, state, dstate = ck.restore_latest(target)
  ck.close()
  assert step == 8 and dstate["chunk"] == 8
  err = [l for l in capsys.readouterr().err.splitlines() if "warning" in l]
  assert len(err) == 1 and "checkpoints/12 is unusable" in err[0] and "step 8" in err[0], err
  assert _ckpt_steps(run) == [4, 8]  # moved aside, so a new step 12 can be saved
  assert (run / "checkpoints.corrupt" / "12").is_dir()
  orig = checkpoint.Checkpointer(ref[1] / "checkpoints", 3, False)
  expect, _ = orig.restore(8, target)
  orig.close()
  for a, b in zip(_leaves(expect), _leaves(state)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.integration  # a training run: the second tier
def test_nonfinite_restored_state_counts_as_corrupt(ref, target, tmp_path, capsys):
  run = _copy(ref, tmp_path)
  ck = checkpoint.Checkpointer(run / "checkpoints", 5, False)
  _, good, dstate = ck.restore_latest(target)
  bad = good._replace(params=jax.tree.map(lambda x: x * np.nan, good.params))
  ck.save(16, bad, {"chunk": 16, "seed": 0}, consec=0, param_norm=1.0)  # files intact
  assert ck.restore_latest(target)[0] == 12
  ck.close()
  assert "non-finite" in capsys.readouterr().err


@pytest.mark.integration  # a training run: the second tier
def test_resume_after_corrupt_checkpoint_matches_uninterrupted(ref, tmp_path, capsys):
  run = _copy(ref, tmp_path)
  _truncate(run / "checkpoints" / "12")
  rc, err = _cli(capsys, "train", "--config", ref[0], "--out", run, "--resume")
  assert rc == 0, err
  assert not any("Traceback" in l for l in err)
  assert sum("warning: checkpoint" in l for l in err) == 1
  assert _strip(metrics.read_metrics(run / "metrics.jsonl")) == \
      _strip(metrics.read_metrics(ref[1] / "metrics.jsonl"))
  assert _ckpt_steps(run) == [4, 8, 12]


@pytest.mark.integration  # a training run: the second tier
def test_no_intact_checkpoint_is_one_line_error(ref, tmp_path, capsys):
  run = _copy(ref, tmp_path)
  for s in (4, 8, 12):
    shutil.rmtree(run / "checkpoints" / str(s) / "state")
  rc, err = _cli(capsys, "train", "--config", ref[0], "--out", run, "--resume")
  _one_line_error(rc, err, "no intact checkpoint", "step 12", "step 8", "step 4")
  assert _ckpt_steps(run) == [4, 8, 12]  # nothing moved or deleted


# --- a full disk -----------------------------------------------------------------------------


@pytest.mark.integration  # a training run: the second tier
def test_disk_full_during_checkpoint_keeps_earlier_ones(ref, target, tmp_path, capsys,
                                                        monkeypatch):
  """Files may not grow past 8 KB from the first save on (RLIMIT_FSIZE: writes fail with
  EFBIG like they fail with ENOSPC on a full disk). The state is ~200 KB with arrays of up to
  32 KB; Orbax may write it as one data file or several, so the limit is below its largest
  array (at 64 KB a save split over several files went through once)."""
  run = _copy(ref, tmp_path)
  shutil.rmtree(run / "checkpoints" / "12")
  save = checkpoint.Checkpointer.save
  old = resource.getrlimit(resource.RLIMIT_FSIZE)

  def full_disk_save(self, *a, **k):
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 13, old[1]))
    return save(self, *a, **k)

  monkeypatch.setattr(checkpoint.Checkpointer, "save", full_disk_save)
  prev = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
  try:
    rc, err = _cli(capsys, "train", "--config", ref[0], "--out", run, "--resume")
  finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, old)
    signal.signal(signal.SIGXFSZ, prev)
  _one_line_error(rc, err, "could not write checkpoint", "checkpoints/12", "File too large")
  assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["4", "8"]  # no temp left
  ck = checkpoint.Checkpointer(run / "checkpoints", 3, False)
  for s in (4, 8):
    ck.restore_verified(s, target)
  ck.close()


# --- non-finite stops and retention ----------------------------------------------------------


def _tiny_state(v):
  return {"w": np.full((4,), v, np.float32)}


def test_retention_keeps_newest_healthy_checkpoint(tmp_path):
  ck = checkpoint.Checkpointer(tmp_path / "c", 2, False, init_norm=1.0)
  ck.save(1, _tiny_state(1.0), {"chunk": 1}, consec=0, param_norm=2.0)
  ck.save(2, _tiny_state(1.0), {"chunk": 2}, consec=0, param_norm=3.0)  # healthy
  ck.save(3, _tiny_state(1.0), {"chunk": 3}, consec=0, param_norm=31.0)  # > 10 x 3: exploded
  ck.save(4, _tiny_state(1.0), {"chunk": 4}, consec=2, param_norm=3.0)  # skipping
  ck.save(5, _tiny_state(1.0), {"chunk": 5}, consec=1, param_norm=3.0)
  assert sorted(ck.mngr.all_steps()) == [2, 4, 5]
  assert [ck.manifest(s)["healthy"] for s in (2, 4, 5)] == [True, False, False]
  assert ck.last_good_step() == 2
  ck.save(6, _tiny_state(1.0), {"chunk": 6}, consec=0, param_norm=29.0)  # < 10 x 3: healthy
  assert sorted(ck.mngr.all_steps()) == [5, 6]
  ck.close()


def _faulty(tx, explode_at, nan_from):
  """``tx`` whose update is x1e4 at update ``explode_at`` and NaN from ``nan_from`` on."""
  import jax.numpy as jnp
  import optax

  def init(p):
    return (jnp.zeros((), jnp.int32), tx.init(p))

  def update(g, state, params=None, **kw):
    n, inner = state
    u, inner = tx.update(g, inner, params, **kw)
    scale = jnp.where(n + 1 == explode_at, 1e4, 1.0)
    scale = jnp.where(n + 1 >= nan_from, jnp.nan, scale)
    return jax.tree.map(lambda x: x * scale, u), (n + 1, inner)

  return optax.GradientTransformationExtraArgs(init, update)


@pytest.mark.integration  # a training run: the second tier
def test_nonfinite_stop_keeps_checkpoint_from_before_the_trouble(tmp_path):
  """Updates 1-5 normal, update 6 blows the parameters up (finite), NaN from update 8 on
  (skipped, so the counter stays at 7 and every later step is NaN): the stop must keep step 4,
  the last checkpoint before the trouble, although rotation keeps only 2."""
  raw = tiny_raw(run={"steps": 30, "checkpoint_every": 2, "keep_checkpoints": 2,
                      "max_consecutive_skips": 3, "eval_every": 0})
  cfg = C.from_dict(raw)
  s = loop.setup(cfg)
  s.tx = _faulty(s.tx, explode_at=6, nan_from=8)
  with pytest.raises(faults.SkipLimit) as e:
    loop.train(cfg, tmp_path, s=s)
  steps = _ckpt_steps(tmp_path)
  ck = checkpoint.Checkpointer(tmp_path / "checkpoints", 2, False)
  health = {st: ck.manifest(st) for st in steps}
  ck.close()
  rows = metrics.read_metrics(tmp_path / "metrics.jsonl")
  norms = {r["step"]: r["param_norm"] for r in rows}
  assert norms[6] > 100 * norms[5]  # the injected explosion happened
  assert 4 in steps and health[4]["healthy"]
  assert all(not health[st]["healthy"] for st in steps if st > 4)
  assert f"checkpoints/4, is kept" in str(e.value)
  assert "not saved" in str(e.value)  # the stopped state had blown up
  assert max(steps) < rows[-1]["step"]


# --- resuming with a changed config ----------------------------------------------------------


def _snapshot(run):
  return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*"))
          if p.is_file()}


@pytest.mark.parametrize("override, key", [
    ("model.d_model=64", "model.d_model"),
    ("optimizer.learning_rate=1e-3", "optimizer.learning_rate"),
    ("run.seed=1", "run.seed"),
    ("data.batch_size=32", "data.batch_size"),
    ("data.seq_len=64", "data.seq_len"),
])
@pytest.mark.integration  # a training run: the second tier
def test_resume_refuses_incompatible_change(ref, tmp_path, capsys, override, key):
  run = _copy(ref, tmp_path)
  before = _snapshot(run)
  rc, err = _cli(capsys, "train", "--config", ref[0], "--out", run, "--resume", "--set",
                 override, "--set", "run.steps=20")
  _one_line_error(rc, err, key, "cannot resume")
  assert "run.steps" not in err[-1].split("only")[0]  # a resumable change is not blamed
  assert _snapshot(run) == before  # nothing touched, config.yaml included


@pytest.mark.integration  # a training run: the second tier
def test_resume_without_checkpoints_may_change_anything(ref, tmp_path):
  run = tmp_path / "run"
  run.mkdir()
  shutil.copy(ref[1] / "config.yaml", run / "config.yaml")  # killed before its first save
  cfg = C.from_dict(tiny_raw(run={"seed": 5}))
  assert preflight.check_out_dir(cfg, run, resume=True) == {}
  (run / "checkpoints" / "4").mkdir(parents=True)
  with pytest.raises(C.ConfigError, match="run.seed"):
    preflight.check_out_dir(cfg, run, resume=True)


@pytest.mark.integration  # a training run: the second tier
def test_resume_with_resumable_change_is_recorded(ref, tmp_path, capsys):
  run = _copy(ref, tmp_path)
  original = (run / "config.yaml").read_bytes()
  argv = ["train", "--config", ref[0], "--out", run, "--resume", "--set", "run.steps=16"]
  rc, err = _cli(capsys, *argv)
  assert rc == 0, err
  assert (run / "config.yaml").read_bytes() == original
  hist = [json.loads(l) for l in (run / C.HISTORY).read_text().splitlines()]
  assert len(hist) == 1 and hist[0]["step"] == 12
  assert hist[0]["changes"] == {"run.steps": [12, 16],
                                "optimizer.schedule.total_steps": [12, 16]}
  assert metrics.read_metrics(run / "metrics.jsonl")[-1]["step"] == 16
  assert C.saved_config(run)["run"]["steps"] == 16
  rc, err = _cli(capsys, *argv)  # the same request again: nothing new to record
  assert rc == 0, err
  assert len((run / C.HISTORY).read_text().splitlines()) == 1


# --- bad data --------------------------------------------------------------------------------


def test_shard_tokens_outside_vocabulary(tmp_path, capsys):
  rng = np.random.default_rng(0)
  toks = rng.integers(0, 256, 5000)
  d = tmp_path / "shards"
  d.mkdir()
  D.write_shard(d / "train_000", toks, 256, "bytes")
  D.write_shard(d / "val_000", toks[:1000], 256, "bytes")
  raw = np.fromfile(d / "train_000.bin", np.uint16)
  raw[[3100, 4000]] = 300  # beyond vocab_size=256
  raw.tofile(d / "train_000.bin")
  with pytest.raises(D.DataError, match="token 300 at position 3100"):
    D.read_shard(d / "train_000.bin")
  for chunk in (7, 1000, 3101):  # the position is exact across chunk boundaries
    with pytest.raises(D.DataError, match="position 3100,"):
      D.check_token_range(raw, 256, "x", chunk=chunk)
  D.check_token_range(raw, 301, "x", chunk=7)
  D.check_token_range(np.array([0, 255], np.uint16), 256, "x")  # ids are 0 .. vocab_size - 1
  with pytest.raises(D.DataError, match="token 256 at position 2,"):
    D.check_token_range(np.array([0, 255, 256], np.uint16), 256, "x")
  cfg = tmp_path / "c.yaml"
  cfg.write_text(yaml.safe_dump(tiny_raw(data={"source": "shards", "path": str(d)})))
  rc, err = _cli(capsys, "train", "--config", cfg, "--out", tmp_path / "run")
  _one_line_error(rc, err, "train_000.bin", "vocab_size=256")
  assert not (tmp_path / "run").exists()


def test_eval_tokens_beyond_the_heldout_split_take_it_whole(capsys, tmp_path):
  w = D.Windows([np.arange(41) % 7], 4)  # (41 - 1) // 4 = 10 windows
  assert D.eval_set(w, 8).n == 2 and D.eval_set(w, 1).n == 1 and D.eval_set(w, 0) is None
  assert sorted(D.eval_set(w, 10**6).index) == list(range(10))  # every window once
  cfg = tmp_path / "c.yaml"
  cfg.write_text(yaml.safe_dump(tiny_raw(run={"eval_batches": 4})))
  rc, err = _cli(capsys, "train", "--config", cfg, "--out", tmp_path / "run", "--dry-run")
  _one_line_error(rc, err, "run.eval_batches", "run.eval_tokens")
  assert not (tmp_path / "run").exists()


# --- one-line errors on the command line -----------------------------------------------------


def _read_only_dir(tmp_path):
  if os.geteuid() == 0:  # root writes anywhere except on read-only file systems
    return pathlib.Path("/sys/scaleopt-run")
  d = tmp_path / "ro"
  d.mkdir(mode=0o500)
  return d / "run"


@pytest.mark.parametrize("case", ["out_is_file", "out_read_only", "bad_extra", "lr_inf",
                                  "lr_nan", "lr_nan_in_file"])
def test_train_bad_input_is_one_line(tmp_path, capsys, case):
  raw = tiny_raw()
  sets, out, words = [], tmp_path / "run", []
  if case == "out_is_file":
    out.write_text("x")
    words = [str(out), "is a file"]
  elif case == "out_read_only":
    out = _read_only_dir(tmp_path)
    words = [str(out), "not writable"]
  elif case == "bad_extra":
    sets = ["optimizer.name=adamw_bc", "optimizer.extra.crossfit=bogus"]
    words = ["crossfit", "bogus", "loo"]
  elif case in ("lr_inf", "lr_nan"):
    sets = [f"optimizer.learning_rate=.{case[3:]}"]
    words = ["optimizer.learning_rate", "finite"]
  else:
    raw["optimizer"]["schedule"]["min_lr_ratio"] = float("nan")
    words = ["optimizer.schedule.min_lr_ratio", "finite"]
  cfg = tmp_path / "c.yaml"
  cfg.write_text(yaml.safe_dump(raw))
  rc, err = _cli(capsys, "train", "--config", cfg, "--out", out, *sum((["--set", x] for x in
                                                                         sets), []))
  _one_line_error(rc, err, *words)


@pytest.mark.parametrize("tokenizer, words", [("bpe:100", ["100", "not allowed"]),
                                              ("bpe:x", ["bpe:x"]), ("words", ["words"])])
def test_data_prepare_bad_tokenizer_leaves_nothing(tmp_path, capsys, tokenizer, words):
  src = tmp_path / "a.txt"
  src.write_text("hello world\n" * 100)
  out = tmp_path / "shards"
  rc, err = _cli(capsys, "data", "prepare", "--input", src, "--out", out, "--tokenizer",
                 tokenizer)
  _one_line_error(rc, err, *words)
  assert not out.exists()


def test_bias_study_defaults_to_a_results_folder():
  args = cli.build_parser().parse_args(["bias-study"])
  assert pathlib.Path(args.out).parts[0] == "results"


def test_state_of_another_structure_is_named_and_kept(tmp_path):
  """A checkpoint whose state lacks a field the run's state has (an optimizer that gained
  counters) is refused in one line that says so; the checkpoint stays where it is."""
  ck = checkpoint.Checkpointer(tmp_path / "c", 2, False)
  ck.save(1, _tiny_state(1.0), {"chunk": 1}, consec=0, param_norm=1.0)
  ck.wait()
  new = {"w": np.zeros((4,), np.float32), "rules": {"clamped": np.zeros((), np.int32)}}
  sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  with pytest.raises(checkpoint.CheckpointError, match="another structure") as e:
    ck.restore_latest(checkpoint.abstract(new, jax.tree.map(lambda _: sh, new)))
  ck.close()
  assert "\n" not in str(e.value) and "rules" in str(e.value)
  assert sorted(p.name for p in (tmp_path / "c").iterdir() if p.name.isdigit()) == ["1"]
