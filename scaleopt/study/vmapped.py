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

from scaleopt import optim
from scaleopt.train import (checkpoint, data, evaluation, loop, mesh as mesh_lib, metrics,
                            phased, prefetch, step as step_lib, summary)
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
  eval: Any  # (TrainState[C], tokens[B, T+1]) -> loss[C] (of optim.eval_params)
  state_shape: Any  # one cell's TrainState of ShapeDtypeStruct


_FNS_CACHE: dict = {}


def group_fns(group_setup: loop.Setup, n: int, shared_batch: bool, key: Optional[str] = None
              ) -> GroupFns:
  """The jitted functions for ``n`` cells of one group (cached under ``key``)."""
  cache_key = (key, n, shared_batch)
  if key is not None and cache_key in _FNS_CACHE:
    return _FNS_CACHE[cache_key]
  model, tx, spec = group_setup.model, group_setup.tx, group_setup.spec
  schedule = group_setup.schedule

  def init(seed):
    return step_lib.init_state(model, tx, seed)

  def one_step(state, batch, lr):
    new, m = step_lib.make_train_step(model, lr_scaled(tx, lr), spec, schedule)(state, batch)
    return new, {**m, "lr": m["lr"] * lr}

  eval_params = step_lib.make_eval_step(model)
  eval_one = lambda state, tokens: eval_params(optim.eval_params(state.opt_state, state.params),
                                               tokens)
  # init, restore and step all place the state on the setup's (one-device) mesh, so the
  # state the step returns has the type of the state it took: no second compile.
  rep = NamedSharding(group_setup.mesh, P())
  _check_no_offload(init)
  fns = GroupFns(
      init=jax.jit(_cellwise(init, (0,), n), out_shardings=rep),
      step=jax.jit(_cellwise(one_step, (0, None if shared_batch else 0, 0), n),
                   out_shardings=(rep, None), donate_argnums=0),
      eval=jax.jit(_cellwise(eval_one, (0, None), n)),
      state_shape=jax.eval_shape(init, jnp.zeros((), jnp.int32)))
  if key is not None:
    _FNS_CACHE[cache_key] = fns
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


class _CellBatches:
  """The cells' training batches: one iterator when every cell has the same seed (its batch
  is broadcast to every cell), else one per cell, stacked on a leading cell axis."""

  def __init__(self, its: list):
    self.its = its

  def next(self) -> dict:
    nxt = [it.next() for it in self.its]
    return nxt[0] if len(nxt) == 1 else {k: np.stack([b[k] for b in nxt]) for k in nxt[0]}

  def state(self) -> list:
    return [it.state() for it in self.its]


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
  """Trains cells that differ only in ``optimizer.learning_rate`` and ``run.seed`` together:
  the trainer's host loop (``loop.run_cells``) with a cell axis.

  ``resume_step``: the checkpoint step every cell restores from (None: start fresh).
  ``should_stop()`` is polled every step; when true the cells checkpoint and stop
  ("interrupted"). Evaluation: the held-out split's ``val`` part during training and at the
  end, its ``test`` part at the end (``data.heldout_part``).
  """
  n, first = len(cfgs), cfgs[0]
  group_setup = loop.setup(unit_lr_config(first))
  if group_setup.mesh.devices.size != 1:
    raise ValueError("the vmapped cell engine runs on one device; use engine.kind=loop")
  run, data_cfg = first.run, first.data
  seeds = [c.run.seed for c in cfgs]
  lrs = jnp.asarray([c.optimizer.learning_rate for c in cfgs], jnp.float32)
  shared = len(set(seeds)) == 1
  fns = group_fns(group_setup, n, shared, key)
  its = [data.Batches(group_setup.train_w, data_cfg.batch_size, data_cfg.microbatches,
                      groups=group_setup.spec.num_groups,
                      rolling_b=group_setup.spec.layout == "rolling_b", seed=seed)
         for seed in (seeds[:1] if shared else seeds)]
  sets = data.heldout_eval_sets(group_setup.val_w, run.eval_tokens)
  size = evaluation.eval_microbatch(first)
  parts = {p: None if ev is None else jnp.asarray(ev.microbatches(size)[0])
           for p, ev in sets.items()}

  def evaluate(state, part: str) -> np.ndarray:
    if parts[part] is None:
      return np.full(n, np.nan)
    return sets[part].mean(jax.device_get(fns.eval(state, parts[part])))

  ckpts = [checkpoint.Checkpointer(cell_dir / "checkpoints", run.keep_checkpoints,
                                   run.async_checkpoint)
           for cell_dir in dirs]
  for c, cell_dir in zip(cfgs, dirs):
    cell_dir.mkdir(parents=True, exist_ok=True)
    dump_config(c, cell_dir / "config.yaml")
  state = _restore_group(cfgs, group_setup, fns, ckpts, its, resume_step, seeds)
  step0 = int(jax.device_get(state.step[0]))
  logs = [metrics.MetricsLog(cell_dir, resume_step=step0 if resume_step is not None else None,
                             tensorboard=run.tensorboard) for cell_dir in dirs]
  feed = prefetch.Prefetch(_CellBatches(its), jax.device_put, max(0, run.steps - step0))

  def save(st, step: int, only_if_sound: bool = False) -> bool:
    del only_if_sound  # every cell's state is kept (a diverged cell's steps were skipped)
    pos = feed.state()
    for i, ckpt in enumerate(ckpts):
      ckpt.save(step, _slice(st, i), checkpoint.with_state_format(cfgs[i], pos[0 if shared else i]))
    return True

  cells = loop.Cells(n, phased.OneProgram(lambda st, b: fns.step(st, b, lrs)), feed, logs,
                     lambda st: evaluate(st, "val"), save,
                     lambda step: "deadline" if should_stop() else None,
                     labels=[f"[lr {c.optimizer.learning_rate:g} seed {c.run.seed}]"
                             for c in cfgs])
  meter = metrics.Meter(group_setup.spec.num_groups * data_cfg.batch_size * data_cfg.seq_len * n)
  try:
    res, state = loop.run_cells(first, group_setup, cells, state, step0, meter)
  finally:
    feed.close()
    for ckpt in ckpts:
      ckpt.close()
    for log in logs:
      log.close()
  test = evaluate(state, "test") if res.interrupted is None else np.full(n, np.nan)
  return _finish(cfgs, dirs, group_setup, res, meter, resume_step, sets, test)


