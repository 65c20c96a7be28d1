"""Run outputs: metrics.jsonl, summary.json, TensorBoard, W&B, profiles, the loss-curve PNG.

* ``metrics.jsonl``: one JSON object per logged step; on resume it is truncated to the restored
  step, so every step appears once.
* TensorBoard: scalars through ``tensorboardX.SummaryWriter`` into ``RUN_DIR/tb``. A resumed
  run opens its writer with ``purge_step = restored step + 1``: TensorBoard then hides the
  events the killed run wrote after its last checkpoint, so those steps are not shown twice.
* W&B (``run.wandb: {project: ..., ...}``, only if the ``wandb`` package is installed): the
  same rows via ``wandb.log(row, step=step)``; the W&B run id is kept in ``RUN_DIR/wandb_id``
  so a resumed run continues the same W&B run.
* Telemetry (``run.telemetry_every: N``): per-group norms and BC statistics
  (``scaleopt.train.telemetry``) as ``<quantity>/<group>`` keys and tags, on every N-th step's
  row only.
* Profiles (``run.profile: {start_step: S, steps: K}``): a ``jax.profiler`` trace of the K steps
  after step S in ``RUN_DIR/profile`` (open with TensorBoard's profile plugin or XProf).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import time
from typing import Any, Optional

import jax

from scaleopt.train import storage
from scaleopt.train.config import ConfigError

WANDB_KEYS = ("project", "entity", "name", "group", "tags", "notes", "mode")
PROFILE_KEYS = ("start_step", "steps")


class OutputConfigError(ConfigError):
  """``run.wandb`` / ``run.profile`` is wrong or unusable; the message names the key."""


def _scalars(values: dict) -> dict:
  return {k: float(v) for k, v in values.items() if isinstance(v, (int, float))
          and not isinstance(v, bool) and math.isfinite(float(v))}


class TBWriter:
  """Scalar summaries through ``tensorboardX`` (``purge_step``: see the module docstring)."""

  def __init__(self, directory: str | pathlib.Path, purge_step: Optional[int] = None):
    from tensorboardX import SummaryWriter
    self.dir = storage.path(directory)
    self._mirror = storage.Mirror(self.dir)  # on a bucket: written locally, uploaded by flush
    # a fresh file per writer (tensorboardX names files by the second): readers order them
    # by name, so a resumed run's events come after the killed run's
    self._w = SummaryWriter(logdir=str(self._mirror.local), purge_step=purge_step,
                            flush_secs=30,
                            filename_suffix=f".{time.time_ns()}.{os.getpid()}")

  def scalars(self, step: int, values: dict) -> None:
    for tag, v in _scalars(values).items():
      self._w.add_scalar(tag, v, global_step=step)

  def flush(self) -> None:
    self._w.flush()
    self._mirror.sync()

  def close(self) -> None:
    self._w.close()
    self._mirror.close()


def check_outputs(wandb: Optional[dict], profile: Optional[dict],
                  tensorboard: bool = False) -> None:
  """Validates ``run.wandb``, ``run.profile`` and ``run.tensorboard`` before anything
  compiles."""
  if tensorboard:
    try:
      import tensorboardX as _  # noqa: F401
    except ImportError:
      raise OutputConfigError("run.tensorboard is on but the tensorboardX package is not "
                              "installed (pip install tensorboardX, or set "
                              "run.tensorboard=false)") from None
  if wandb is not None:
    bad = [k for k in wandb if k not in WANDB_KEYS]
    if bad:
      raise OutputConfigError(f"unknown config key 'run.wandb.{bad[0]}'; allowed: "
                              f"{list(WANDB_KEYS)}")
    try:
      import wandb as _  # noqa: F401
    except ImportError:
      raise OutputConfigError("run.wandb is set but the wandb package is not installed "
                              "(pip install wandb, or remove run.wandb)") from None
  if profile is not None:
    if sorted(profile) != sorted(PROFILE_KEYS) or not all(
        isinstance(profile[k], int) and not isinstance(profile[k], bool) for k in PROFILE_KEYS):
      raise OutputConfigError(f"config key 'run.profile'={profile!r} must be "
                              "{start_step: int >= 0, steps: int >= 1}")
    if profile["start_step"] < 0 or profile["steps"] < 1:
      raise OutputConfigError(f"config key 'run.profile'={profile!r}: start_step must be >= 0 "
                              "and steps >= 1")


class WandbWriter:
  """Rows to Weights & Biases; the run id lives in ``RUN_DIR/wandb_id`` for resumes."""

  def __init__(self, out_dir: pathlib.Path, settings: dict, config: dict, resume: bool):
    import wandb
    id_file = out_dir / "wandb_id"
    run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
    self._wandb = wandb
    self._mirror = storage.Mirror(out_dir)  # W&B's own files need a local folder
    self.run = wandb.init(dir=str(self._mirror.local), config=config, id=run_id,
                          resume="allow" if run_id else None, **settings)
    id_file.write_text(str(self.run.id))

  def scalars(self, step: int, values: dict) -> None:
    self.run.log(_scalars(values), step=step)

  def close(self) -> None:
    self.run.finish()
    self._mirror.close()


class Profile:
  """A ``jax.profiler`` trace of steps ``start_step + 1 .. start_step + steps``.

  Call ``before(t)`` before running the step that completes step ``t + 1`` and ``after(done,
  x)`` after it (``x``: an output of the step, waited on before the trace stops). A run
  resumed past ``start_step`` takes no profile.
  """

  def __init__(self, directory: pathlib.Path, settings: Optional[dict]):
    """``settings``: ``run.profile`` (None: no profile)."""
    s = settings or {"start_step": None, "steps": 0}
    self.dir, self.start = directory, s["start_step"]
    self._mirror = None
    self.stop = None if self.start is None else self.start + s["steps"]
    self.active = False

  def before(self, t: int) -> None:
    if t == self.start and not self.active:
      self._mirror = storage.Mirror(self.dir)  # on a bucket: traced locally, uploaded at close
      storage.mkdir(self._mirror.local)
      jax.profiler.start_trace(str(self._mirror.local))
      self.active = True

  def after(self, done: int, x: Any) -> None:
    if self.active and done >= self.stop:
      self.close(x)

  def close(self, x: Any = None) -> None:
    if self.active:
      jax.block_until_ready(x)
      jax.profiler.stop_trace()
      self.active = False
      self._mirror.close()


# ---------------------------------------------------------------------------------------------
# JSON outputs and the plot.


def _clean(v):
  if isinstance(v, float) and not math.isfinite(v):
    return None
  return v


# the metrics rows' keys that time the run
TIMING = ("tokens_per_s", "mfu", "wall_s", "train_s", "timed_steps")


class Meter:
  """Training-only wall time (after the compile step, without eval) and tokens/s, of the
  trainer and of the study's vmapped cells (``tokens_per_step``: of all cells together).
  A resumed run carries its earlier pieces' timed steps and wall time over (``resume``)."""

  def __init__(self, tokens_per_step: int):
    self.tps_unit = tokens_per_step
    self.t0 = time.time()
    self.compile_s = None
    self.last_t, self.last_step = None, None
    self.train_s, self.timed_steps = 0.0, 0
    self.prior_wall_s = 0.0

  def resume(self, rows: list[dict]) -> None:
    """Continues from the last kept metrics row of the run's earlier pieces: its cumulative
    ``timed_steps``, ``train_s`` and ``wall_s``. Rows written without them (older runs) give
    their intervals instead: each row's steps since the previous row at its tokens/s."""
    last = rows[-1] if rows else {}
    if "timed_steps" in last:
      self.timed_steps, self.train_s = int(last["timed_steps"]), float(last["train_s"])
    else:
      for prev, row in zip(rows, rows[1:]):
        tps = row.get("tokens_per_s")
        if tps is not None and tps == tps and tps > 0:
          self.timed_steps += row["step"] - prev["step"]
          self.train_s += (row["step"] - prev["step"]) * self.tps_unit / tps
    self.prior_wall_s = float(last.get("wall_s") or 0.0)

  def wall(self) -> float:
    """Wall time of the run so far: this process's and its earlier pieces'."""
    return self.prior_wall_s + time.time() - self.t0

  def first_step_done(self, step: int) -> None:
    self.compile_s = time.time() - self.t0
    self.last_t, self.last_step = time.time(), step

  def interval(self, step: int) -> float:
    """tokens/s since the previous call (NaN for an empty interval)."""
    now = time.time()
    n, dt = step - self.last_step, now - self.last_t
    self.last_t, self.last_step = now, step
    if n <= 0 or dt <= 0:
      return float("nan")
    self.train_s += dt
    self.timed_steps += n
    return n * self.tps_unit / dt

  def pause_done(self) -> None:  # eval just ran: do not count its time
    self.last_t = time.time()

  def restart(self, step: int) -> None:
    """A program ran for the first time up to ``step`` (loading its kernels, building its
    cuDNN plans and CUDA graphs): the steps since the last interval are not timed."""
    self.last_t, self.last_step = time.time(), step

  def overall(self) -> float:
    return self.timed_steps * self.tps_unit / self.train_s if self.train_s > 0 else float("nan")


