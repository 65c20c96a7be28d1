"""The training loop: set up, train, evaluate, checkpoint, log; resume exactly.

``train(cfg, out_dir, resume)`` returns the summary dict. The host loop only dispatches: it
reads the device once per step for the previous step's consecutive-skip counter (one step
behind, so the device is never idle) and fetches metrics every ``log_every`` steps.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import sys
import threading
import time
from typing import Any, Optional

import jax
import numpy as np

from scaleopt import models
from scaleopt.train import (bridge, checkpoint, convert, data, mesh as mesh_lib, metrics,
                            step as step_lib)
from scaleopt.train.config import ConfigError, TrainConfig, dump_config

EXIT_OK, EXIT_SKIPS, EXIT_SIGNAL = 0, 3, 143

# Dense bf16 peak FLOP/s per chip, matched against ``device_kind``.
_TPU_PEAK = {"v4": 275e12, "v5 lite": 197e12, "v5e": 197e12, "v5p": 459e12, "v6": 918e12}


class SkipLimit(RuntimeError):
  """Too many consecutive non-finite steps; the last good state was checkpointed."""


class Interrupted(RuntimeError):
  """SIGTERM / SIGINT (preemption, Ctrl-C): the state was checkpointed, resume with --resume."""


class _Signals:
  """SIGTERM / SIGINT -> a flag the loop checks between steps; a second signal exits at once.

  Python runs signal handlers only between bytecodes, so a main thread blocked in a device
  wait would not see them. The C-level handler writes the signal number to a wakeup pipe
  (``signal.set_wakeup_fd``) that a daemon thread reads: the first signal sets the flag (the
  loop then checkpoints and stops), a second one ends the process immediately with
  128 + signum, even if a computation hangs.
  """

  def __init__(self):
    self.caught = None
    self._old, self._fds, self._old_fd, self._thread = {}, None, None, None

  def __enter__(self):
    if threading.current_thread() is not threading.main_thread():
      return self
    r, w = os.pipe()
    os.set_blocking(w, False)
    self._fds = (r, w)
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._old[sig] = signal.signal(sig, lambda *_: None)
    self._old_fd = signal.set_wakeup_fd(w)
    self._thread = threading.Thread(target=self._watch, args=(r,), daemon=True)
    self._thread.start()
    return self

  def _watch(self, r: int) -> None:
    while True:
      try:
        b = os.read(r, 1)
      except OSError:
        return
      if not b:
        return
      if self.caught is None:
        self.caught = signal.Signals(b[0]).name
        print(f"\n{self.caught}: stopping after this step and checkpointing (send it again to "
              "exit at once)", file=sys.stderr, flush=True)
      else:
        os._exit(128 + b[0])

  def __exit__(self, *exc):
    if self._fds is None:
      return
    signal.set_wakeup_fd(self._old_fd)
    for sig, old in self._old.items():
      signal.signal(sig, old)
    r, w = self._fds
    os.close(w)  # the watcher reads EOF and returns
    self._thread.join(timeout=5)
    os.close(r)


def peak_flops(device, override: Optional[float]) -> Optional[float]:
  if override:
    return float(override)
  kind = getattr(device, "device_kind", "")
  for name, f in models.PEAK_FLOPS.items():
    if name in kind:
      return f
  for name, f in _TPU_PEAK.items():
    if name in kind.lower():
      return f
  return None


@dataclasses.dataclass
class Setup:
  """Everything built from a config before anything compiles."""
  cfg: TrainConfig
  model: bridge.Model
  tx: Any
  spec: Any
  schedule: Any
  mesh: Any
  train_w: data.Windows
  val_w: data.Windows
  vocab: int


def setup(cfg: TrainConfig) -> Setup:
  """Builds data, model, optimizer and mesh; every user error surfaces here."""
  mesh_lib.maybe_initialize_distributed(cfg.mesh.distributed)
  metrics.check_outputs(cfg.run.wandb, cfg.run.profile)
  model = bridge.make_model(cfg.model)
  if model.init_from:
    try:
      convert.check_matches(convert.open_source(model.init_from), model.cfg)
    except convert.SourceError as e:
      raise ConfigError(str(e)) from None
  wd_policy = model.wd_policy
  tx, spec, schedule = bridge.build_optimizer(
      cfg.optimizer, wd_mask=lambda p: models.weight_decay_mask(p, wd_policy),
      sparse_filter=bridge.sparse_filter)
  d = cfg.data
  train_w, vocab = data.open_split(d.source, d.path, "train", d.seq_len)
  val_w, _ = data.open_split(d.source, d.path, "val", d.seq_len)
  if vocab > model.cfg.vocab_size:
    raise ConfigError(f"the data's vocabulary ({vocab} tokens) is larger than "
                      f"model.vocab_size={model.cfg.vocab_size}; set model.vocab_size >= {vocab}")
  mesh = mesh_lib.make_mesh(cfg.mesh)
  mesh_lib.check_batch(mesh, d.batch_size, d.microbatches)
  if spec.layout == "loo" and d.microbatches < 2:
    raise ConfigError("optimizer layout 'loo' needs data.microbatches >= 2")
  if spec.layout in ("ab", "symmetric") and spec.var_of is not None and d.microbatches < 2:
    raise ConfigError(f"optimizer layout {spec.layout!r} with a variance correction needs "
                      "data.microbatches >= 2 per group")
  return Setup(cfg, model, tx, spec, schedule, mesh, train_w, val_w, vocab)


def _put(sharding, local: np.ndarray, global_shape: tuple) -> jax.Array:
  return jax.make_array_from_process_local_data(sharding, local, global_shape)


@dataclasses.dataclass
class Compiled:
  """The jitted functions and the shardings they were compiled for."""
  init: Any  # () -> TrainState
  init_with: Any  # params -> TrainState (step 0, optimizer state for these parameters)
  train_step: Any  # (state, batch) -> (state, metrics); state donated
  eval_step: Any  # (params, tokens [B, T+1]) -> mean CE
  state_shape: Any  # TrainState of ShapeDtypeStruct
  state_sh: Any
  batch_sh: Any
  eval_sh: Any


def compile_fns(s: Setup) -> Compiled:
  """Shardings for state and batches, and the jitted init / train / eval functions."""
  mesh, seed = s.mesh, s.cfg.run.seed
  init_fn = lambda: step_lib.init_state(s.model, s.tx, seed)
  state_shape = jax.eval_shape(init_fn)
  param_sh = mesh_lib.param_shardings(mesh, state_shape.params,
                                      models.partition_rules(s.model.cfg))
  state_sh = mesh_lib.state_shardings(mesh, state_shape, state_shape.params, param_sh)
  state_sh = state_sh._replace(params=param_sh)
  batch_sh, eval_sh = mesh_lib.batch_sharding(mesh), mesh_lib.eval_sharding(mesh)
  return Compiled(
      init=jax.jit(init_fn, out_shardings=state_sh),
      init_with=jax.jit(lambda p: init_fn()._replace(params=p, opt_state=s.tx.init(p)),
                        in_shardings=(param_sh,), out_shardings=state_sh),
      train_step=jax.jit(step_lib.make_train_step(s.model, s.tx, s.spec, s.schedule),
                         in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
                         donate_argnums=0),
      eval_step=jax.jit(step_lib.make_eval_step(s.model), in_shardings=(param_sh, eval_sh)),
      state_shape=state_shape, state_sh=state_sh, batch_sh=batch_sh, eval_sh=eval_sh)


class _Meter:
  """Training-only wall time (after the compile step, without eval) and tokens/s."""

  def __init__(self, tokens_per_step: int):
    self.tps_unit = tokens_per_step
    self.t0 = time.time()
    self.compile_s = None
    self.last_t, self.last_step = None, None
    self.train_s, self.timed_steps = 0.0, 0

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

  def overall(self) -> float:
    return self.timed_steps * self.tps_unit / self.train_s if self.train_s > 0 else float("nan")


def train(cfg: TrainConfig, out_dir: str | pathlib.Path, resume: bool = False,
          s: Optional[Setup] = None) -> dict:
  """Trains (or resumes) one run into ``out_dir``; returns the summary (also summary.json).

  Raises ConfigError / DataError on bad input (before compiling), SkipLimit after
  ``run.max_consecutive_skips`` non-finite steps in a row and Interrupted on SIGTERM/SIGINT
  (both after checkpointing the current state).
  """
  out = pathlib.Path(out_dir)
  s = s or setup(cfg)
  r, d = cfg.run, cfg.data
  is_main = jax.process_index() == 0
  ckpt_dir = out / "checkpoints"
  if not resume and ckpt_dir.exists() and any(ckpt_dir.iterdir()):
    raise ConfigError(f"{str(out)!r} already holds checkpoints; pass --resume to continue that "
                      "run or choose another --out")
  out.mkdir(parents=True, exist_ok=True)
  if is_main:
    dump_config(cfg, out / "config.yaml")
  fns = compile_fns(s)

  # Data: training batches in the optimizer's layout, a fixed held-out set on the devices.
  pi, pc = jax.process_index(), jax.process_count()
  groups, rolling = s.spec.num_groups, s.spec.layout == "rolling_b"
  it = data.Batches(s.train_w, d.batch_size, d.microbatches, groups=groups, rolling_b=rolling,
                    seed=r.seed, process_index=pi, process_count=pc)
  batch_shape = (d.microbatches * groups, d.batch_size // d.microbatches, d.seq_len + 1)
  evals = [_put(fns.eval_sh, b, (d.batch_size, d.seq_len + 1))
           for b in data.eval_batches(s.val_w, d.batch_size, r.eval_batches, pi, pc)]

  def evaluate(params) -> float:
    if not evals:
      return float("nan")
    return float(np.mean(jax.device_get([fns.eval_step(params, b) for b in evals])))

  # State: restored from the latest complete checkpoint, or fresh.
  ckpt = checkpoint.Checkpointer(ckpt_dir, r.keep_checkpoints, r.async_checkpoint)
  start = ckpt.latest_step() if resume else None
  if start is not None:
    state, dstate = ckpt.restore(start, checkpoint.abstract(fns.state_shape, fns.state_sh))
    it.restore(dstate)
    print(f"resumed from {ckpt_dir}/{start}", file=sys.stderr)
  else:
    if resume:
      print(f"no checkpoint in {ckpt_dir}; starting from scratch", file=sys.stderr)
    if s.model.init_from:  # a fresh run from given parameters, fresh optimizer state
      state = fns.init_with(convert.init_params(s.model.init_from, s.model.cfg,
                                                fns.state_sh.params))
    else:
      state = fns.init()
  step0 = int(jax.device_get(state.step))
  log = metrics.MetricsLog(out, resume_step=step0 if start is not None else None,
                           tensorboard=r.tensorboard, enabled=is_main, wandb=r.wandb,
                           config=cfg.to_dict())
  prof = metrics.Profile(out / "profile", r.profile)

  tokens_per_step = groups * d.batch_size * d.seq_len  # distinct tokens (rolling-B: new A)
  flops_per_token = models.flops_per_token(s.model.cfg, d.seq_len) * bridge.passes_per_step(s.spec)
  peak = peak_flops(jax.devices()[0], r.peak_flops)
  peak_all = peak * jax.device_count() if peak else None
  bar = None
  if r.progress and is_main:
    from tqdm import tqdm
    bar = tqdm(total=r.steps, initial=step0, desc="train", unit="step", dynamic_ncols=True,
               mininterval=0.5)

  meter = _Meter(tokens_per_step)
  pending: list[dict] = []  # device metrics of the steps since the last log
  prev_consec = None  # previous step's consecutive-skip counter (read one step behind)
  last_losses: list[float] = []
  last_row: dict = {}
  eval_loss = float("nan")
  stopped = interrupted = None
  done = step0
  with _Signals() as sig:
    for t in range(step0, r.steps):
      batch = {k: _put(fns.batch_sh, v, batch_shape) for k, v in it.next().items()}
      prof.before(t)
      state, m = fns.train_step(state, batch)
      done = t + 1
      prof.after(done, m["loss"])
      if meter.compile_s is None:
        jax.block_until_ready(m["loss"])
        meter.first_step_done(done)
      pending.append(m)
      if prev_consec is not None and int(prev_consec) >= r.max_consecutive_skips:
        stopped = done
      prev_consec = m["consec"]
      interrupted = sig.caught
      halt = stopped is not None or interrupted is not None
      is_eval = (r.eval_every and done % r.eval_every == 0) or done == r.steps
      if done % r.log_every == 0 or is_eval or halt:
        fetched = jax.device_get(pending)
        pending = []
        tps = meter.interval(done)
        last_losses = [float(x["loss"]) for x in fetched]
        row = {"step": done, **{k: float(v) for k, v in fetched[-1].items()},
               "tokens": done * tokens_per_step, "tokens_per_s": tps}
        row["skipped"], row["consec"] = int(row["skipped"]), int(row["consec"])
        if peak_all and tps == tps:
          row["mfu"] = tps * flops_per_token / peak_all
        if is_eval:
          row["eval_loss"] = eval_loss = evaluate(state.params)
          meter.pause_done()
        log.write(row)
        log.flush()
        last_row = row
        if bar is not None:
          bar.set_postfix(loss=f"{row['loss']:.3f}",
                          **({"eval": f"{eval_loss:.3f}"} if is_eval else {}))
        if row["consec"] >= r.max_consecutive_skips:
          stopped = done
      if bar is not None:
        bar.update(1)
      if stopped is not None or interrupted is not None:
        break
      if r.checkpoint_every and done % r.checkpoint_every == 0 and done != r.steps:
        ckpt.save(done, state, it.state())
  if bar is not None:
    bar.close()
  prof.close(state.step)
  if done == step0:  # nothing left to train (resuming a finished run)
    eval_loss = evaluate(state.params)
  ckpt.save(done, state, it.state())  # always: the final / last good / interrupted state
  ckpt.close()
  log.close()

  tps_run = meter.overall()
  summary = {
      "steps": done, "tokens": done * tokens_per_step,
      "final_train_loss": float(np.mean(last_losses)) if last_losses else None,
      "final_eval_loss": eval_loss, "wall_time_s": time.time() - meter.t0,
      "compile_s": meter.compile_s, "tokens_per_s": tps_run,
      "params": models.count_params(s.model.cfg),
      "mfu": tps_run * flops_per_token / peak_all if peak_all else None,
      "skipped_steps": last_row.get("skipped", 0), "optimizer": cfg.optimizer["name"],
      "layout": s.spec.layout, "sweeps_per_step": bridge.passes_per_step(s.spec),
      "devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind,
      "resumed_from": start, "stopped_early": stopped is not None or interrupted is not None,
      "interrupted_by": interrupted,
  }
  if is_main:
    metrics.write_summary(out, summary)
    if r.plot:
      metrics.plot_curves({cfg.optimizer["name"]: metrics.read_metrics(out / "metrics.jsonl")},
                          out / "loss.png", title=f"{s.model.cfg.d_model}d x "
                          f"{s.model.cfg.n_layers}L, {cfg.optimizer['name']}")
  if interrupted is not None:
    raise Interrupted(f"{interrupted} at step {done}: the state is checkpointed in "
                      f"{ckpt_dir}/{done}; continue with --resume")
  if stopped is not None:
    raise SkipLimit(f"stopped at step {done}: {r.max_consecutive_skips} consecutive steps had "
                    "a non-finite loss or update (parameters were left untouched); the last "
                    f"good state is checkpointed in {ckpt_dir}/{done}")
  return summary
