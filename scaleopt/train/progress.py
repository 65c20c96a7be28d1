"""What a run reports every ``run.log_every`` steps: one metrics row per cell (written to its
``metrics.jsonl`` and writers) and, on the terminal, a progress bar (one cell, ``run.progress``)
or one plain line per cell."""

from __future__ import annotations

from typing import Optional

import numpy as np

from scaleopt.train import metrics


def log_line(row: dict, steps: int) -> str:
  """One plain progress line for a metrics row (the terminal form when ``run.progress`` is
  off), e.g. ``step 20/300 loss 4.1234 eval 4.2000 lr 3.00e-03 tok/s 12,345``."""
  parts = [f"step {row['step']}/{steps}", f"loss {row['loss']:.4f}"]
  if "eval_loss" in row:
    parts.append(f"eval {row['eval_loss']:.4f}")
  if "lr" in row:
    parts.append(f"lr {row['lr']:.2e}")
  if row.get("tokens_per_s") == row.get("tokens_per_s"):  # not NaN (the first interval)
    parts.append(f"tok/s {row['tokens_per_s']:,.0f}")
  if row.get("skipped"):
    parts.append(f"skipped {row['skipped']}")
  return " ".join(parts)


def per_cell(m: dict, n: int) -> list[dict]:
  """A step's host metrics (scalars, each with a leading cell axis or, for the ordinary run,
  none) as one dict of scalars per cell."""
  flat = {k: np.reshape(v, (n,)) for k, v in m.items()}
  return [{k: v[i] for k, v in flat.items()} for i in range(n)]


def losses(fetched: list[dict], n: int) -> np.ndarray:
  """[steps, n] training losses of the host metrics fetched since the last log."""
  return np.asarray([np.reshape(f["loss"], (n,)) for f in fetched], np.float64)


def bar(steps: int, step0: int):
  """The terminal's progress bar from ``step0`` to ``steps``."""
  from tqdm import tqdm
  return tqdm(total=steps, initial=step0, desc="train", unit="step", dynamic_ncols=True,
              mininterval=0.5)


def rows(done: int, last: dict, n: int, meter: metrics.Meter, tps: float) -> list[dict]:
  """The metrics rows of the cells at step ``done`` from the last step's host metrics
  ``last``; ``tps`` is the interval's throughput of all cells together."""
  return [metrics.step_row(done, m, done * meter.tps_unit // n, tps / n, meter, n)
          for m in per_cell(last, n)]


def report(rows_: list[dict], logs: list, eval_loss: Optional[np.ndarray], mfu: Optional[float],
           steps: int, bar_=None, labels: Optional[list] = None, is_main: bool = True) -> None:
  """Completes and writes each cell's row (``mfu``: the devices', all cells together;
  ``eval_loss`` on an evaluation step), then the bar's postfix or one line per cell."""
  for i, (row, log) in enumerate(zip(rows_, logs)):
    if mfu is not None:
      row["mfu"] = mfu
    if eval_loss is not None:
      row["eval_loss"] = float(eval_loss[i])
    log.write(row)
    log.flush()
    if bar_ is None and is_main:  # no bar (run.progress=false, batch jobs, cells)
      label = f"{labels[i]} " if labels else ""
      print(label + log_line(row, steps), flush=True)
  if bar_ is not None:
    bar_.set_postfix(loss=f"{rows_[0]['loss']:.3f}",
                     **({"eval": f"{eval_loss[0]:.3f}"} if eval_loss is not None else {}))
