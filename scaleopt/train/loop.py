"""The training loop: set up, train, evaluate, checkpoint, log; resume exactly.

``train(cfg, out_dir, resume)`` returns the summary dict; reading it top to bottom is reading a
run: ``setup`` builds the data, model, optimizer and mesh from the config, ``compile_fns`` the
shardings and jitted functions, then the state is restored (or made fresh) and ``run_cells``
trains. ``run_cells`` is the one host loop, for an ordinary run (one cell) and for the study's
vmapped cells (a cell axis, ``scaleopt.study.vmapped``). It only dispatches: a background thread
makes the device batches ahead (``prefetch.Prefetch``; it copies nothing while a step program
runs for the first time or the held-out set is evaluated), each step's consecutive-skip counter
is read two steps later (two steps stay in flight), and metrics are fetched every ``log_every``
steps.

Around the loop: ``preflight`` (the output folder, dry runs), ``evaluation`` (the held-out set),
``checkpoint`` (saves, restores, the state format), ``phased`` (host-picked step programs),
``progress`` (metrics rows and terminal lines), ``summary`` (summary.json, how a run stopped)
and ``flops`` (MFU).
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import sys
from typing import Any, Callable, Optional

import jax
import numpy as np
import optax

from scaleopt import models, optim
from scaleopt.train import (bridge, checkpoint, config as config_lib, convert, data,
                            determinism, evaluation, faults, flops, identity, mesh as mesh_lib,
                            metrics, phased as phased_lib, preflight, prefetch, progress,
                            provenance, step as step_lib, storage, summary as summary_lib)
from scaleopt.train.config import ConfigError, TrainConfig


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
  """Builds data, model, optimizer (once: ``bridge.run_optimizer``; the lr metric reads its
  schedule) and mesh; every user error surfaces here. A ``model.init_from`` source's
  architecture is read here where the config leaves it open."""
  determinism.prepare(cfg.run.deterministic)  # before anything starts JAX's backend
  mesh_lib.maybe_initialize_distributed(cfg.mesh.distributed)
  metrics.check_outputs(cfg.run.wandb, cfg.run.profile, cfg.run.tensorboard)
  cfg = bridge.with_source_architecture(cfg)
  model = bridge.make_model(determinism.model_spec(cfg))  # attention by XLA in its mode
  if model.init_from:
    try:
      convert.check_matches(convert.open_source(model.init_from), model.cfg)
    except convert.SourceError as e:
      raise ConfigError(str(e)) from None
  tx, spec, schedule = bridge.run_optimizer(cfg)
  data_cfg = cfg.data
  train_w, vocab = data.open_split(data_cfg.source, data_cfg.path, "train", data_cfg.seq_len)
  val_w, _ = data.open_split(data_cfg.source, data_cfg.path, "val", data_cfg.seq_len)
  if vocab > model.cfg.vocab_size:
    raise ConfigError(f"the data's vocabulary ({vocab} tokens) is larger than "
                      f"model.vocab_size={model.cfg.vocab_size}; set model.vocab_size >= {vocab}")
  problem = models.kernel_problem(model.cfg)
  if problem is not None:
    raise ConfigError(problem)
  mesh = mesh_lib.make_mesh(cfg.mesh)
  mesh_lib.check_batch(mesh, data_cfg.batch_size, data_cfg.microbatches)
  model = model.with_mesh(mesh)
  if spec.layout == "loo" and data_cfg.microbatches < 2:
    raise ConfigError("optimizer layout 'loo' needs data.microbatches >= 2")
  if (spec.layout in ("ab", "symmetric") and spec.var_of is not None
      and data_cfg.microbatches < 2):
    raise ConfigError(f"optimizer layout {spec.layout!r} with a variance correction needs "
                      "data.microbatches >= 2 per group")
  return Setup(cfg, model, tx, spec, schedule, mesh, train_w, val_w, vocab)


@dataclasses.dataclass
class Compiled:
  """The jitted functions and the shardings they were compiled for."""
  init: Any  # () -> TrainState
  init_with: Any  # params -> TrainState (step 0, optimizer state for these parameters)
  train_step: Any  # (state, batch) -> (state, metrics); state donated
  eval_step: Any  # (params, tokens [m, b, T+1]) -> per-window CE [m, b], replicated
  state_shape: Any  # TrainState of ShapeDtypeStruct
  state_sh: Any
  batch_sh: Any  # of training batches and of the evaluation set's microbatches
  phased: Any = None  # phased.PhasedStep where the host may pick the step's branches, else None


def batch_shape(parts: Setup) -> tuple:
  """[microbatches x groups, sequences per microbatch, seq_len + 1] of a training batch."""
  data_cfg = parts.cfg.data
  return (data_cfg.microbatches * parts.spec.num_groups,
          data_cfg.batch_size // data_cfg.microbatches, data_cfg.seq_len + 1)


def abstract_batch(parts: Setup, sharding=None) -> dict:
  """The training batch's ShapeDtypeStructs (``b_tokens`` for the ``rolling_b`` layout)."""
  tokens = jax.ShapeDtypeStruct(batch_shape(parts), np.int32, sharding=sharding)
  return {"tokens": tokens, **({"b_tokens": tokens} if parts.spec.layout == "rolling_b" else {})}