def step_row(step: int, last: dict, tokens: int, tokens_per_s: float, meter: Meter,
             cells: int = 1, window: Optional[list[dict]] = None) -> dict:
  """One metrics.jsonl row from the host copy of a step's metrics (``last``: name -> scalar);
  the skip counters as integers; the meter's cumulative timing (``wall_s``: a cell's share
  of the wall time when ``cells`` train in one program). ``window``: the host metrics of every
  step since the previous row (``last`` among them; None: ``last`` alone), for the fraction of
  them whose gradient was clipped (``clip_fraction``, from the steps' ``clip_fired``)."""
  fired = [float(m["clip_fired"]) for m in (window or [last]) if "clip_fired" in m]
  row = {"step": step, **{k: float(v) for k, v in last.items() if k != "clip_fired"},
         "tokens": tokens, "tokens_per_s": tokens_per_s, "wall_s": meter.wall() / cells,
         "train_s": meter.train_s, "timed_steps": meter.timed_steps}
  if fired:
    row["clip_fraction"] = sum(fired) / len(fired)
  row["skipped"], row["consec"] = int(row["skipped"]), int(row["consec"])
  return row


class MetricsLog:
  """``metrics.jsonl`` (one object per logged step) plus TensorBoard and W&B scalars.

  ``resume_step``: the restored step of a resumed run (rows after it are dropped from the
  JSONL file and purged from TensorBoard's view); ``wandb``: the ``run.wandb`` settings.
  """

  def __init__(self, out_dir: pathlib.Path, *, resume_step: Optional[int] = None,
               tensorboard: bool = True, enabled: bool = True, wandb: Optional[dict] = None,
               config: Optional[dict] = None):
    self.path = out_dir / "metrics.jsonl"
    self.enabled = enabled
    self.tb = self.wandb = None
    if not enabled:
      self._f = None
      return
    if resume_step is not None and self.path.exists():  # drop what the restored state undid
      keep = [l for l in self.path.read_text().splitlines()
              if l.strip() and json.loads(l)["step"] <= resume_step]
      self.path.write_text("".join(l + "\n" for l in keep))
    elif resume_step is None and self.path.exists():
      self.path.unlink()
    self._f = storage.Appender(self.path)
    if tensorboard:
      self.tb = TBWriter(out_dir / "tb",
                         purge_step=None if resume_step is None else resume_step + 1)
    if wandb is not None:
      self.wandb = WandbWriter(out_dir, wandb, config or {}, resume=resume_step is not None)

  def write(self, row: dict) -> None:
    if not self.enabled:
      return
    row = without_idle_telemetry(row)
    self._f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
    values = {k: v for k, v in row.items() if k != "step"}
    for w in (self.tb, self.wandb):
      if w is not None:
        w.scalars(int(row["step"]), values)

  def flush(self) -> None:
    if self.enabled:
      self._f.flush()
      if self.tb is not None:
        self.tb.flush()

  def close(self) -> None:
    if self.enabled:
      self._f.close()
      for w in (self.tb, self.wandb):
        if w is not None:
          w.close()


