"""``scaleopt train``: load the config, train, report errors clearly."""

from __future__ import annotations

import sys

from scaleopt.train.config import ConfigError, load_config
from scaleopt.train.data import DataError


def train_main(config_path: str, out_dir: str, overrides: list[str] | None = None,
               resume: bool = False, dry_run: bool = False) -> int:
  """Runs one training job; returns 0, 2 (bad config or data, no intact checkpoint, a
  checkpoint or output that cannot be written, out of device memory), 3 (stopped after too many non-finite steps)
  or 143 (SIGTERM/SIGINT: checkpointed, resume with --resume). Errors are one line on stderr.

  ``dry_run``: make every check a run makes before its first step, trace the step, write
  nothing.
  """
  from scaleopt.train import bridge, checkpoint, faults, loop, preflight, runfolder
  try:
    cfg = load_config(config_path, overrides or [])
    runfolder.check_local(out_dir)
    if dry_run:
      print(loop.dry_run(cfg, out_dir, resume=resume))
      return 0
    import jax

    from scaleopt.train.mesh import maybe_initialize_distributed
    maybe_initialize_distributed(cfg.mesh.distributed)  # the processes compare their --out
    cfg = bridge.with_source_architecture(cfg)  # a model.init_from source is read now
    preflight.check_out_dir(cfg, out_dir, resume)  # a usable folder before the lock creates it
    with runfolder.claim(out_dir, process_index=jax.process_index()):
      summary = loop.train(cfg, out_dir, resume=resume)
  except (ConfigError, DataError, checkpoint.CheckpointError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except OSError as e:  # e.g. the disk filled up while writing metrics
    print(f"error: {e}", file=sys.stderr)
    return 2
  except faults.OutOfMemory as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  except faults.SkipLimit as e:
    print(f"error: {e}", file=sys.stderr)
    return faults.EXIT_SKIPS
  except faults.Interrupted as e:
    print(f"interrupted: {e}", file=sys.stderr)
    return faults.EXIT_SIGNAL
  if summary["final_train_loss"] is None:  # resumed a finished run: nothing was trained
    print(f"done: already at step {summary['steps']}, eval loss "
          f"{summary['final_eval_loss']:.4f}; outputs in {out_dir}")
    return 0
  print(f"done: {summary['steps']} steps, train loss {summary['final_train_loss']:.4f}, eval "
        f"loss {summary['final_eval_loss']:.4f}, {summary['tokens_per_s']:.0f} tokens/s; "
        f"outputs in {out_dir}")
  return 0