def _restore_group(cfgs, group_setup, fns, ckpts, its, resume_step, seeds):
  """The cells' stacked state: fresh, or restored from each cell's checkpoint at
  ``resume_step`` (with each iterator's position)."""
  if resume_step is None:
    return fns.init(jnp.asarray(seeds, jnp.int32))
  sh = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = checkpoint.abstract(fns.state_shape, jax.tree.map(lambda _: sh, fns.state_shape))
  restored = [ckpt.restore(resume_step, abstract) for ckpt in ckpts]
  state = jax.device_put(_stack([st for st, _ in restored]), NamedSharding(group_setup.mesh, P()))
  dstates = [checkpoint.check_state_format(c, ds, f"{ckpt.dir}/{resume_step}")
             for c, (_, ds), ckpt in zip(cfgs, restored, ckpts)]
  for it, ds in zip(its, dstates):
    it.restore(ds)
  return state


def _finish(cfgs, dirs, group_setup, res, meter, resume_step, sets, test) -> GroupResult:
  """Each cell's status and summary.json (the trainer's, plus the group's wall time and the
  test set), and its loss plot."""
  n = len(cfgs)
  wall = time.time() - meter.t0
  status, summaries = [], []
  for i, (c, cell_dir) in enumerate(zip(cfgs, dirs)):
    status.append("interrupted" if res.interrupted is not None
                  else "diverged" if res.diverged[i] else "ok")
    summ = {**summary.summarize(c, group_setup, res, meter, resume_step, cell=i),
            "group_wall_time_s": wall, "cells_at_once": n, **evaluation.eval_identity(sets["val"]),
            "test_set": evaluation.eval_identity(sets["test"])["eval_set"]}
    metrics.write_summary(cell_dir, summ)
    summaries.append(summ)
    if c.run.plot:
      metrics.plot_curves({c.optimizer.name: metrics.read_metrics(cell_dir / "metrics.jsonl")},
                          cell_dir / "loss.png", title=f"lr {c.optimizer.learning_rate:g}, "
                          f"seed {c.run.seed}")
  train_loss = np.mean(res.last_losses, axis=0) if res.last_losses is not None else [np.nan] * n
  return GroupResult(status, [float(v) for v in res.eval_loss], [float(v) for v in test],
                     [float(v) for v in train_loss], summaries, wall, group_setup.spec)