def without_idle_telemetry(row: dict) -> dict:
  """The row without the telemetry flag, and without the (NaN) telemetry values of a step that
  computed none."""
  from scaleopt.train import telemetry
  if telemetry.FLAG not in row:
    return row
  on = row[telemetry.FLAG] == 1
  return {k: v for k, v in row.items()
          if k != telemetry.FLAG and (on or not telemetry.is_telemetry_key(k))}


def read_metrics(path: str | pathlib.Path) -> list[dict]:
  return [json.loads(l) for l in storage.path(path).read_text().splitlines() if l.strip()]


def write_summary(out_dir: pathlib.Path, summary: dict) -> None:
  (out_dir / "summary.json").write_text(
      json.dumps({k: _clean(v) for k, v in summary.items()}, indent=2) + "\n")


def plot_curves(runs: dict[str, list[dict]], path: pathlib.Path, title: str = "") -> None:
  """Train (thin) and eval (markers) loss against step for one or more runs."""
  from matplotlib.figure import Figure  # no pyplot: the caller's backend is left alone
  fig = Figure(figsize=(6, 4))
  ax = fig.subplots()
  for i, (name, rows) in enumerate(runs.items()):
    color = f"C{i}"
    tr = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    ev = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    if tr:
      ax.plot(*zip(*tr), color=color, lw=1, alpha=0.7, label=f"{name} train")
    if ev:
      ax.plot(*zip(*ev), color=color, marker="o", ls="--", label=f"{name} eval")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats/token)")
  if title:
    ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  if storage.is_url(path):
    import io
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=120)
    path.write_bytes(buf.getvalue())
  else:
    fig.savefig(path, dpi=120)
