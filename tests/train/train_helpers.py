"""Shared helpers for the training-system tests: small configs that compile fast on CPU."""

import hashlib
import collections
import copy
import functools

import numpy as np

from scaleopt.train import data as D

BASE = {
    "run": {"seed": 0, "steps": 20, "log_every": 1, "eval_every": 10, "eval_tokens": 1024,
            "checkpoint_every": 5, "keep_checkpoints": 10, "progress": False,
            "tensorboard": True, "plot": False},
    "model": {"preset": "tiny", "dtype": "float32", "d_model": 32, "n_layers": 1,
              "d_ff": 64},
    "data": {"source": "embedded", "seq_len": 32, "batch_size": 16, "microbatches": 2},
    "optimizer": {"name": "adamw", "learning_rate": 3e-3, "clip_norm": 1.0,
                  "schedule": {"kind": "cosine", "warmup_steps": 5, "min_lr_ratio": 0.1}},
    "mesh": {"data": -1},
}


def tiny_raw(**sections):
  """BASE with per-section updates, e.g. tiny_raw(run={"steps": 10})."""
  raw = copy.deepcopy(BASE)
  for k, v in sections.items():
    raw.setdefault(k, {}).update(v)
  return raw


def compiled_steps(raw, steps=3):
  """(compiled functions, initial state, the compiled train step, ``steps`` batches on the
  step's sharding) of a config; the batches come from its data in the optimizer's layout
  (groups, rolling B)."""
  import jax
  from scaleopt.train import config as C, loop
  s = loop.setup(C.from_dict(raw))
  fns = loop.compile_fns(s)
  d = s.cfg.data
  it = D.Batches(s.train_w, d.batch_size, d.microbatches, groups=s.spec.num_groups,
                 rolling_b=s.spec.layout == "rolling_b", seed=0)
  batches = [{k: jax.device_put(v, fns.batch_sh) for k, v in it.next().items()}
             for _ in range(steps)]
  state = fns.init()
  return fns, state, fns.train_step.lower(state, batches[0]).compile(), batches


def run_until(cmd, run, step, sig, cwd, env=None, timeout=180):
  """Starts ``cmd``, sends ``sig`` once RUN/metrics.jsonl holds a step >= ``step``.

  Returns (exit code, the logged step when the signal went out or None, stderr text).
  """
  import json
  import os
  import subprocess
  import time
  env = env or dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  sent_at = None
  deadline = time.time() + timeout
  m = run / "metrics.jsonl"
  while time.time() < deadline and p.poll() is None:
    try:  # on a bucket the object can be absent for a moment while a run replaces it
      text = m.read_text() if m.exists() else ""
    except FileNotFoundError:
      text = ""
    rows = [json.loads(l) for l in text.splitlines() if l.strip()]
    if rows and rows[-1]["step"] >= step:
      p.send_signal(sig)
      sent_at = rows[-1]["step"]
      break
    time.sleep(0.02)
  _, err = p.communicate(timeout=120)
  return p.returncode, sent_at, err.decode()


def reference_run(directory, raw):
  """Trains ``raw`` uninterrupted into DIR/run (config in DIR/cfg.yaml); returns both paths."""
  import yaml
  from scaleopt.train import config, loop
  (directory / "cfg.yaml").write_text(yaml.safe_dump(raw))
  loop.train(config.from_dict(raw), directory / "run")
  return directory / "cfg.yaml", directory / "run"


@functools.lru_cache(maxsize=1)
def val_unigram_entropy() -> float:
  """Independent reference: byte-unigram entropy (nats) of the validation files, read directly."""
  counts, n = collections.Counter(), 0
  for rel, path in D.stdlib_files():
    if D.is_val(rel):
      b = path.read_bytes() + b"\0"
      counts.update(b)
      n += len(b)
  p = np.array(list(counts.values()), np.float64) / n
  return float(-(p * np.log(p)).sum())


def heldout(key: str | bytes, fraction: float = 0.05) -> bool:
  """``data prepare``'s document split from its definition: the first 8 bytes of
  blake2b(key), big-endian, below fraction * 2**64."""
  key = key.encode() if isinstance(key, str) else key
  return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(),
                        "big") < fraction * 2**64


def assert_same_windows(local: str, url: str) -> None:
  """A run set up on the shards at ``local`` and on their copy at ``url`` reads the same train
  and val windows."""
  from scaleopt.train import config as C, loop
  got = [loop.setup(C.from_dict(tiny_raw(data={"source": "shards", "path": p})))
         for p in (local, url)]
  for split in ("train_w", "val_w"):
    a, b = getattr(got[0], split), getattr(got[1], split)
    assert a.n == b.n
    np.testing.assert_array_equal(a.get(np.arange(a.n)), b.get(np.arange(b.n)))
