"""The training loop: set up, train, evaluate, checkpoint, log; resume exactly.

``train(cfg, out_dir, resume)`` returns the summary dict. The host loop only dispatches: a
background thread makes the device batches ahead (``_Prefetch``), each step's
consecutive-skip counter is read two steps later (two steps stay in flight), and metrics are
fetched every ``log_every`` steps.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import queue
import re
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Optional

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp

from scaleopt import models, optim
from scaleopt.train import (bridge, checkpoint, config as config_lib, convert, data, identity,
                            mesh as mesh_lib, metrics, phased as phased_lib, step as step_lib)
from scaleopt.train.config import ConfigError, TrainConfig, dump_config

EXIT_OK, EXIT_SKIPS, EXIT_SIGNAL = 0, 3, 143

# Dense bf16 peak FLOP/s per chip, matched against ``device_kind``.
_TPU_PEAK = {"v4": 275e12, "v5 lite": 197e12, "v5e": 197e12, "v5p": 459e12, "v6": 918e12}


class SkipLimit(RuntimeError):
  """Too many consecutive non-finite steps; the last good state was checkpointed."""


class Interrupted(RuntimeError):
  """SIGTERM / SIGINT (preemption, Ctrl-C): the state was checkpointed, resume with --resume."""


class OutOfMemory(RuntimeError):
  """The device ran out of memory compiling or running a step; the message is one line with
  the bytes asked for, the device's limit and the settings that lower them."""


_GIB = 2.0 ** 30
_SIZE = r"([0-9.]+)\s*([KMGT]i?B?|bytes|B)"


def _bytes(num: str, unit: str) -> float:
  return float(num) * 1024 ** "BKMGT".index(unit[0] if unit[0] in "KMGT" else "B")


def out_of_memory(e: BaseException, cfg: TrainConfig) -> Optional[OutOfMemory]:
  """The one-line OutOfMemory for an XLA ``RESOURCE_EXHAUSTED`` / out-of-memory error (None
  for any other error). Reads the bytes asked for from the message (XLA's GPU and CPU runtimes
  say "allocate N bytes", its TPU compiler "Used X of Y hbm") and the limit from the message
  or the device's memory pool."""
  text = str(e)
  if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
    return None
  m = (re.search(r"allocat\w*(?:\s+request\s+for)?\s+" + _SIZE, text)
       or re.search(r"[Uu]sed\s+" + _SIZE, text))
  asked = f"{_bytes(*m.groups()) / _GIB:.2f} GiB" if m else "an unreported amount"
  lim = re.search(r"[Uu]sed\s+[0-9.]+\s*\S+\s+of\s+" + _SIZE, text)
  pool = _bytes(*lim.groups()) if lim else _pool_bytes()
  limit = f"{pool / _GIB:.2f} GiB" if pool else "unknown"
  d, mdl = cfg.data, cfg.model.config
  return OutOfMemory(
      f"out of device memory: the step asked for {asked}, the device's limit is {limit}; "
      f"lower it with more data.microbatches (now {d.microbatches}: data.batch_size="
      f"{d.batch_size} in smaller pieces, also the evaluation's), model.remat (now "
      f"{mdl.remat!r}; 'full' keeps the fewest activations), mesh.fsdp (now {cfg.mesh.fsdp}; "
      f"parameters and optimizer state split over that many devices) or run.eval_tokens (now "
      f"{cfg.run.eval_tokens}; the held-out set kept on the devices)")


class _Signals:
  """SIGTERM / SIGINT -> a stop the loop checks between steps; a second signal exits at once.

  Python runs signal handlers only between bytecodes, so a main thread blocked in a device
  wait would not see them. The C-level handler writes the signal number to a wakeup pipe
  (``signal.set_wakeup_fd``) that a daemon thread reads: the first signal sets the flag (the
  loop then checkpoints and stops), a second one ends the process immediately with
  128 + signum, even if a computation hangs.

  Multi-process runs (``jax.distributed`` with its preemption service, on by default) must
  stop at the same step on every process. There SIGTERM is left to JAX's preemption notifier
  (installed by ``jax.distributed.initialize``), a first SIGINT is forwarded to it as a
  SIGTERM, and ``stop(step)`` is true on every process at the same step: Orbax's
  ``reached_preemption`` (the processes exchange their step counters in the background once
  any of them got the notice and agree on the next step after the largest; between notices
  the check is local). A second SIGINT still exits at once; a second SIGTERM does nothing
  (a hung multi-process run needs SIGINT twice or SIGKILL).
  """

  def __init__(self):
    self.caught = None
    self.agree = _preemption_service()
    self._old, self._fds, self._old_fd, self._thread = {}, None, None, None

  def __enter__(self):
    if threading.current_thread() is not threading.main_thread():
      return self
    r, w = os.pipe()
    os.set_blocking(w, False)
    self._fds = (r, w)
    for sig in (signal.SIGINT,) if self.agree else (signal.SIGTERM, signal.SIGINT):
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
        where = ("with every process at the same step " if self.agree else "")
        print(f"\n{self.caught}: stopping after this step {where}and checkpointing (send it "
              "again to exit at once)", file=sys.stderr, flush=True)
        if self.agree:  # JAX's preemption notifier spreads the notice to every process
          os.kill(os.getpid(), signal.SIGTERM)
      else:
        os._exit(128 + b[0])

  def stop(self, step: int) -> Optional[str]:
    """The signal to stop for after ``step`` (None: go on); call it after every step."""
    if not self.agree:
      return self.caught
    if not ocp.multihost.reached_preemption(step):
      return None
    print(f"preemption notice: every process stops after step {step} and checkpoints",
          file=sys.stderr, flush=True)
    return self.caught or "SIGTERM"

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


