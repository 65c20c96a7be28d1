"""What the train step takes from the optimizer state: the lr metric follows the optax
schedule's own count (which does not advance on skipped steps), and skips are counted."""

import jax
import jax.numpy as jnp
import numpy as np

import scaleopt.optim as so
from scaleopt.train import step as step_lib


class _Model:
  """The two methods the train step uses; a negative batch entry makes the loss non-finite."""

  def init(self, rng):
    del rng
    return {"w": jnp.ones(3)}

  def loss_fn(self, p, mb):
    l = jnp.sum((p["w"] - mb) ** 2)
    return l + jnp.where(jnp.any(mb < 0), jnp.nan, 0.0), {"ce": l}

  logits_fn = None


def test_lr_metric_follows_the_schedule_count_across_a_skipped_step():
  cfg = {"name": "adamw", "learning_rate": 1.0, "clip_norm": 0.0,
         "schedule": {"kind": "cosine", "warmup_steps": 4, "total_steps": 10}}
  tx, spec = so.build(cfg)
  schedule = so.make_schedule(cfg["schedule"], 1.0)
  model = _Model()
  step = jax.jit(step_lib.make_train_step(model, tx, spec, schedule))
  state = step_lib.init_state(model, tx, 0)
  lrs = []
  for bad in (False, True, False, False):
    tokens = jnp.full((1, 3), -1.0 if bad else 0.5)
    state, metrics = step(state, {"tokens": tokens})
    lrs.append(float(metrics["lr"]))
  # warm-up 0, 0.25, 0.5, ...: the skipped step (index 1) does not advance the schedule
  np.testing.assert_allclose(lrs, [0.0, 0.25, 0.25, 0.5], atol=1e-7)
  assert int(state.skipped) == 1 and int(state.step) == 4


class _ModelWithIdleTensor(_Model):
  def init(self, rng):
    return {"w": jnp.ones(3), "idle": jnp.zeros(2)}  # the loss never reads "idle"


def test_per_tensor_nonfinite_skip_counts_as_a_skipped_step():
  """eps = 0 and a tensor with zero gradient: its BC update is 0 * inf = NaN while the loss,
  the gradient norm and the (zeroed) update norm are finite. The transform's per-tensor skip
  must reach the step guard: the step is skipped, counted, and the parameters stay."""
  cfg = {"name": "adamw_bc", "learning_rate": 1e-2, "clip_norm": 0.0, "eps": 0.0,
         "extra": {"mode": "cf", "crossfit": "ab"}, "schedule": {"kind": "constant"}}
  tx, spec = so.build(cfg)
  model = _ModelWithIdleTensor()
  step = jax.jit(step_lib.make_train_step(model, tx, spec, lambda t: 1e-2))
  state = step_lib.init_state(model, tx, 0)
  tokens = jnp.asarray([[0.5, 0.4, 0.3], [0.1, 0.2, 0.6], [0.7, 0.1, 0.0], [0.2, 0.9, 0.4]])
  new, metrics = step(state, {"tokens": tokens})
  assert int(new.skipped) == 1 and int(metrics["skipped"]) == 1
  np.testing.assert_array_equal(new.params["w"], state.params["w"])
  assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
