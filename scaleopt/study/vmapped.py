"""Cheap cells: cells that differ only in learning rate and seed share one compiled step, and
several of them train at once in one vmapped step (the sweep engine's trick for LMs).

Every optimizer of ``scaleopt.optim.build`` ends in ``scale_by_learning_rate(schedule)``, so the
peak learning rate enters the update linearly: with ``tx_1`` built at peak lr 1 (the schedule's
shape only),

    update(lr) = lr * update_1,      update_1 = tx_1.update(...)      (same optimizer state)

``lr_scaled(tx_1, lr)`` multiplies by a traced ``lr``; the seed enters through
``init_state(model, tx, seed)`` (``PRNGKey(seed)`` is traceable) and each cell's own data order.
A group of C cells then runs as

    state[C, ...] = vmap(init)(seeds[C])
    state, metrics = jit(vmap(train_step, (0, 0 | None, 0)), donate state)(state, batch, lr[C])

with the batch broadcast (``None``) when all cells share a seed. One compile serves every
learning rate and seed of a group, whatever C. C = 1 skips ``vmap`` (same compiled-once step):
under ``vmap`` a ``lax.cond`` whose predicate is batched runs both branches, so optimizers with
periodic branches (Sophia's curvature refresh, Shampoo's roots) run one cell at a time
(``engines.VMAP_SAFE``).

Each cell keeps its own folder in the format of ``scaleopt.train.loop``: ``config.yaml``,
``metrics.jsonl``, ``summary.json``, Orbax ``checkpoints/`` with the cell's ``TrainState``
(``scaleopt train --resume`` can continue any of them). One device only.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from scaleopt import models, optim
from scaleopt.train import (bridge, checkpoint, data, loop, mesh as mesh_lib, metrics,
                            step as step_lib)
from scaleopt.train.config import ConfigError, TrainConfig, dump_config


def lr_scaled(tx: optax.GradientTransformation, lr: jax.Array
              ) -> optax.GradientTransformationExtraArgs:
  """``tx`` with its updates multiplied by ``lr`` (may be traced); the state is ``tx``'s."""

  def update(updates, state, params=None, **extra):
    u, s = tx.update(updates, state, params, **extra)
    return jax.tree.map(lambda x: x * jnp.asarray(lr, x.dtype), u), s

  return optax.GradientTransformationExtraArgs(tx.init, update)


def unit_lr_config(cfg: TrainConfig) -> TrainConfig:
  """The cell's config with peak learning rate 1 (the schedule's shape)."""
  return dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, learning_rate=1.0))


def _cellwise(fn: Callable, in_axes: tuple, n: int) -> Callable:
  """vmap over the leading cell axis; for one cell, squeeze/expand instead (no vmap)."""
  if n > 1:
    return jax.vmap(fn, in_axes=in_axes)

  def one(*args):
    args = [a if ax is None else jax.tree.map(lambda x: x[0], a) for a, ax in zip(args, in_axes)]
    return jax.tree.map(lambda x: x[None], fn(*args))

  return one


@dataclasses.dataclass
class GroupFns:
  init: Any  # seeds[C] -> TrainState[C]
  step: Any  # (TrainState[C], batch, lr[C]) -> (TrainState[C], metrics[C])
  eval: Any  # (params[C], tokens[B, T+1]) -> loss[C]
  state_shape: Any  # one cell's TrainState of ShapeDtypeStruct


_FNS_CACHE: dict = {}


def group_fns(s: loop.Setup, n: int, shared_batch: bool, key: Optional[str] = None
              ) -> GroupFns:
  """The jitted functions for ``n`` cells of one group (cached under ``key``)."""
  ck = (key, n, shared_batch)
  if key is not None and ck in _FNS_CACHE:
    return _FNS_CACHE[ck]
  model, tx, spec, schedule = s.model, s.tx, s.spec, s.schedule

  def init(seed):
    return step_lib.init_state(model, tx, seed)

  def one_step(state, batch, lr):
    new, m = step_lib.make_train_step(model, lr_scaled(tx, lr), spec, schedule)(state, batch)
    return new, {**m, "lr": m["lr"] * lr}

  eval_one = step_lib.make_eval_step(model)
  # init, restore and step all place the state on the setup's (one-device) mesh, so the
  # state the step returns has the type of the state it took: no second compile.
  rep = NamedSharding(s.mesh, P())
  _check_no_offload(init)
  fns = GroupFns(
      init=jax.jit(_cellwise(init, (0,), n), out_shardings=rep),
      step=jax.jit(_cellwise(one_step, (0, None if shared_batch else 0, 0), n),
                   out_shardings=(rep, None), donate_argnums=0),
      eval=jax.jit(_cellwise(eval_one, (0, None), n)),
      state_shape=jax.eval_shape(init, jnp.zeros((), jnp.int32)))
  if key is not None:
    _FNS_CACHE[ck] = fns
  return fns


