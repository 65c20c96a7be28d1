"""``scaleopt train``: load the config, train, report errors clearly."""

from __future__ import annotations

import sys

from scaleopt.train.config import ConfigError, load_config
from scaleopt.train.data import DataError


def train_main(config_path: str, out_dir: str, overrides: list[str] | None = None,
               resume: bool = False) -> int:
  """Runs one training job; returns 0, 2 (bad config/data), 3 (stopped after too many
  non-finite steps) or 143 (SIGTERM/SIGINT: checkpointed, resume with --resume)."""
  from scaleopt.train import loop
  try:
    cfg = load_config(config_path, overrides or [])
    summary = loop.train(cfg, out_dir, resume=resume)
  except (ConfigError, DataError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except loop.SkipLimit as e:
    print(f"error: {e}", file=sys.stderr)
    return loop.EXIT_SKIPS
  except loop.Interrupted as e:
    print(f"interrupted: {e}", file=sys.stderr)
    return loop.EXIT_SIGNAL
  ev = summary["final_eval_loss"]
  print(f"done: {summary['steps']} steps, train loss {summary['final_train_loss']:.4f}, eval "
        f"loss {ev:.4f}, {summary['tokens_per_s']:.0f} tokens/s; outputs in {out_dir}")
  return 0