def host_phases(setting: str) -> bool:
  """``run.host_phases``: ``auto`` is on where device branches wait for the host (GPUs)."""
  return setting == "on" or (setting == "auto" and jax.default_backend() == "gpu")


def check_update(cfg: TrainConfig) -> bool:
  """Whether the skip guard also checks the update's norm (``run.update_guard``): always, or
  for optimizers not registered with finite updates (``optim.finite_updates``)."""
  return cfg.run.update_guard == "always" or not optim.finite_updates(cfg.optimizer)


def compile_fns(parts: Setup) -> Compiled:
  """Shardings for state and batches, and the jitted init / train / eval functions."""
  mesh, seed, tx = parts.mesh, parts.cfg.run.seed, parts.tx
  init_fn = lambda: step_lib.init_state(parts.model, tx, seed)
  state_shape = jax.eval_shape(init_fn)
  param_sh = mesh_lib.param_shardings(mesh, state_shape.params,
                                      models.partition_rules(parts.model.cfg))
  shard_opt = parts.cfg.mesh.shard_optimizer and mesh.shape["data"] > 1
  opt_sh = mesh_lib.optimizer_shardings(mesh, state_shape.params, param_sh, shard_opt)
  state_sh = mesh_lib.state_shardings(mesh, state_shape, state_shape.params, opt_sh)
  state_sh = state_sh._replace(params=param_sh)
  state_sh = state_sh._replace(opt_state=mesh_lib.in_memory_of(  # offloaded state: host memory
      tx.init, (state_shape.params,), state_sh.opt_state))
  batch_sh = mesh_lib.batch_sharding(mesh)
  step_fn = step_lib.make_train_step(parts.model, tx, parts.spec, parts.schedule,
                                     parts.cfg.run.telemetry_every, param_sh=param_sh,
                                     update_sh=opt_sh if shard_opt else None,
                                     check_update=check_update(parts.cfg))
  step_kw = dict(in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
                 donate_argnums=0)
  phased = None
  if host_phases(parts.cfg.run.host_phases):
    phased = phased_lib.PhasedStep(step_fn, step_kw, state_shape, abstract_batch(parts))
  return Compiled(
      init=jax.jit(init_fn, out_shardings=state_sh),
      init_with=jax.jit(lambda p: init_fn()._replace(params=p, opt_state=tx.init(p)),
                        in_shardings=(param_sh,), out_shardings=state_sh),
      train_step=jax.jit(step_fn, **step_kw),
      eval_step=jax.jit(step_lib.make_eval_step(parts.model), in_shardings=(param_sh, batch_sh),
                        out_shardings=mesh_lib.replicated(mesh)),
      state_shape=state_shape, state_sh=state_sh, batch_sh=batch_sh,
      phased=phased)


