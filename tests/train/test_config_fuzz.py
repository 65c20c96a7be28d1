"""Config fuzzer: seeded mutations of the shipped training configs through the command line.

Every mutated config must end with exit 0 (``config ok``) or with exit 2 and one line
``error: ...`` on stderr -- never an uncaught exception. ``--dry-run`` makes every check a
run makes before its first step and traces the train step, so the big configs are covered
too without compiling them; the slow variant also trains the clean mutations of CPU-sized
configs for 3 steps.
"""

import copy
import pathlib

import numpy as np
import pytest
import yaml

from scaleopt import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs" / "train").glob("*.yaml"))
VALUES = [-1, 0, 1, 2, 3, 7, 64, 10**6, 2**40, -0.5, 0.0, 1e-12, 1e30, float("nan"),
          float("inf"), "bogus", "", None, True, False, [], {}, [1, 2], {"a": 1}]


def _leaves(d, path=()):
  if isinstance(d, dict) and d:
    for k, v in d.items():
      yield from _leaves(v, path + (k,))
  else:
    yield path


def _set(d, path, value):
  for p in path[:-1]:
    d = d[p]
  d[path[-1]] = value


def _delete(d, path):
  for p in path[:-1]:
    d = d[p]
  del d[path[-1]]


def mutate(text: str, rng: np.random.Generator) -> tuple[str, str]:
  """(mutated YAML text, what was done)."""
  raw = yaml.safe_load(text)
  leaves = [p for p in _leaves(raw) if p]
  op = rng.choice(["value", "value", "value", "delete", "typo", "section", "swap", "text"])
  if op == "text":  # a syntax-level edit: truncate, or insert a YAML-special character
    i = int(rng.integers(len(text)))
    if rng.random() < 0.5:
      return text[:i], f"truncated at byte {i}"
    c = str(rng.choice([":", "[", "{", "\t", "- ", "&", "'"]))
    return text[:i] + c + text[i:], f"inserted {c!r} at byte {i}"
  raw = copy.deepcopy(raw)
  path = leaves[int(rng.integers(len(leaves)))]
  key = ".".join(map(str, path))
  if op == "value":
    v = VALUES[int(rng.integers(len(VALUES)))]
    _set(raw, path, v)
    what = f"{key}={v!r}"
  elif op == "delete":
    _delete(raw, path)
    what = f"deleted {key}"
  elif op == "typo":
    k = str(path[-1])
    j = int(rng.integers(len(k)))
    typo = k[:j] + k[j + 1:] + k[j]  # move one letter to the end
    typo = typo if typo != k else k + "x"
    _set(raw, path[:-1] + (typo,), raw_get(raw, path))
    what = f"added {'.'.join(map(str, path[:-1] + (typo,)))}"
  elif op == "section":
    sec = path[0]
    raw[sec] = VALUES[int(rng.integers(len(VALUES)))]
    what = f"section {sec}={raw[sec]!r}"
  else:  # a value of another key, often of another type
    other = leaves[int(rng.integers(len(leaves)))]
    _set(raw, path, raw_get(raw, other))
    what = f"{key}=<value of {'.'.join(map(str, other))}>"
  return yaml.safe_dump(raw, sort_keys=False), what


def raw_get(d, path):
  for p in path:
    d = d[p]
  return copy.deepcopy(d)


def _train_briefly(cfg, out, capsys) -> None:
  """A dry-run-clean mutation of a CPU-sized config, trained for 3 steps for real: exit 0, or
  3 if it diverges (e.g. a huge learning rate), never a traceback. Mutations that made the
  model or the batch large are skipped."""
  from scaleopt import models
  from scaleopt.train import bridge, config as C
  c = C.load_config(cfg)
  mc = bridge.model_config(c.model)
  if (models.count_params(mc) > 2_000_000 or mc.n_layers > 8
      or c.data.batch_size * c.data.seq_len > 16_384):
    return
  rc = cli.main(["train", "--config", str(cfg), "--out", str(out), "--set", "run.steps=3",
                 "--set", "optimizer.schedule.warmup_steps=0", "--set", "run.progress=false"])
  err = capsys.readouterr().err
  assert rc in (0, 3) and "Traceback" not in err, (rc, err[-2000:])


def _check(seed, tmp_path, capsys, train=False):
  rng = np.random.default_rng(seed)
  src = CONFIGS[int(rng.integers(len(CONFIGS)))]
  text, what = mutate(src.read_text(), rng)
  cfg = tmp_path / "fuzzed.yaml"
  cfg.write_text(text)
  out = tmp_path / "run"
  rc = cli.main(["train", "--config", str(cfg), "--out", str(out), "--dry-run"])
  io = capsys.readouterr()
  err = [l for l in io.err.splitlines() if l.strip()]
  case = f"seed {seed}: {src.name}, {what} -> rc {rc}, stderr {err[-3:]}"
  assert rc in (0, 2), case
  if rc == 2:
    assert len(err) >= 1 and err[-1].startswith("error: "), case
    assert sum(l.startswith("error") for l in err) == 1, case
  else:
    assert io.out.startswith("config ok"), case
  assert not any("Traceback" in l for l in err), case
  assert not out.exists(), case  # a dry run writes nothing
  if train and rc == 0 and src.name.startswith("tiny"):
    _train_briefly(cfg, out, capsys)


@pytest.mark.parametrize("seed", range(18))
def test_fuzzed_config_fast(seed, tmp_path, capsys):
  _check(seed, tmp_path, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(18, 118))
def test_fuzzed_config(seed, tmp_path, capsys):
  _check(seed, tmp_path, capsys, train=True)
