"""The restart point of ``scaleopt data prepare``: after each training shard the position in
the inputs is saved under ``OUT/.prepare/`` (with the few tokens past the shard's end); running
the same command again continues from there and writes the same shards as an uninterrupted
run."""

from __future__ import annotations

import json
import pathlib
from typing import Optional

import numpy as np

from scaleopt.train.prepare.options import Options
from scaleopt.train.prepare.writer import MANIFEST

STATE_DIR = ".prepare"


def clear(out: pathlib.Path) -> None:
  """Removes an earlier run's shards, tokenizer, manifest and restart point."""
  for pat in ("train_*.bin", "train_*.json", "val_*.bin", "val_*.json", STATE_DIR + "/*"):
    for old in out.glob(pat):
      old.unlink()
  for name in ("tokenizer.json", MANIFEST):
    (out / name).unlink(missing_ok=True)


def fingerprint(files: list, tokenizer: str, opts: Options) -> dict:
  """What a restart must share with the interrupted run."""
  st = [(rel, p.stat().st_size, p.stat().st_mtime_ns) for rel, p in files]
  skip = {"skip_bad_records": opts.bad_records_cap} if opts.skip_bad_records else {}
  return {"files": st, "tokenizer": tokenizer, "text_field": opts.text_field,
          "val_fraction": opts.val_fraction, "shard_tokens": opts.shard_tokens,
          "bpe_sample_mb": opts.bpe_sample_mb, "dedup": opts.dedup, **skip}


def load_state(out: pathlib.Path, fp: dict) -> Optional[dict]:
  """The saved restart point, if its fingerprint is this run's."""
  path = out / STATE_DIR / "state.json"
  try:
    state = json.loads(path.read_text())
  except (OSError, ValueError):
    return None
  if state.get("fingerprint") != json.loads(json.dumps(fp)):
    return None
  return state


def save_state(out: pathlib.Path, state: dict, carry: np.ndarray) -> None:
  """Writes the restart point atomically, with the tokens carried into the next shard."""
  d = out / STATE_DIR
  d.mkdir(exist_ok=True)
  name = f"carry_{len(state['shards']['train']):05d}.npy"
  np.save(d / name, carry)
  state["carry"] = name
  tmp = d / "state.json.tmp"
  tmp.write_text(json.dumps(state))
  tmp.replace(d / "state.json")
  for old in d.glob("carry_*.npy"):
    if old.name != name:
      old.unlink()


def drop_unrecorded(out: pathlib.Path, state: dict) -> None:
  """Shards written after the last saved position (an interrupted run's) are written again."""
  for split, shards in state["shards"].items():
    keep = {s["file"] for s in shards}
    for b in out.glob(f"{split}_*.bin"):
      if b.name not in keep:
        b.unlink()
        b.with_suffix(".json").unlink(missing_ok=True)


def remove(out: pathlib.Path) -> None:
  """Removes the restart point of a finished run."""
  for old in (out / STATE_DIR).glob("*"):
    old.unlink()
  if (out / STATE_DIR).is_dir():
    (out / STATE_DIR).rmdir()