def dry_run(cfg: TrainConfig, out_dir: str | pathlib.Path, resume: bool = False) -> str:
  """Every check a real run makes before its first step, and the traced (not compiled) step;
  writes nothing. Returns a one-line description."""
  cfg = bridge.with_source_architecture(cfg)
  changes = preflight.check_out_dir(cfg, out_dir, resume)
  parts = setup(cfg)
  preflight.data_record(cfg, out_dir, resume)
  compiled = compile_fns(parts)
  jax.eval_shape(compiled.train_step, compiled.state_shape, abstract_batch(parts))
  eval_set = data.eval_set(parts.val_w, cfg.run.eval_tokens)
  if eval_set is not None:
    size = evaluation.eval_microbatch(cfg)
    jax.eval_shape(compiled.eval_step, compiled.state_shape.params, jax.ShapeDtypeStruct(
        (-(-eval_set.n // size), size, cfg.data.seq_len + 1), np.int32))
  extra = f"; resumable changes: {', '.join(changes)}" if changes else ""
  return (f"config ok: {models.count_params(parts.model.cfg):,} parameters, optimizer "
          f"{cfg.optimizer.name} ({parts.spec.layout}), {parts.train_w.n:,} training windows, "
          f"{eval_set.n if eval_set else 0} eval windows, mesh {dict(parts.mesh.shape)}{extra}")


def train(cfg: TrainConfig, out_dir: str | pathlib.Path, resume: bool = False,
          s: Optional[Setup] = None) -> dict:
  """Trains (or resumes) one run into ``out_dir``; returns the summary (also summary.json).
  ``s``: the run's ``setup(cfg)`` when the caller has made it already.

  Raises ConfigError / DataError on bad input (before compiling or writing anything; on
  resume the requested config is compared with the run's first), CheckpointError when no
  intact checkpoint can be read or one cannot be written, SkipLimit after
  ``run.max_consecutive_skips`` non-finite steps in a row and Interrupted on SIGTERM/SIGINT.
  """
  # Join a multi-process run first: its preemption notifier then owns SIGTERM
  # (``faults.Signals``). Signals are caught from the start: one during set-up stops the run
  # after its first step.
  mesh_lib.maybe_initialize_distributed(cfg.mesh.distributed)
  cfg = bridge.with_source_architecture(cfg)  # what the run records and resumes with
  with faults.Signals() as sig:
    try:
      return _train(cfg, storage.path(out_dir), resume, s, sig)
    except Exception as e:  # noqa: BLE001 -- only out-of-memory is translated, the rest re-raises
      oom = faults.out_of_memory(e, cfg)
      if oom is None:
        raise
    raise oom  # outside the handler: no chained traceback, the step's arrays are freed


@dataclasses.dataclass
class Cells:
  """What the host loop drives: ``n`` cells trained by one step program. ``n = 1`` is the
  ordinary run (its metrics have no cell axis); the study's vmapped cells are ``n > 1`` (every
  metric has a leading cell axis, ``scaleopt.study.vmapped``)."""
  n: int
  step: Any  # phased.make_stepper's step(state, batch) -> (state, metrics); .confirm, .fresh
  # (the last step was a program's first run), .next_fresh (the next one will be)
  feed: Any  # prefetch.Prefetch: next(), state() (the iterator position(s) handed out), quiet()
  logs: list  # one metrics.MetricsLog per cell
  evaluate: Callable  # state -> [n] mean held-out CE (NaN without a held-out set)
  save: Callable  # (state, step, only_if_sound) -> whether it was saved
  stop: Callable  # step -> why to stop after it (a signal name, "deadline") or None
  prof: Any = None  # metrics.Profile (None: no profiling)
  labels: Optional[list] = None  # per cell, the prefix of its progress lines (n > 1)


@dataclasses.dataclass
class Outcome:
  """What the host loop hands back, per cell where it differs."""
  done: int
  diverged: np.ndarray  # [n] bool: the cell reached run.max_consecutive_skips
  eval_loss: np.ndarray  # [n] at the last evaluation
  stopped: Optional[int] = None  # step of a non-finite stop (every cell diverged)
  interrupted: Optional[str] = None  # signal name or "deadline"
  stop_saved: bool = True  # the final state was checkpointed
  last_losses: Optional[np.ndarray] = None  # [steps since the previous log, n]
  last_rows: list = dataclasses.field(default_factory=list)  # per cell, the last metrics row
  phase_shifts: Optional[int] = None  # host-picked steps off the optimizer's count


def _train(cfg: TrainConfig, out: pathlib.Path, resume: bool, parts: Optional[Setup],
           sig: faults.Signals) -> dict:
  """The run: checks, setup, compile, restore or init, the host loop, the summary."""
  changes = preflight.check_out_dir(cfg, out, resume)
  parts = parts or setup(cfg)
  record = preflight.data_record(cfg, out, resume)
  run, data_cfg = cfg.run, cfg.data
  is_main = jax.process_index() == 0
  compiled = compile_fns(parts)

  # Data: training batches in the optimizer's layout, a fixed held-out set on the devices.
  batches = data.Batches(parts.train_w, data_cfg.batch_size, data_cfg.microbatches,
                         groups=parts.spec.num_groups, rolling_b=parts.spec.layout == "rolling_b",
                         seed=config_lib.data_seed(cfg), process_index=jax.process_index(),
                         process_count=jax.process_count())
  eval_set = data.eval_set(parts.val_w, run.eval_tokens)
  evaluate = evaluation.make_evaluate(cfg, compiled, eval_set, is_main)

  health = jax.jit(lambda st: (st.consec, optax.tree.norm(st.params)))
  start, state, ckpt = _restore_or_init(cfg, parts, compiled, batches, out, resume, health)
  step0 = int(jax.device_get(state.step))
  if is_main and start is None:
    identity.write(out, record)
  if is_main and changes:
    config_lib.record_changes(out, changes, step0)
    print("resuming with changed " + ", ".join(f"{k} ({a!r} -> {b!r})" for k, (a, b) in
                                               changes.items()), file=sys.stderr)
  log = metrics.MetricsLog(out, resume_step=step0 if start is not None else None,
                           tensorboard=run.tensorboard, enabled=is_main, wandb=run.wandb,
                           config=cfg.to_dict())
  meter = metrics.Meter(parts.spec.num_groups * data_cfg.batch_size * data_cfg.seq_len)
  if start is not None and is_main and log.path.exists():  # the run's earlier pieces
    meter.resume(metrics.read_metrics(log.path))
  shape, feed = batch_shape(parts), None

  def to_devices(batch: dict) -> dict:
    return {k: mesh_lib.put_global(compiled.batch_sh, v, shape) for k, v in batch.items()}

  def save(st, step: int, only_if_sound: bool = False) -> bool:
    consec, norm = jax.device_get(health(st))
    if only_if_sound and ckpt.exploded(float(norm)):
      return False
    ckpt.save(step, st, checkpoint.with_state_format(cfg, feed.state()), consec=int(consec),
              param_norm=float(norm))
    return True

  try:  # host-picked programs compile here (timed as compile)
    step = phased_lib.make_stepper(compiled, state, step0, run.steps,
                                   abstract_batch(parts, compiled.batch_sh))
    feed = prefetch.Prefetch(batches, to_devices, max(0, run.steps - step0))
    cells = Cells(1, step, feed, [log], lambda st: np.array([evaluate(
        optim.eval_params(st.opt_state, st.params))]), save, sig.stop,
        metrics.Profile(out / "profile", run.profile))
    res, state = run_cells(cfg, parts, cells, state, step0, meter, is_main)
  finally:
    if feed is not None:
      feed.close()
    log.close()
    ckpt.close()
  summary = {**summary_lib.summarize(cfg, parts, res, meter, start),
             **evaluation.eval_identity(eval_set), **provenance.run_entry(cfg, record, state)}
  if is_main:
    metrics.write_summary(out, summary)
    if run.plot:
      metrics.plot_curves({cfg.optimizer.name: metrics.read_metrics(out / "metrics.jsonl")},
                          out / "loss.png", title=f"{parts.model.cfg.d_model}d x "
                          f"{parts.model.cfg.n_layers}L, {cfg.optimizer.name}")
  summary_lib.raise_for_stop(res, ckpt, run.max_consecutive_skips)
  return summary


def _restore_or_init(cfg: TrainConfig, parts: Setup, compiled: Compiled, batches: data.Batches,
                     out: pathlib.Path, resume: bool, health):
  """(resumed step or None, state, Checkpointer): the newest intact checkpoint (newer broken
  ones are moved aside; ``batches`` restored to its position) or a fresh state (from
  ``model.init_from``'s parameters where set); starts the run's outputs."""
  run, ckpt_dir = cfg.run, out / "checkpoints"
  found = None
  if resume and ckpt_dir.is_dir():
    ckpt = checkpoint.Checkpointer(ckpt_dir, run.keep_checkpoints, run.async_checkpoint)
    found = ckpt.restore_latest(checkpoint.abstract(compiled.state_shape, compiled.state_sh))
  preflight.start_outputs(cfg, out, found is not None)
  if found is not None:
    start, state, data_state = found
    try:
      data_state = checkpoint.check_state_format(cfg, data_state, f"{ckpt_dir}/{start}")
    except ConfigError:
      ckpt.close()
      raise
    batches.restore(data_state)
    print(f"resumed from {ckpt_dir}/{start}", file=sys.stderr)
    return start, state, ckpt
  if resume:
    print(f"note: --resume: {ckpt_dir} holds no checkpoint; starting a new run at step 0",
          file=sys.stderr)
  if parts.model.init_from:  # a fresh run from given parameters, fresh optimizer state
    state = compiled.init_with(convert.init_params(parts.model.init_from, parts.model.cfg,
                                                   compiled.state_sh.params))
  else:
    state = compiled.init()
  ckpt = checkpoint.Checkpointer(ckpt_dir, run.keep_checkpoints, run.async_checkpoint,
                                 init_norm=float(health(state)[1]))
  return None, state, ckpt


def run_cells(cfg: TrainConfig, parts: Setup, cells: Cells, state, step0: int,
              meter: metrics.Meter, is_main: bool = True) -> tuple[Outcome, Any]:
  """The host loop from ``step0`` to ``run.steps`` or a stop: ``(outcome, final state)``.

  Each step runs ``cells.step`` on ``cells.feed``'s next batch; the consecutive-skip counters
  are read two steps behind (reading the newest would wait for the step just launched), the
  metrics every ``run.log_every`` steps, the held-out loss every ``run.eval_every``. A cell
  whose counter reaches ``run.max_consecutive_skips`` is marked diverged (its skipped steps
  leave its parameters untouched); the run stops when every cell has, or when ``cells.stop``
  gives a reason. The final state is always checkpointed, after a non-finite stop only if
  ``cells.save`` finds it sound."""
  run, n = cfg.run, cells.n
  flops_per_token, peak_all = flops.run_flops(parts.model.cfg, cfg.data.seq_len,
                                              parts.spec.passes_per_step, run.peak_flops)
  prof = cells.prof or metrics.Profile(None, None)
  bar = progress.bar(run.steps, step0) if run.progress and is_main and n == 1 else None
  res = Outcome(done=step0, diverged=np.zeros(n, bool), eval_loss=np.full(n, np.nan))
  pending: list[dict] = []  # device metrics of the steps since the last log
  behind: list = []  # the skip counters of the last two steps, each read two steps later
  for t in range(step0, run.steps):
    batch = cells.feed.next()
    prof.before(t)
    first_run = cells.step.next_fresh  # no batch copies while a program first runs
    with cells.feed.quiet() if first_run else contextlib.nullcontext():
      state, step_metrics = cells.step(state, batch)
      if first_run:
        jax.block_until_ready(step_metrics["loss"])
    res.done = done = t + 1
    prof.after(done, step_metrics["loss"])
    if meter.compile_s is None:  # the first step ran as a first run: its result is in
      meter.first_step_done(done)
    elif cells.step.fresh:  # a host-picked program's first run
      meter.restart(done)
    pending.append(step_metrics)
    if len(behind) == 2:
      consec = np.reshape(jax.device_get(behind.pop(0)), (n,))
      cells.step.confirm(bool(consec[0] > 0))  # host-picked programs: one cell only
      res.diverged |= consec >= run.max_consecutive_skips
    behind.append(step_metrics["consec"])
    res.interrupted = cells.stop(done)
    is_eval = run.eval_tokens > 0 and (
        (run.eval_every and done % run.eval_every == 0) or done == run.steps)
    if (done % run.log_every == 0 or is_eval or res.diverged.all()
        or res.interrupted is not None):
      fetched = jax.device_get(pending)
      pending = []
      res.last_losses = progress.losses(fetched, n)
      tps = meter.interval(done)  # of all cells together
      rows = progress.rows(done, fetched, n, meter, tps)
      if is_eval:
        with cells.feed.quiet():
          res.eval_loss = cells.evaluate(state)
        meter.pause_done()
      mfu = tps * flops_per_token / peak_all if peak_all and tps == tps else None
      progress.report(rows, cells.logs, res.eval_loss if is_eval else None, mfu, run.steps,
                      bar, cells.labels, is_main)
      res.last_rows = rows
      res.diverged |= np.array([row["consec"] >= run.max_consecutive_skips for row in rows])
    if res.diverged.all():
      res.stopped = done
    if bar is not None:
      bar.update(1)
    if res.stopped is not None or res.interrupted is not None:
      break
    if run.checkpoint_every and done % run.checkpoint_every == 0 and done != run.steps:
      cells.save(state, done)
  if bar is not None:
    bar.close()
  if isinstance(cells.step, phased_lib.Dispatcher):
    res.phase_shifts = cells.step.shifts
  prof.close(state.step)
  if res.done == step0 and run.eval_tokens > 0:  # nothing left to train (a finished run)
    res.eval_loss = cells.evaluate(state)
  # Always the final / interrupted state; after a non-finite stop only if it did not blow up
  # (a stopped state is never healthy, so the newest healthy checkpoint is kept either way).
  res.stop_saved = cells.save(state, res.done, only_if_sound=res.stopped is not None)
  return res, state
