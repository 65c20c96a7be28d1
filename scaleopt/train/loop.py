"""The training loop: set up, train, evaluate, checkpoint, log; resume exactly.

``train(cfg, out_dir, resume)`` returns the summary dict. ``run_cells`` is the one host loop,
for an ordinary run (one cell) and for the study's vmapped cells (a cell axis,
``scaleopt.study.vmapped``). It only dispatches: a background thread makes the device batches
ahead (``Prefetch``), each step's consecutive-skip counter is read two steps later (two steps
stay in flight), and metrics are fetched every ``log_every`` steps.
"""

from __future__ import annotations

import dataclasses
import pathlib
import queue
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Optional

import jax
import numpy as np
import optax

from scaleopt import models, optim
from scaleopt.train import (bridge, checkpoint, config as config_lib, convert, data, faults,
                            identity, mesh as mesh_lib, metrics, phased as phased_lib,
                            step as step_lib)
from scaleopt.train.config import ConfigError, TrainConfig, dump_config

# Dense bf16 peak FLOP/s per chip, matched against ``device_kind``.
_TPU_PEAK = {"v4": 275e12, "v5 lite": 197e12, "v5e": 197e12, "v5p": 459e12, "v6": 918e12}


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
  metrics.check_outputs(cfg.run.wandb, cfg.run.profile, cfg.run.tensorboard)
  model = bridge.make_model(cfg.model)
  if model.init_from:
    try:
      convert.check_matches(convert.open_source(model.init_from), model.cfg)
    except convert.SourceError as e:
      raise ConfigError(str(e)) from None
  tx, spec, schedule = cfg.built
  d = cfg.data
  train_w, vocab = data.open_split(d.source, d.path, "train", d.seq_len)
  val_w, _ = data.open_split(d.source, d.path, "val", d.seq_len)
  if vocab > model.cfg.vocab_size:
    raise ConfigError(f"the data's vocabulary ({vocab} tokens) is larger than "
                      f"model.vocab_size={model.cfg.vocab_size}; set model.vocab_size >= {vocab}")
  problem = models.kernel_problem(model.cfg)
  if problem is not None:
    raise ConfigError(problem)
  mesh = mesh_lib.make_mesh(cfg.mesh)
  mesh_lib.check_batch(mesh, d.batch_size, d.microbatches)
  model = model.with_mesh(mesh)
  if spec.layout == "loo" and d.microbatches < 2:
    raise ConfigError("optimizer layout 'loo' needs data.microbatches >= 2")
  if spec.layout in ("ab", "symmetric") and spec.var_of is not None and d.microbatches < 2:
    raise ConfigError(f"optimizer layout {spec.layout!r} with a variance correction needs "
                      "data.microbatches >= 2 per group")
  return Setup(cfg, model, tx, spec, schedule, mesh, train_w, val_w, vocab)


def _put(sharding, local: np.ndarray, global_shape: tuple) -> jax.Array:
  return jax.make_array_from_process_local_data(sharding, local, global_shape)


class Prefetch:
  """Training batches on the devices, made ahead by a background thread (``it.next()`` and
  the host-to-device put; ``depth`` queued and one in hand), at most ``count`` of them.

  A train step whose program holds a ``lax.cond`` or ``while_loop`` (``run.host_phases:
  off``: Shampoo's root and statistics branches, Sophia's refresh, the collectors' refresh
  steps; Newton's root iterations on root steps either way) makes the GPU runtime read the
  predicate on the host, so dispatching it returns only once the previous step has run; the
  next batch's host work then no longer hides behind the step unless it runs beside it.
  ``state()`` is the iterator position after the batches handed out so far (what a
  checkpoint records); an error of the iterator is raised by the ``next()`` that reaches it."""

  def __init__(self, it: data.Batches, put, count: int, depth: int = 2):
    self._state = it.state()
    self._q: Any = queue.Queue(maxsize=depth)
    self._stop = threading.Event()

    def fill():
      for _ in range(count):
        try:
          item = (put(it.next()), it.state(), None)
        except BaseException as e:  # noqa: BLE001 -- handed to the consumer, in order
          item = (None, None, e)
        while not self._stop.is_set():
          try:
            self._q.put(item, timeout=0.1)
            break
          except queue.Full:
            continue
        if item[2] is not None or self._stop.is_set():
          return

    self._thread = threading.Thread(target=fill, name="scaleopt-batches", daemon=True)
    self._thread.start()

  def next(self) -> dict:
    while True:
      try:
        batch, state, err = self._q.get(timeout=1.0)
        break
      except queue.Empty:
        if not self._thread.is_alive() and self._q.empty():
          raise RuntimeError("the batch thread ended without a batch (more batches asked "
                             "for than it was made for)") from None
    if err is not None:
      raise err
    self._state = state
    return batch

  def state(self) -> dict:
    return self._state

  def close(self) -> None:
    self._stop.set()
    self._thread.join(timeout=10)


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


