"""The jitted train and eval steps.

One train step, all inside ``jax.jit`` with the state donated:

  microbatches [m, b, T+1] --lax.scan--> ``scaleopt.optim.collect`` statistics (what to
    collect, clipping included, is read from the optimizer state)
  -> tx.update(stats.numerator, opt_state, params, bc_stats=stats)   (clip -> opt -> wd -> lr)
  -> apply unless the loss or gradient is non-finite, a transform zeroed a non-finite
     tensor or (``check_update``) the update is non-finite (then params and optimizer state
     stay as they were and the skip is counted)
  -> metrics (device scalars; the loop fetches them every ``log_every`` steps): the
     gradient norm before and after the clip and whether it fired (``clip_metrics``).

Parameters and optimizer state are float32; the model computes in ``model.dtype`` (bf16).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from scaleopt import models, optim
from scaleopt.train import bridge, mesh as mesh_lib, telemetry

PyTree = Any


class TrainState(NamedTuple):
  step: jax.Array  # int32: completed steps
  params: PyTree  # float32
  opt_state: PyTree
  rng: jax.Array  # uint32[2] raw PRNG key
  skipped: jax.Array  # int32: non-finite steps skipped so far
  consec: jax.Array  # int32: consecutive skipped steps up to now


def init_state(model: bridge.Model, tx: optax.GradientTransformation, seed: int) -> TrainState:
  rng = jax.random.PRNGKey(seed)
  rng, init_rng = jax.random.split(rng)
  params = model.init(init_rng)
  zero = jnp.zeros((), jnp.int32)
  return TrainState(step=zero, params=params, opt_state=tx.init(params), rng=rng,
                    skipped=zero, consec=zero)


def _select(ok: jax.Array, new: PyTree, old: PyTree) -> PyTree:
  """``new`` where ``ok``, else ``old``. Leaves in host memory (offloaded optimizer state) take
  ``new``: selecting would run on the host or bring them to the device every step, so the
  transforms that offload keep their old values themselves when the new ones are not finite."""
  pick = lambda n, o: n if optim.in_host_memory(n) else jnp.where(ok, n, o)
  return jax.tree.map(pick, new, old)


def _lr_step(state: TrainState) -> jax.Array:
  """The step the optax schedule evaluates (its count does not advance on skipped steps)."""
  count = optim.schedule_count(state.opt_state)
  return state.step if count is None else count


def _device_microbatches(mesh, axis: Any, params: Any, param_sh: Any,
                         spread: list) -> Any:
  """Where vmapped microbatches live (``optim.MicrobatchAxis``): one per device of the mesh's
  ``data`` axis, else of its ``fsdp`` axis (None: neither has more than one device). Their
  stacked outputs move once, by an all-to-all, into slices of the parameters' layout split
  over that axis (``mesh.spread_stacked``), where the statistics are folded; each such move
  appends to ``spread`` while tracing. Without ``param_sh`` the statistics are sums over the
  axis instead."""
  if axis is None:
    return None

  def to_slices(tree):
    spread.append(True)
    return mesh_lib.spread_stacked(tree, params, param_sh, mesh, axis)

  return optim.MicrobatchAxis(axis, int(mesh.shape[axis]),
                              lambda: models.sharding.microbatch_axis(axis), mesh,
                              None if param_sh is None else to_slices)


def clip_metrics(clipped_norm: jax.Array, stats: optim.BCStats) -> dict[str, jax.Array]:
  """The step's gradient norms around the global-norm clip, from what the collector returns:
  ``grad_norm`` = ||g|| before clipping (g: the full-batch mean gradient, ``stats.full``
  divided by the clip factor c the collector applied to it), ``grad_norm_clipped`` = c c_n
  ||g|| (c_n: a numerator-only clip's factor; both 1 without clipping) and ``clip_fired`` =
  1 when c c_n < 1 (``metrics.step_row`` turns it into the logging window's clip fraction)."""
  factor = jnp.asarray(stats.clip_factor, jnp.float32)
  pre = clipped_norm / factor
  applied = factor * jnp.asarray(stats.numerator_clip, jnp.float32)
  return dict(grad_norm=pre, grad_norm_clipped=pre * applied,
              clip_fired=(applied < 1.0).astype(jnp.float32))


def make_train_step(model: bridge.Model, tx: optax.GradientTransformation, spec,
                    schedule: Callable, telemetry_every: int = 0, param_sh: Any = None,
                    update_sh: Any = None, check_update: bool = True) -> Callable:
  """``step(state, batch) -> (state, metrics)``; batch = {"tokens"[, "b_tokens"]}.

  ``spec`` (the data layout) is not needed here: ``collect`` reads it from the state.
  ``telemetry_every``: per-group telemetry every N steps (``scaleopt.train.telemetry``).
  ``update_sh`` (with ``param_sh``, the parameters' own shardings): per parameter, the layout
  of a (ZeRO-1) sharded optimizer state (``mesh.optimizer_shardings``). What the microbatch
  loop reads (the state, which collector hooks may read per microbatch) and what it returns
  (the statistics) are pinned to ``param_sh``, so no sliced layout propagates into the forward
  and backward passes; the gradient and parameters the optimizer reads are then sliced to
  ``update_sh``, the update stays there, and the new parameters are all-gathered by the step's
  output sharding. None: no constraints. Vmapped microbatches split over the devices
  (``_device_microbatches``) return their statistics in slices; those are not pinned, nor is
  the state their folds read.
  ``check_update``: the skip also checks the update's norm. False only for optimizers whose
  update is finite whenever the gradient and state are (``optim.finite_updates``): the skip is
  then known before the update, so the update, the new moments and the new parameters come
  out of one pass over the state (with the check, XLA runs that pass again after the norm)."""
  del spec
  if update_sh is None:
    pin, on_slices = (lambda t, params: t), (lambda t: t)
  else:
    pin = lambda t, params: mesh_lib.pin_to_params(t, params, param_sh)
    on_slices = lambda t: jax.lax.with_sharding_constraint(t, update_sh)
  mesh = getattr(model, "mesh", None)
  axis = next((a for a in ("data", "fsdp") if mesh is not None and mesh.shape.get(a, 1) > 1),
              None)

  def step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    rng, key = jax.random.split(state.rng)
    spread = []  # filled while collect traces, once per group folded in slices
    mb_axis = _device_microbatches(mesh, axis, state.params, param_sh, spread)
    sliced = (mb_axis is not None and mb_axis.spread is not None
              and optim.collector_spec(state.opt_state).vmap
              and batch["tokens"].shape[0] % mb_axis.size == 0)
    with models.sharding.constraints(mesh):  # optimizer work on the mesh
      stats = optim.collect(model.loss_fn, state.params, batch["tokens"],
                            state.opt_state if sliced else pin(state.opt_state, state.params),
                            key=key, logits_fn=model.logits_fn,
                            b_microbatches=batch.get("b_tokens"), microbatch_axis=mb_axis)
      if not spread:
        stats = pin(stats, state.params)
      params = on_slices(pin(state.params, state.params))
      stats = stats._replace(numerator=on_slices(stats.numerator))  # the update's input
      updates, opt_state = tx.update(stats.numerator, state.opt_state, params, bc_stats=stats)
    updates = on_slices(updates)
    params = optax.apply_updates(params, updates)
    g_norm = optax.global_norm(stats.full)  # after the collector's clip
    clip = clip_metrics(g_norm, stats)
    u_norm = optax.global_norm(updates)
    ok = (jnp.isfinite(stats.loss) & jnp.isfinite(g_norm)
          & (optim.skipped_tensors(opt_state) == 0))
    if check_update:
      ok &= jnp.isfinite(u_norm)
    bad = (~ok).astype(jnp.int32)
    new = TrainState(step=state.step + 1, params=_select(ok, params, state.params),
                     opt_state=_select(ok, opt_state, state.opt_state), rng=rng,
                     skipped=state.skipped + bad, consec=jnp.where(ok, 0, state.consec + 1))
    metrics = dict(loss=stats.loss, ce=stats.aux["ce"], **clip, update_norm=u_norm,
                   param_norm=optax.global_norm(new.params), lr=schedule(_lr_step(state)),
                   skipped=new.skipped, consec=new.consec)
    for k, v in stats.aux.items():
      if k != "ce":
        metrics[k] = v
    # telemetry: per-group norms and BC statistics on every telemetry_every-th step (lax.cond)
    metrics.update(telemetry.maybe_compute(telemetry_every, state.step, tx, state.opt_state,
                                           state.params, stats, updates, new.params))
    return new, metrics

  return step


def make_eval_step(model: bridge.Model) -> Callable:
  """``eval_step(params, tokens [m, b, T+1]) -> [m, b]`` float32: each window's mean
  next-token cross-entropy, one microbatch of b windows at a time (``lax.scan`` over m, the
  training step's microbatch layout), so at most one microbatch's logits exist at once (with
  the fused head, ``model.loss_chunks`` slices of them). The caller averages the windows of
  the evaluation set (``scaleopt.train.data.EvalSet``), leaving out its padding."""

  def eval_step(params: PyTree, tokens: jax.Array) -> jax.Array:
    def one(carry, mb):
      return carry, model.window_ce(params, mb)

    return jax.lax.scan(one, None, tokens)[1]

  return eval_step
