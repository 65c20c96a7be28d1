"""Checks of the output folder before a run (or a dry run) writes anything, and the run's
first outputs: ``--out`` is usable, checkpoints are reused only with ``--resume`` and a config
that may resume, the data matches the run's record, ``config.yaml`` is written once."""

from __future__ import annotations

import pathlib
import tempfile

import jax

from scaleopt.train import config as config_lib, identity
from scaleopt.train.config import ConfigError, TrainConfig, dump_config


def has_checkpoints(out: pathlib.Path) -> bool:
  ckpt_dir = pathlib.Path(out) / "checkpoints"
  return ckpt_dir.is_dir() and any(ckpt_dir.iterdir())


def check_out_dir(cfg: TrainConfig, out_dir: str | pathlib.Path, resume: bool) -> dict:
  """Reads only: ``--out`` is (or can become) a writable directory, one that holds
  checkpoints is reused only with ``--resume``, and then only with a config that may resume
  (``config.check_resume``). Returns the resumable changes."""
  out = pathlib.Path(out_dir)
  probe = out
  while not probe.exists() and probe != probe.parent:
    probe = probe.parent
  if not probe.is_dir():
    raise ConfigError(f"--out {str(out)!r}: {str(probe)!r} is a file, not a directory")
  try:  # a real probe: os.access is wrong for root and for read-only mounts
    tempfile.TemporaryDirectory(dir=probe).cleanup()
  except OSError as e:
    raise ConfigError(f"--out {str(out)!r} is not writable ({e.strerror or e} in "
                      f"{str(probe)!r})") from None
  if has_checkpoints(out) and not resume:
    raise ConfigError(f"{str(out)!r} already holds checkpoints; pass --resume to continue that "
                      "run or choose another --out")
  return config_lib.check_resume(cfg, out) if has_checkpoints(out) else {}


def data_record(cfg: TrainConfig, out: str | pathlib.Path, resume: bool) -> dict:
  """What the run trains on (``identity.describe``); resuming a run that has checkpoints, the
  record it wrote when it started must match (else a one-line ConfigError)."""
  record = identity.describe(cfg)
  if resume and has_checkpoints(pathlib.Path(out)):
    identity.check(pathlib.Path(out), record)
  return record


def start_outputs(cfg: TrainConfig, out: pathlib.Path, resuming: bool) -> None:
  """config.yaml is written when a run starts and never rewritten: a resumed run's changes go
  to config_history.jsonl (``config.record_changes``)."""
  out.mkdir(parents=True, exist_ok=True)
  if jax.process_index() != 0 or (resuming and (out / "config.yaml").exists()):
    return
  dump_config(cfg, out / "config.yaml")
  (out / config_lib.HISTORY).unlink(missing_ok=True)