def batch_shape(s: Setup) -> tuple:
  """[microbatches x groups, sequences per microbatch, seq_len + 1] of a training batch."""
  d = s.cfg.data
  return (d.microbatches * s.spec.num_groups, d.batch_size // d.microbatches, d.seq_len + 1)


def abstract_batch(s: Setup, sharding=None) -> dict:
  """The training batch's ShapeDtypeStructs (``b_tokens`` for the ``rolling_b`` layout)."""
  tokens = jax.ShapeDtypeStruct(batch_shape(s), np.int32, sharding=sharding)
  return {"tokens": tokens, **({"b_tokens": tokens} if s.spec.layout == "rolling_b" else {})}


def host_phases(setting: str) -> bool:
  """``run.host_phases``: ``auto`` is on where device branches wait for the host (GPUs)."""
  return setting == "on" or (setting == "auto" and jax.default_backend() == "gpu")


def check_update(cfg: config_lib.TrainConfig) -> bool:
  """Whether the skip guard also checks the update's norm (``run.update_guard``): always, or
  for optimizers not registered with finite updates (``optim.finite_updates``)."""
  return cfg.run.update_guard == "always" or not optim.finite_updates(cfg.optimizer)


def compile_fns(s: Setup) -> Compiled:
  """Shardings for state and batches, and the jitted init / train / eval functions."""
  mesh, seed = s.mesh, s.cfg.run.seed
  init_fn = lambda: step_lib.init_state(s.model, s.tx, seed)
  state_shape = jax.eval_shape(init_fn)
  param_sh = mesh_lib.param_shardings(mesh, state_shape.params,
                                      models.partition_rules(s.model.cfg))
  shard_opt = s.cfg.mesh.shard_optimizer and mesh.shape["data"] > 1
  opt_sh = mesh_lib.optimizer_shardings(mesh, state_shape.params, param_sh, shard_opt)
  state_sh = mesh_lib.state_shardings(mesh, state_shape, state_shape.params, opt_sh)
  state_sh = state_sh._replace(params=param_sh)
  state_sh = state_sh._replace(opt_state=mesh_lib.in_memory_of(  # offloaded state: host memory
      s.tx.init, (state_shape.params,), state_sh.opt_state))
  batch_sh = mesh_lib.batch_sharding(mesh)
  step_fn = step_lib.make_train_step(s.model, s.tx, s.spec, s.schedule,
                                     s.cfg.run.telemetry_every, param_sh=param_sh,
                                     update_sh=opt_sh if shard_opt else None,
                                     check_update=check_update(s.cfg))
  step_kw = dict(in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None),
                 donate_argnums=0)
  phased = None
  if host_phases(s.cfg.run.host_phases):
    phased = phased_lib.PhasedStep(step_fn, step_kw, state_shape, abstract_batch(s))
  return Compiled(
      init=jax.jit(init_fn, out_shardings=state_sh),
      init_with=jax.jit(lambda p: init_fn()._replace(params=p, opt_state=s.tx.init(p)),
                        in_shardings=(param_sh,), out_shardings=state_sh),
      train_step=jax.jit(step_fn, **step_kw),
      eval_step=jax.jit(step_lib.make_eval_step(s.model), in_shardings=(param_sh, batch_sh),
                        out_shardings=mesh_lib.replicated(mesh)),
      state_shape=state_shape, state_sh=state_sh, batch_sh=batch_sh,
      phased=phased)


def eval_microbatch(cfg: TrainConfig) -> int:
  """Windows per evaluation microbatch: the training microbatch's sequences."""
  return cfg.data.batch_size // cfg.data.microbatches


