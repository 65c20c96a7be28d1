"""A run's end: each cell's ``summary.json`` record and the error that names how it stopped."""

from __future__ import annotations

import jax
import numpy as np

from scaleopt import models, optim
from scaleopt.train import checkpoint, faults, flops, metrics
from scaleopt.train.config import TrainConfig


def summarize(cfg: TrainConfig, parts, res, meter: metrics.Meter, start, cell: int = 0) -> dict:
  """One cell's summary.json from the setup ``parts`` (``loop.Setup``) and the host loop's
  ``res`` (``loop.Outcome``). Throughput and wall time are the cells' shares (``n`` cells
  train in one program: the meter counts the tokens of all of them); ``mfu`` is the devices'."""
  passes = parts.spec.passes_per_step
  flops_per_token, peak_all = flops.run_flops(parts.model.cfg, cfg.data.seq_len, passes,
                                              cfg.run.peak_flops)
  n = len(res.diverged)
  tps_all = meter.overall()
  losses = None if res.last_losses is None else res.last_losses[:, cell]
  return {
      "steps": res.done, "tokens": res.done * meter.tps_unit // n,
      "final_train_loss": float(np.mean(losses)) if losses is not None else None,
      "final_eval_loss": float(res.eval_loss[cell]),
      "wall_time_s": meter.wall() / n,
      "compile_s": meter.compile_s, "tokens_per_s": tps_all / n,
      "params": models.count_params(parts.model.cfg),
      "mfu": tps_all * flops_per_token / peak_all if peak_all else None,
      "skipped_steps": res.last_rows[cell].get("skipped", 0) if res.last_rows else 0,
      "optimizer": cfg.optimizer.name,
      # summary.json records CollectorSpec.passes_per_step under this key
      "layout": parts.spec.layout, "sweeps_per_step": passes,
      "optimizer_numerics": optim.resolved_numerics(cfg.optimizer),
      "devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind,
      "resumed_from": start,
      "stopped_early": bool(res.diverged[cell]) or res.interrupted is not None,
      "interrupted_by": res.interrupted, "phase_shifts": res.phase_shifts,
  }


def raise_for_stop(res, ckpt: checkpoint.Checkpointer, max_skips: int) -> None:
  """Interrupted after a signal, SkipLimit after a non-finite stop (naming what was kept);
  nothing after a run that reached its last step."""
  d = ckpt.dir
  if res.interrupted is not None:
    raise faults.Interrupted(f"{res.interrupted} at step {res.done}: the state is "
                             f"checkpointed in {d}/{res.done}; continue with --resume")
  if res.stopped is not None:
    good = ckpt.last_good_step()
    where = (f"the state at the stop is checkpointed in {d}/{res.done}" if res.stop_saved
             else f"the state at the stop is not saved (its parameter norm grew more than "
             f"{checkpoint.GROWTH:g}x)")
    keep = (f"; the newest checkpoint from before the trouble, {d}/{good}, is kept"
            if good is not None else "")
    raise faults.SkipLimit(f"stopped at step {res.done}: {max_skips} consecutive steps had a "
                           f"non-finite loss or update (parameters were left untouched); "
                           f"{where}{keep}")