def _preemption_service() -> bool:
  """JAX runs distributed with its preemption service (SIGTERM handled by its notifier)."""
  if not jax.distributed.is_initialized():
    return False
  # public flag only (no jax._src): jax.distributed.initialize starts the service when it is on
  return bool(jax.config.jax_enable_preemption_service)


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
  tx, spec, schedule = cfg.built
  d = cfg.data
  train_w, vocab = data.open_split(d.source, d.path, "train", d.seq_len)
  val_w, _ = data.open_split(d.source, d.path, "val", d.seq_len)
  if vocab > model.cfg.vocab_size:
    raise ConfigError(f"the data's vocabulary ({vocab} tokens) is larger than "
                      f"model.vocab_size={model.cfg.vocab_size}; set model.vocab_size >= {vocab}")
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


class _Prefetch:
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
  # Join a multi-process run first: its preemption notifier then owns SIGTERM (``_Signals``).
  mesh_lib.maybe_initialize_distributed(cfg.mesh.distributed)
  with _Signals() as sig:  # from the start: a signal during set-up stops after the first step
    try:
      return _train(cfg, out_dir, resume, s, sig)
    except Exception as e:  # noqa: BLE001 -- only out-of-memory is translated, the rest re-raises
      oom = out_of_memory(e, cfg)
      if oom is None:
        raise
    raise oom  # outside the handler: no chained traceback, the step's arrays are freed


@dataclasses.dataclass
class _Outcome:
  """What the host loop hands back."""
  done: int
  stopped: Optional[int] = None  # step of a non-finite stop
  interrupted: Optional[str] = None  # signal name
  stop_saved: bool = True  # the final state was checkpointed
  last_losses: list = dataclasses.field(default_factory=list)
  last_row: dict = dataclasses.field(default_factory=dict)
  eval_loss: float = float("nan")
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
  prof = metrics.Profile(out / "profile", r.profile)
  meter = metrics.Meter(s.spec.num_groups * d.batch_size * d.seq_len)
  shape, feed = batch_shape(s), None
  try:
    step = _stepper(s, fns, state, step0)  # compiles host-picked programs (timed as compile)
    feed = _Prefetch(it, lambda b: {k: _put(fns.batch_sh, v, shape) for k, v in b.items()},
                     max(0, r.steps - step0))
    res = _run(cfg, s, state, step, feed, step0, log, meter, prof, save, evaluate, is_main,
               sig)
  finally:
    if feed is not None:
      feed.close()
    log.close()
    ckpt.close()
  summary = {**_summary(cfg, s, res, meter, start), **eval_identity(ev)}
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


def _raise_for_stop(res: _Outcome, ckpt: checkpoint.Checkpointer, max_skips: int) -> None:
  """Interrupted after a signal, SkipLimit after a non-finite stop (naming what was kept)."""
  d = ckpt.dir
  if res.interrupted is not None:
    raise Interrupted(f"{res.interrupted} at step {res.done}: the state is checkpointed in "
                      f"{d}/{res.done}; continue with --resume")
  if res.stopped is not None:
    good = ckpt.last_good_step()
    where = (f"the state at the stop is checkpointed in {d}/{res.done}" if res.stop_saved
             else f"the state at the stop is not saved (its parameter norm grew more than "
             f"{checkpoint.GROWTH:g}x)")
    keep = (f"; the newest checkpoint from before the trouble, {d}/{good}, is kept"
            if good is not None else "")
    raise SkipLimit(f"stopped at step {res.done}: {max_skips} consecutive steps had a "
                    f"non-finite loss or update (parameters were left untouched); {where}{keep}")


def _flops(cfg: TrainConfig, s: Setup) -> tuple[float, Optional[float]]:
  """(executed model FLOPs per distinct token, peak FLOP/s of all devices or None)."""
  per_token = (models.flops_per_token(s.model.cfg, cfg.data.seq_len)
               * bridge.passes_per_step(s.spec))
  peak = peak_flops(jax.devices()[0], cfg.run.peak_flops)
  return per_token, (peak * jax.device_count() if peak else None)