def make_evaluate(cfg: TrainConfig, fns: Compiled, ev: Optional[data.EvalSet],
                  is_main: bool = True):
  """``evaluate(params) -> mean CE over the evaluation set`` (NaN without one): its windows
  put on the devices once, in microbatches of ``eval_microbatch(cfg)``."""
  if ev is None:
    return lambda params: float("nan")
  want = cfg.run.eval_tokens // cfg.data.seq_len
  if want > ev.n and is_main:
    print(f"note: run.eval_tokens={cfg.run.eval_tokens} asks for {want} windows of "
          f"seq_len={cfg.data.seq_len}; the held-out split holds {ev.n}, evaluating on all "
          "of them", file=sys.stderr)
  size = eval_microbatch(cfg)
  toks, _ = ev.microbatches(size, jax.process_index(), jax.process_count())
  toks = _put(fns.batch_sh, toks, (toks.shape[0], size, cfg.data.seq_len + 1))
  return lambda params: float(ev.mean(jax.device_get(fns.eval_step(params, toks))))


def eval_identity(ev: Optional[data.EvalSet]) -> dict:
  """The summary's record of the evaluation set (``eval_set``: its hash; runs compare only
  where it is equal)."""
  if ev is None:
    return {"eval_set": None, "eval_windows": 0}
  return {"eval_set": ev.ident, "eval_windows": ev.n}


def check_out_dir(cfg: TrainConfig, out_dir: str | pathlib.Path, resume: bool) -> dict:
  """Reads only: ``--out`` is (or can become) a writable directory, one that holds
  checkpoints is reused only with ``--resume``, and then only with a config that may resume
  (``config.check_resume``). Returns the resumable changes."""
  out = pathlib.Path(out_dir)
  probe = out
  while not probe.exists() and probe != probe.parent:
    probe = probe.parent
  if not probe.is_dir():
    raise ConfigError(f"--out {str(out)!r}: {str(probe)!r} is a file, not a directory")
  try:  # a real probe: os.access is wrong for root and for read-only mounts
    tempfile.TemporaryDirectory(dir=probe).cleanup()
  except OSError as e:
    raise ConfigError(f"--out {str(out)!r} is not writable ({e.strerror or e} in "
                      f"{str(probe)!r})") from None
  ckpt_dir = out / "checkpoints"
  has_ckpts = ckpt_dir.is_dir() and any(ckpt_dir.iterdir())
  if has_ckpts and not resume:
    raise ConfigError(f"{str(out)!r} already holds checkpoints; pass --resume to continue that "
                      "run or choose another --out")
  return config_lib.check_resume(cfg, out) if has_ckpts else {}


def data_record(cfg: TrainConfig, out: pathlib.Path, resume: bool) -> dict:
  """What the run trains on (``identity.describe``); resuming a run that has checkpoints, the
  record it wrote when it started must match (else a one-line ConfigError)."""
  record = identity.describe(cfg)
  ck = pathlib.Path(out) / "checkpoints"
  if resume and ck.is_dir() and any(ck.iterdir()):
    identity.check(pathlib.Path(out), record)
  return record


