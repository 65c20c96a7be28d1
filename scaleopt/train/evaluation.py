"""Evaluation on the fixed held-out set (``data.eval_set``): its windows put on the devices
once, scored in microbatches by the compiled eval step."""

from __future__ import annotations

import sys
from typing import Optional

import jax

from scaleopt.train import data, mesh as mesh_lib
from scaleopt.train.config import TrainConfig


def eval_microbatch(cfg: TrainConfig) -> int:
  """Windows per evaluation microbatch: the training microbatch's sequences."""
  return cfg.data.batch_size // cfg.data.microbatches


def make_evaluate(cfg: TrainConfig, fns, ev: Optional[data.EvalSet], is_main: bool = True):
  """``evaluate(params) -> mean CE over the evaluation set`` (NaN without one), with the eval
  step and batch sharding of ``fns`` (``loop.Compiled``): its windows put on the devices once,
  in microbatches of ``eval_microbatch(cfg)``."""
  if ev is None:
    return lambda params: float("nan")
  want = cfg.run.eval_tokens // cfg.data.seq_len
  if want > ev.n and is_main:
    print(f"note: run.eval_tokens={cfg.run.eval_tokens} asks for {want} windows of "
          f"seq_len={cfg.data.seq_len}; the held-out split holds {ev.n}, evaluating on all "
          "of them", file=sys.stderr)
  size = eval_microbatch(cfg)
  toks, _ = ev.microbatches(size, jax.process_index(), jax.process_count())
  toks = mesh_lib.put_global(fns.batch_sh, toks, (toks.shape[0], size, cfg.data.seq_len + 1))
  return lambda params: float(ev.mean(jax.device_get(fns.eval_step(params, toks))))


def eval_identity(ev: Optional[data.EvalSet]) -> dict:
  """The summary's record of the evaluation set (``eval_set``: its hash; runs compare only
  where it is equal)."""
  if ev is None:
    return {"eval_set": None, "eval_windows": 0}
  return {"eval_set": ev.ident, "eval_windows": ev.n}