def _check_no_offload(init: Callable) -> None:
  """Cells batch their optimizer's ``lax.cond`` (each cell has its own step count), which runs
  both branches every step: state kept in host memory would cross to the device every step."""
  if any(mesh_lib.host_resident(init, (jnp.zeros((), jnp.int32),))):
    raise ConfigError("optimizer.extra.offload_statistics=true: study cells run vmapped, where "
                      "a statistics step runs on every step; set it to false in the study")


def _stack(trees: list) -> Any:
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _slice(tree: Any, i: int) -> Any:
  return jax.tree.map(lambda x: x[i], tree)


@dataclasses.dataclass
class GroupResult:
  status: list  # per cell: "ok" | "diverged" | "interrupted"
  val_loss: list
  test_loss: list
  train_loss: list
  summaries: list
  wall_time_s: float
  spec: Any  # the optimizer's CollectorSpec


def train_group(cfgs: list[TrainConfig], dirs: list[pathlib.Path], *, resume_step: Optional[int],
                should_stop: Callable[[], bool] = lambda: False, key: Optional[str] = None,
                ) -> GroupResult:
  """Trains cells that differ only in ``optimizer.learning_rate`` and ``run.seed`` together.

  ``resume_step``: the checkpoint step every cell restores from (None: start fresh).
  ``should_stop()`` is polled every step; when true the cells checkpoint and stop
  ("interrupted"). Evaluation: the held-out split's ``val`` part during training and at the
  end, its ``test`` part at the end (``data.heldout_part``).
  """
  n = len(cfgs)
  s = loop.setup(unit_lr_config(cfgs[0]))
  if s.mesh.devices.size != 1:
    raise ValueError("the vmapped cell engine runs on one device; use engine.kind=loop")
  r, d = cfgs[0].run, cfgs[0].data
  seeds = [c.run.seed for c in cfgs]
  lrs = jnp.asarray([c.optimizer.learning_rate for c in cfgs], jnp.float32)
  shared = len(set(seeds)) == 1
  fns = group_fns(s, n, shared, key)
  groups, rolling = s.spec.num_groups, s.spec.layout == "rolling_b"
  its = [data.Batches(s.train_w, d.batch_size, d.microbatches, groups=groups, rolling_b=rolling,
                      seed=sd) for sd in (seeds[:1] if shared else seeds)]
  sets = data.heldout_eval_sets(s.val_w, r.eval_tokens)
  parts = {p: None if ev is None else jnp.asarray(ev.microbatches(loop.eval_microbatch(cfgs[0]))[0])
           for p, ev in sets.items()}

  def evaluate(params, part: str) -> np.ndarray:
    if parts[part] is None:
      return np.full(n, np.nan)
    return sets[part].mean(jax.device_get(fns.eval(params, parts[part])))

  ckpts = [checkpoint.Checkpointer(dd / "checkpoints", r.keep_checkpoints, r.async_checkpoint)
           for dd in dirs]
  for c, dd in zip(cfgs, dirs):
    dd.mkdir(parents=True, exist_ok=True)
    dump_config(c, dd / "config.yaml")
  if resume_step is not None:
    sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = checkpoint.abstract(fns.state_shape, jax.tree.map(lambda _: sh, fns.state_shape))
    restored = [ck.restore(resume_step, abstract) for ck in ckpts]
    state = jax.device_put(_stack([st for st, _ in restored]), NamedSharding(s.mesh, P()))
    dstates = [loop.check_state_format(c, ds, f"{ck.dir}/{resume_step}")
               for c, (_, ds), ck in zip(cfgs, restored, ckpts)]
    for it, ds in zip(its, dstates):
      it.restore(ds)
  else:
    state = fns.init(jnp.asarray(seeds, jnp.int32))
  step0 = int(jax.device_get(state.step[0]))
  logs = [metrics.MetricsLog(dd, resume_step=step0 if resume_step is not None else None,
                             tensorboard=r.tensorboard) for dd in dirs]
  tokens_per_step = groups * d.batch_size * d.seq_len
  meter = metrics.Meter(tokens_per_step * n)
  pending, last_losses, last_skipped = [], np.full(n, np.nan), np.zeros(n)
  diverged = np.zeros(n, bool)
  val = np.full(n, np.nan)
  done, stopped = step0, False

  def save_all(step):
    for i, ck in enumerate(ckpts):
      ck.save(step, _slice(state, i),
              loop.with_state_format(cfgs[i], its[0 if shared else i].state()))

  for t in range(step0, r.steps):
    nxt = [it.next() for it in its]
    batch = nxt[0] if shared else {k: np.stack([b[k] for b in nxt]) for k in nxt[0]}
    state, m = fns.step(state, batch, lrs)
    done = t + 1
    if meter.compile_s is None:
      jax.block_until_ready(m["loss"])
      meter.first_step_done(done)
    pending.append(m)
    stopped = should_stop()
    is_eval = (r.eval_every and done % r.eval_every == 0) or done == r.steps
    if done % r.log_every == 0 or is_eval or stopped:
      fetched = jax.device_get(pending)
      pending = []
      tps = meter.interval(done) / n
      last_losses = np.mean([f["loss"] for f in fetched], axis=0)
      last_skipped = np.asarray(fetched[-1]["skipped"])
      diverged |= np.asarray(fetched[-1]["consec"]) >= r.max_consecutive_skips
      if is_eval:
        val = evaluate(state.params, "val")
        meter.pause_done()
      for i, log in enumerate(logs):
        row = metrics.step_row(done, {k: v[i] for k, v in fetched[-1].items()},
                               done * tokens_per_step, tps)
        if is_eval:
          row["eval_loss"] = float(val[i])
        log.write(row)
        log.flush()
    if stopped:
      break
    if r.checkpoint_every and done % r.checkpoint_every == 0 and done != r.steps:
      save_all(done)
  if done == step0:
    val = evaluate(state.params, "val")
  test = evaluate(state.params, "test") if not stopped else np.full(n, np.nan)
  save_all(done)
  for ck in ckpts:
    ck.close()
  for log in logs:
    log.close()
  wall = time.time() - meter.t0
  tps = meter.overall() / n
  flops = models.flops_per_token(s.model.cfg, d.seq_len) * bridge.passes_per_step(s.spec)
  status, summaries = [], []
  for i, (c, dd) in enumerate(zip(cfgs, dirs)):
    st = "interrupted" if stopped else ("diverged" if diverged[i] else "ok")
    status.append(st)
    summ = {
        "steps": done, "tokens": done * tokens_per_step,
        "final_train_loss": float(last_losses[i]), "final_eval_loss": float(val[i]),
        "wall_time_s": wall / n, "group_wall_time_s": wall, "cells_at_once": n,
        "compile_s": meter.compile_s, "tokens_per_s": tps,
        "params": models.count_params(s.model.cfg), "mfu": None,
        "flops_per_token": flops, "optimizer": c.optimizer.name, "layout": s.spec.layout,
        "sweeps_per_step": bridge.passes_per_step(s.spec),
        "optimizer_numerics": optim.resolved_numerics(c.optimizer),
        "skipped_steps": int(last_skipped[i]), "phase_shifts": None, "devices": 1,
        "device_kind": jax.devices()[0].device_kind, "resumed_from": resume_step,
        "stopped_early": stopped or bool(diverged[i]),
        "interrupted_by": "deadline" if stopped else None, **loop.eval_identity(sets["val"]),
        "test_set": loop.eval_identity(sets["test"])["eval_set"]}
    metrics.write_summary(dd, summ)
    summaries.append(summ)
    if r.plot:
      metrics.plot_curves({c.optimizer.name: metrics.read_metrics(dd / "metrics.jsonl")},
                          dd / "loss.png", title=f"lr {c.optimizer.learning_rate:g}, "
                          f"seed {c.run.seed}")
  return GroupResult(status, [float(v) for v in val], [float(v) for v in test],
                     [float(v) for v in last_losses], summaries, wall, s.spec)