def dry_run(cfg: TrainConfig, out_dir: str | pathlib.Path, resume: bool = False) -> str:
  """Every check a real run makes before its first step, and the traced (not compiled) step;
  writes nothing. Returns a one-line description."""
  changes = check_out_dir(cfg, out_dir, resume)
  s = setup(cfg)
  data_record(cfg, out_dir, resume)
  fns = compile_fns(s)
  d = cfg.data
  jax.eval_shape(fns.train_step, fns.state_shape, abstract_batch(s))
  ev = data.eval_set(s.val_w, cfg.run.eval_tokens)
  if ev is not None:
    jax.eval_shape(fns.eval_step, fns.state_shape.params, jax.ShapeDtypeStruct(
        (-(-ev.n // eval_microbatch(cfg)), eval_microbatch(cfg), d.seq_len + 1), np.int32))
  extra = f"; resumable changes: {', '.join(changes)}" if changes else ""
  return (f"config ok: {models.count_params(s.model.cfg):,} parameters, optimizer "
          f"{cfg.optimizer.name} ({s.spec.layout}), {s.train_w.n:,} training windows, "
          f"{ev.n if ev else 0} eval windows, mesh {dict(s.mesh.shape)}{extra}")


def _start_outputs(cfg: TrainConfig, out: pathlib.Path, resuming: bool) -> None:
  """config.yaml is written when a run starts and never rewritten: a resumed run's changes go
  to config_history.jsonl (``config.record_changes``)."""
  out.mkdir(parents=True, exist_ok=True)
  if jax.process_index() != 0 or (resuming and (out / "config.yaml").exists()):
    return
  dump_config(cfg, out / "config.yaml")
  (out / config_lib.HISTORY).unlink(missing_ok=True)


def train(cfg: TrainConfig, out_dir: str | pathlib.Path, resume: bool = False,
          s: Optional[Setup] = None) -> dict:
  """Trains (or resumes) one run into ``out_dir``; returns the summary (also summary.json).

  Raises ConfigError / DataError on bad input (before compiling or writing anything; on
  resume the requested config is compared with the run's first), CheckpointError when no
  intact checkpoint can be read or one cannot be written, SkipLimit after
  ``run.max_consecutive_skips`` non-finite steps in a row and Interrupted on SIGTERM/SIGINT.
  """
  # Join a multi-process run first: its preemption notifier then owns SIGTERM
  # (``faults.Signals``). Signals are caught from the start: one during set-up stops the run
  # after its first step.
  mesh_lib.maybe_initialize_distributed(cfg.mesh.distributed)
  with faults.Signals() as sig:
    try:
      return _train(cfg, out_dir, resume, s, sig)
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
  step: Any  # _stepper's step(state, batch) -> (state, metrics), with .confirm and .fresh
  feed: Any  # next() -> the next device batch; state() -> the iterator position(s) handed out
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


def _train(cfg: TrainConfig, out_dir, resume: bool, s: Optional[Setup], sig) -> dict:
  out = pathlib.Path(out_dir)
  changes = check_out_dir(cfg, out, resume)
  s = s or setup(cfg)
  record = data_record(cfg, out, resume)
  r, d = cfg.run, cfg.data
  is_main = jax.process_index() == 0
  fns = compile_fns(s)

  # Data: training batches in the optimizer's layout, a fixed held-out set on the devices.
  pi, pc = jax.process_index(), jax.process_count()
  it = data.Batches(s.train_w, d.batch_size, d.microbatches, groups=s.spec.num_groups,
                    rolling_b=s.spec.layout == "rolling_b", seed=r.seed, process_index=pi,
                    process_count=pc)
  ev = data.eval_set(s.val_w, r.eval_tokens)
  evaluate = make_evaluate(cfg, fns, ev, is_main)

  health = jax.jit(lambda st: (st.consec, optax.tree.norm(st.params)))
  start, state, ckpt = _restore_or_init(cfg, s, fns, it, out, resume, health)
  step0 = int(jax.device_get(state.step))
  if is_main and start is None:
    identity.write(out, record)
  if is_main and changes:
    config_lib.record_changes(out, changes, step0)
    print("resuming with changed " + ", ".join(f"{k} ({a!r} -> {b!r})" for k, (a, b) in
                                               changes.items()), file=sys.stderr)

  def save(st, step: int, only_if_sound: bool = False) -> bool:
    consec, norm = jax.device_get(health(st))
    if only_if_sound and ckpt.exploded(float(norm)):
      return False
    ckpt.save(step, st, with_state_format(cfg, feed.state()), consec=int(consec),
              param_norm=float(norm))
    return True

  log = metrics.MetricsLog(out, resume_step=step0 if start is not None else None,
                           tensorboard=r.tensorboard, enabled=is_main, wandb=r.wandb,
                           config=cfg.to_dict())
  meter = metrics.Meter(s.spec.num_groups * d.batch_size * d.seq_len)
  if start is not None and is_main and log.path.exists():  # the run's earlier pieces
    meter.resume(metrics.read_metrics(log.path))
  shape, feed = batch_shape(s), None
  try:
    step = _stepper(s, fns, state, step0)  # compiles host-picked programs (timed as compile)
    feed = Prefetch(it, lambda b: {k: _put(fns.batch_sh, v, shape) for k, v in b.items()},
                    max(0, r.steps - step0))
    cells = Cells(1, step, feed, [log], lambda st: np.array([evaluate(
        optim.eval_params(st.opt_state, st.params))]), save, sig.stop,
        metrics.Profile(out / "profile", r.profile))
    res, _ = run_cells(cfg, s, cells, state, step0, meter, is_main)
  finally:
    if feed is not None:
      feed.close()
    log.close()
    ckpt.close()
  summary = {**summarize(cfg, s, res, meter, start), **eval_identity(ev)}
  if is_main:
    metrics.write_summary(out, summary)
    if r.plot:
      metrics.plot_curves({cfg.optimizer.name: metrics.read_metrics(out / "metrics.jsonl")},
                          out / "loss.png", title=f"{s.model.cfg.d_model}d x "
                          f"{s.model.cfg.n_layers}L, {cfg.optimizer.name}")
  _raise_for_stop(res, ckpt, r.max_consecutive_skips)
  return summary


FORMAT = "state_format"  # key of the checkpoint's data item that describes the state's layout


def state_format(cfg: TrainConfig) -> dict:
  """What a checkpoint's arrays mean beyond their shapes: ``shampoo_blocks``, the order of
  Shampoo's factor blocks (``major``: by the model's FSDP dims, ``models.fsdp_dims``;
  ``layers``: stacked layers first, ``optimizer.extra.block_major: layers``). A checkpoint
  without the record holds the ``layers`` order."""
  opt = cfg.optimizer
  if not opt.name.startswith("shampoo"):
    return {}
  return {"shampoo_blocks": "layers" if opt.hyperparameters().block_major == "layers"
          else "major"}


def with_state_format(cfg: TrainConfig, data_state: dict) -> dict:
  """The checkpoint's data item: the iterator position and ``state_format``."""
  return {**data_state, FORMAT: state_format(cfg)}


def check_state_format(cfg: TrainConfig, data_state: dict, where: str) -> dict:
  """The iterator position of a restored data item; ConfigError (one line naming ``where``)
  when its state format is not this run's."""
  data_state = dict(data_state)
  saved = data_state.pop(FORMAT, {}).get("shampoo_blocks", "layers")
  want = state_format(cfg).get("shampoo_blocks", "layers")
  if saved != want:
    fix = ("set optimizer.extra.block_major: layers" if saved == "layers"
           else "remove optimizer.extra.block_major")
    raise ConfigError(f"{where} holds Shampoo factors in the {saved!r} block order and this run "
                      f"orders them {want!r}; {fix} to resume it")
  return data_state


def _restore_or_init(cfg: TrainConfig, s: Setup, fns: Compiled, it: data.Batches,
                     out: pathlib.Path, resume: bool, health):
  """(resumed step or None, state, Checkpointer): the newest intact checkpoint (newer broken
  ones are moved aside) or a fresh state; starts the run's outputs."""
  r, ckpt_dir = cfg.run, out / "checkpoints"
  found = None
  if resume and ckpt_dir.is_dir():
    ckpt = checkpoint.Checkpointer(ckpt_dir, r.keep_checkpoints, r.async_checkpoint)
    found = ckpt.restore_latest(checkpoint.abstract(fns.state_shape, fns.state_sh))
  _start_outputs(cfg, out, found is not None)
  if found is not None:
    start, state, dstate = found
    try:
      dstate = check_state_format(cfg, dstate, f"{ckpt_dir}/{start}")
    except ConfigError:
      ckpt.close()
      raise
    it.restore(dstate)
    print(f"resumed from {ckpt_dir}/{start}", file=sys.stderr)
    return start, state, ckpt
  if resume:
    print(f"note: --resume: {ckpt_dir} holds no checkpoint; starting a new run at step 0",
          file=sys.stderr)
  if s.model.init_from:  # a fresh run from given parameters, fresh optimizer state
    state = fns.init_with(convert.init_params(s.model.init_from, s.model.cfg,
                                              fns.state_sh.params))
  else:
    state = fns.init()
  ckpt = checkpoint.Checkpointer(ckpt_dir, r.keep_checkpoints, r.async_checkpoint,
                                 init_norm=float(health(state)[1]))
  return None, state, ckpt


def _raise_for_stop(res: Outcome, ckpt: checkpoint.Checkpointer, max_skips: int) -> None:
  """Interrupted after a signal, SkipLimit after a non-finite stop (naming what was kept)."""
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


def _flops(cfg: TrainConfig, s: Setup) -> tuple[float, Optional[float]]:
  """(executed model FLOPs per distinct token, peak FLOP/s of all devices or None)."""
  per_token = (models.flops_per_token(s.model.cfg, cfg.data.seq_len)
               * bridge.passes_per_step(s.spec))
  peak = peak_flops(jax.devices()[0], cfg.run.peak_flops)
  return per_token, (peak * jax.device_count() if peak else None)


def summarize(cfg: TrainConfig, s: Setup, res: Outcome, meter: metrics.Meter, start,
              cell: int = 0) -> dict:
  """One cell's summary.json. Throughput and wall time are the cells' shares (``n`` cells
  train in one program: the meter counts the tokens of all of them); ``mfu`` is the devices'."""
  flops_per_token, peak_all = _flops(cfg, s)
  n = len(res.diverged)
  tps_all = meter.overall()
  losses = None if res.last_losses is None else res.last_losses[:, cell]
  return {
      "steps": res.done, "tokens": res.done * meter.tps_unit // n,
      "final_train_loss": float(np.mean(losses)) if losses is not None else None,
      "final_eval_loss": float(res.eval_loss[cell]),
      "wall_time_s": meter.wall() / n,
      "compile_s": meter.compile_s, "tokens_per_s": tps_all / n,
      "params": models.count_params(s.model.cfg),
      "mfu": tps_all * flops_per_token / peak_all if peak_all else None,
      "skipped_steps": res.last_rows[cell].get("skipped", 0) if res.last_rows else 0,
      "optimizer": cfg.optimizer.name,
      "layout": s.spec.layout, "sweeps_per_step": bridge.passes_per_step(s.spec),
      "optimizer_numerics": optim.resolved_numerics(cfg.optimizer),
      "devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind,
      "kernels": models.kernel_choices(s.model.cfg, s.mesh),
      "resumed_from": start,
      "stopped_early": bool(res.diverged[cell]) or res.interrupted is not None,
      "interrupted_by": res.interrupted, "phase_shifts": res.phase_shifts,
  }


def _stepper(s: Setup, fns: Compiled, state, step0: int):
  """``step(state, batch) -> (state, metrics)`` with ``step.confirm(skipped)``, called with
  each step's skip flag in order: the one-program step, or (``fns.phased``) the program the
  host's counters pick, those of the coming steps compiled now."""
  if fns.phased is None or not fns.phased.schedules:
    return phased_lib.OneProgram(fns.train_step)
  count0 = step0 - int(jax.device_get(state.skipped))  # the optimizer's applied updates
  fns.phased.compile(fns.phased.keys_ahead(step0, count0, s.cfg.run.steps),
                     checkpoint.abstract(fns.state_shape, fns.state_sh),
                     abstract_batch(s, fns.batch_sh))
  need = fns.phased.side_by_side_bytes()
  limit = faults.pool_bytes()
  fits = not (limit and need > 0.97 * limit)
  if jax.process_count() > 1:  # every process runs the same programs
    from jax.experimental import multihost_utils
    fits = bool(np.all(multihost_utils.process_allgather(np.array(fits))))
  if not fits:
    if jax.process_index() == 0:
      print(f"run.host_phases: the {fns.phased.programs} step programs need "
            f"{need / 2**30:.1f} GiB per device side by side, more than a device's memory "
            f"pool holds; running one program with device branches", file=sys.stderr)
    return phased_lib.OneProgram(fns.train_step)
  return phased_lib.Dispatcher(fns.phased, step0, count0)


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


def _per_cell(m: dict, n: int) -> list[dict]:
  """A step's host metrics (scalars, each with a leading cell axis or, for the ordinary run,
  none) as one dict of scalars per cell."""
  flat = {k: np.reshape(v, (n,)) for k, v in m.items()}
  return [{k: v[i] for k, v in flat.items()} for i in range(n)]


def run_cells(cfg: TrainConfig, s: Setup, cells: Cells, state, step0: int,
              meter: metrics.Meter, is_main: bool = True) -> tuple[Outcome, Any]:
  """The host loop from ``step0`` to ``run.steps`` or a stop: ``(outcome, final state)``.

  Each step runs ``cells.step`` on ``cells.feed``'s next batch; the consecutive-skip counters
  are read two steps behind (reading the newest would wait for the step just launched), the
  metrics every ``run.log_every`` steps, the held-out loss every ``run.eval_every``. A cell
  whose counter reaches ``run.max_consecutive_skips`` is marked diverged (its skipped steps
  leave its parameters untouched); the run stops when every cell has, or when ``cells.stop``
  gives a reason. The final state is always checkpointed, after a non-finite stop only if
  ``cells.save`` finds it sound."""
  r, n = cfg.run, cells.n
  flops_per_token, peak_all = _flops(cfg, s)
  prof = cells.prof or metrics.Profile(None, None)
  bar = None
  if r.progress and is_main and n == 1:
    from tqdm import tqdm
    bar = tqdm(total=r.steps, initial=step0, desc="train", unit="step", dynamic_ncols=True,
               mininterval=0.5)
  res = Outcome(done=step0, diverged=np.zeros(n, bool), eval_loss=np.full(n, np.nan))
  pending: list[dict] = []  # device metrics of the steps since the last log
  behind: list = []  # the skip counters of the last two steps, each read two steps later
  for t in range(step0, r.steps):
    batch = cells.feed.next()
    prof.before(t)
    state, m = cells.step(state, batch)
    res.done = done = t + 1
    prof.after(done, m["loss"])
    if meter.compile_s is None:
      jax.block_until_ready(m["loss"])
      meter.first_step_done(done)
    elif cells.step.fresh:  # a host-picked program's first run
      jax.block_until_ready(m["loss"])
      meter.restart(done)
    pending.append(m)
    if len(behind) == 2:
      consec = np.reshape(jax.device_get(behind.pop(0)), (n,))
      cells.step.confirm(bool(consec[0] > 0))  # host-picked programs: one cell only
      res.diverged |= consec >= r.max_consecutive_skips
    behind.append(m["consec"])
    res.interrupted = cells.stop(done)
    is_eval = (r.eval_every and done % r.eval_every == 0) or done == r.steps
    if (done % r.log_every == 0 or is_eval or res.diverged.all()
        or res.interrupted is not None):
      _log(cfg, cells, res, state, jax.device_get(pending), meter, is_eval, is_main, bar,
           flops_per_token, peak_all)
      pending = []
    if res.diverged.all():
      res.stopped = done
    if bar is not None:
      bar.update(1)
    if res.stopped is not None or res.interrupted is not None:
      break
    if r.checkpoint_every and done % r.checkpoint_every == 0 and done != r.steps:
      cells.save(state, done)
  if bar is not None:
    bar.close()
  if isinstance(cells.step, phased_lib.Dispatcher):
    res.phase_shifts = cells.step.shifts
  prof.close(state.step)
  if res.done == step0:  # nothing left to train (resuming a finished run)
    res.eval_loss = cells.evaluate(state)
  # Always the final / interrupted state; after a non-finite stop only if it did not blow up
  # (a stopped state is never healthy, so the newest healthy checkpoint is kept either way).
  res.stop_saved = cells.save(state, res.done, only_if_sound=res.stopped is not None)
  return res, state


def _log(cfg, cells: Cells, res: Outcome, state, fetched: list, meter, is_eval: bool,
         is_main: bool, bar, flops_per_token: float, peak_all: Optional[float]) -> None:
  """One logged step: a metrics row per cell (and the held-out loss on an eval step), the
  progress bar or one line per cell; marks cells whose skip counter is at the limit."""
  n, done = cells.n, res.done
  tps = meter.interval(done)  # of all cells together
  res.last_losses = np.asarray([np.reshape(f["loss"], (n,)) for f in fetched], np.float64)
  rows = [metrics.step_row(done, m, done * meter.tps_unit // n, tps / n, meter, n)
          for m in _per_cell(fetched[-1], n)]
  if is_eval:
    res.eval_loss = cells.evaluate(state)
    meter.pause_done()
  for i, (row, log) in enumerate(zip(rows, cells.logs)):
    if peak_all and tps == tps:
      row["mfu"] = tps * flops_per_token / peak_all  # the devices' (all cells together)
    if is_eval:
      row["eval_loss"] = float(res.eval_loss[i])
    log.write(row)
    log.flush()
    res.diverged[i] |= row["consec"] >= cfg.run.max_consecutive_skips
    if bar is None and is_main:  # no bar (run.progress=false, batch jobs, cells)
      label = f"{cells.labels[i]} " if cells.labels else ""
      print(label + log_line(row, cfg.run.steps), flush=True)
  res.last_rows = rows
  if bar is not None:
    bar.set_postfix(loss=f"{rows[0]['loss']:.3f}",
                    **({"eval": f"{res.eval_loss[0]:.3f}"} if is_eval else {}))