def _summary(cfg: TrainConfig, s: Setup, res: _Outcome, meter: metrics.Meter, start) -> dict:
  flops_per_token, peak_all = _flops(cfg, s)
  tps_run = meter.overall()
  return {
      "steps": res.done, "tokens": res.done * meter.tps_unit,
      "final_train_loss": float(np.mean(res.last_losses)) if res.last_losses else None,
      "final_eval_loss": res.eval_loss, "wall_time_s": time.time() - meter.t0,
      "compile_s": meter.compile_s, "tokens_per_s": tps_run,
      "params": models.count_params(s.model.cfg),
      "mfu": tps_run * flops_per_token / peak_all if peak_all else None,
      "skipped_steps": res.last_row.get("skipped", 0), "optimizer": cfg.optimizer.name,
      "layout": s.spec.layout, "sweeps_per_step": bridge.passes_per_step(s.spec),
      "optimizer_numerics": optim.resolved_numerics(cfg.optimizer),
      "devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind,
      "resumed_from": start,
      "stopped_early": res.stopped is not None or res.interrupted is not None,
      "interrupted_by": res.interrupted, "phase_shifts": res.phase_shifts,
  }


def _pool_bytes() -> Optional[int]:
  """The memory pool of this process's first device, in bytes (None where unknown: CPU)."""
  return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")


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
  limit = _pool_bytes()
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


def _run(cfg, s, state, step, feed, step0, log, meter, prof, save, evaluate, is_main,
         sig) -> _Outcome:
  """The host loop from ``step0`` to ``run.steps`` (or a stop) over ``feed``'s device
  batches, each step run by ``step`` (``_stepper``); checkpoints via ``save``."""
  r = cfg.run
  flops_per_token, peak_all = _flops(cfg, s)
  bar = None
  if r.progress and is_main:
    from tqdm import tqdm
    bar = tqdm(total=r.steps, initial=step0, desc="train", unit="step", dynamic_ncols=True,
               mininterval=0.5)
  res = _Outcome(done=step0)
  pending: list[dict] = []  # device metrics of the steps since the last log
  # the consecutive-skip counters of the last two steps, each read two steps after its step
  # (reading the newest would wait for the step just launched: two steps stay in flight)
  behind: list = []
  for t in range(step0, r.steps):
    batch = feed.next()
    prof.before(t)
    state, m = step(state, batch)
    res.done = done = t + 1
    prof.after(done, m["loss"])
    if meter.compile_s is None:
      jax.block_until_ready(m["loss"])
      meter.first_step_done(done)
    elif step.fresh:  # a host-picked program's first run
      jax.block_until_ready(m["loss"])
      meter.restart(done)
    pending.append(m)
    if len(behind) == 2:
      consec = int(behind.pop(0))
      step.confirm(consec > 0)
      if consec >= r.max_consecutive_skips:
        res.stopped = done
    behind.append(m["consec"])
    res.interrupted = sig.stop(done)
    halt = res.stopped is not None or res.interrupted is not None
    is_eval = (r.eval_every and done % r.eval_every == 0) or done == r.steps
    if done % r.log_every == 0 or is_eval or halt:
      fetched = jax.device_get(pending)
      pending = []
      tps = meter.interval(done)
      res.last_losses = [float(x["loss"]) for x in fetched]
      row = metrics.step_row(done, fetched[-1], done * meter.tps_unit, tps)
      if peak_all and tps == tps:
        row["mfu"] = tps * flops_per_token / peak_all
      if is_eval:
        row["eval_loss"] = res.eval_loss = evaluate(
            optim.eval_params(state.opt_state, state.params))
        meter.pause_done()
      log.write(row)
      log.flush()
      res.last_row = row
      if bar is not None:
        bar.set_postfix(loss=f"{row['loss']:.3f}",
                        **({"eval": f"{res.eval_loss:.3f}"} if is_eval else {}))
      elif is_main:  # no bar (run.progress=false, batch jobs): one line per log
        print(log_line(row, r.steps), flush=True)
      if row["consec"] >= r.max_consecutive_skips:
        res.stopped = done
    if bar is not None:
      bar.update(1)
    if res.stopped is not None or res.interrupted is not None:
      break
    if r.checkpoint_every and done % r.checkpoint_every == 0 and done != r.steps:
      save(state, done)
  if bar is not None:
    bar.close()
  if isinstance(step, phased_lib.Dispatcher):
    res.phase_shifts = step.shifts
  prof.close(state.step)
  if res.done == step0:  # nothing left to train (resuming a finished run)
    res.eval_loss = evaluate(optim.eval_params(state.opt_state, state.params))
  # Always the final / interrupted state; after a non-finite stop only if it did not blow up
  # (a stopped state is never healthy, so the newest healthy checkpoint is kept either way).
  res.stop_saved = save(state, res.done, only_if_sound=res.stopped is not None)
  return res
