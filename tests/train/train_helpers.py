"""Shared helpers for the training-system tests: small configs that compile fast on CPU."""

import copy

BASE = {
    "run": {"seed": 0, "steps": 20, "log_every": 1, "eval_every": 10, "eval_batches": 2,
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
