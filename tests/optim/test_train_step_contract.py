"""What the train step takes from the optimizer state: the lr metric follows the optax
schedule's own count (which does not advance on skipped steps), and skips are counted."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

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


# ------------------------------------------------------------------------------ the skip guard

def test_finite_updates_is_registered_for_adamw_alone_and_follows_eps_and_mu_dtype():
  assert so.finite_updates({"name": "adamw"})
  assert so.finite_updates({"name": "adamw", "extra": {"mu_dtype": "bfloat16"}})
  assert not so.finite_updates({"name": "adamw", "eps": 0.0})
  assert not so.finite_updates({"name": "adamw", "extra": {"mu_dtype": "float16"}})
  for name in so.names():
    if name != "adamw":
      assert not so.finite_updates({"name": name}), name


def _adamw_updates(cfg, grads_per_step):
  tx, _ = so.build(cfg)
  params = {"w": jnp.ones(len(grads_per_step[0]), jnp.float32)}
  state, out = tx.init(params), []
  for g in grads_per_step:
    u, state = tx.update({"w": jnp.asarray(g, jnp.float32)}, state, params)
    out.append(np.asarray(u["w"]))
  return out


def test_adamw_update_is_finite_for_every_gradient_with_a_finite_norm():
  """The claim ``finite_updates`` rests on, per coordinate: extreme finite gradients (the
  largest whose global norm is finite, denormals, zeros, sign flips, a coordinate that is
  zero for a while and then huge) give finite AdamW updates, in float32 and with a bfloat16
  first moment. The counter-examples are the configurations the rule excludes."""
  big = 1.8e19  # g^2 = 3.2e38: the global norm is still finite
  steps = [[big, 0.0, 1e-45, -1e-30, 1.0, 0.0],
           [-big, 0.0, -1e-45, 1e-30, 1e18, 0.0],
           [1e-38, 0.0, 0.0, 0.0, -1e18, big],
           [0.0, 0.0, 0.0, 0.0, 0.0, -1e-45]]
  for g in steps:
    assert np.isfinite(np.sqrt(np.sum(np.square(np.float64(g)))))
  for extra in ({}, {"mu_dtype": "bfloat16"}):
    cfg = {"name": "adamw", "learning_rate": 1e3, "clip_norm": 0.0, "weight_decay": 0.1,
           "schedule": {"kind": "constant"}, "extra": extra}
    assert so.finite_updates(cfg)
    for u in _adamw_updates(cfg, steps):
      assert np.all(np.isfinite(u)), (extra, u)
  zero = {"name": "adamw", "eps": 0.0, "clip_norm": 0.0, "schedule": {"kind": "constant"}}
  assert np.isnan(_adamw_updates(zero, [[0.0, 1.0]])[0][0])  # 0 / (0 + 0)
  half = {"name": "adamw", "clip_norm": 0.0, "schedule": {"kind": "constant"},
          "extra": {"mu_dtype": "float16"}}
  # the stored first moment overflows (1e5 > 65504); the next update is not finite
  assert not np.all(np.isfinite(_adamw_updates(half, [[1e6, 1.0], [1e6, 1.0]])[1]))


def _nan_on_large_gradients() -> optax.GradientTransformation:
  def update(g, state, params=None):
    del params
    return jax.tree.map(lambda x: jnp.where(jnp.abs(x) > 1.0, jnp.nan, -0.1 * x), g), state

  return optax.with_extra_args_support(
      optax.GradientTransformation(lambda p: optax.EmptyState(), update))


def test_the_update_check_skips_a_non_finite_update_from_a_finite_gradient():
  """An optimizer whose update fails on its own (finite loss and gradient): with the update
  check the step is skipped and the parameters stay; without it (what ``finite_updates``
  allows only for optimizers that cannot fail) the NaN would be applied."""
  model = _Model()
  tx = _nan_on_large_gradients()
  spec = so.collector_spec(tx)
  tokens = jnp.full((1, 3), 5.0)  # finite loss 48; gradient 2 (w - mb) = -8, beyond 1
  results = {}
  for check in (True, False):
    step = jax.jit(step_lib.make_train_step(model, tx, spec, lambda t: 1.0,
                                            check_update=check))
    state = step_lib.init_state(model, tx, 0)
    new, metrics = step(state, {"tokens": tokens})
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["grad_norm"]))
    results[check] = (new, metrics)
  new, metrics = results[True]
  assert int(new.skipped) == 1 and int(metrics["consec"]) == 1
  np.testing.assert_array_equal(new.params["w"], np.ones(3))
  new, _ = results[False]
  assert int(new.skipped) == 0 and np.all(np.isnan(np.asarray(new.params["w"])))


def test_adamw_without_the_update_check_is_the_same_step_bit_for_bit():
  """Dropping the check changes which passes XLA runs, never the result: the parameters,
  moments and metrics of healthy and skipped steps equal those of the checked step."""
  cfg = {"name": "adamw", "learning_rate": 0.1, "clip_norm": 1.0,
         "schedule": {"kind": "cosine", "warmup_steps": 2, "total_steps": 10}}
  tx, spec = so.build(cfg)
  schedule = so.make_schedule(cfg["schedule"], 0.1)
  model = _Model()
  runs = {}
  for check in (True, False):
    step = jax.jit(step_lib.make_train_step(model, tx, spec, schedule, check_update=check))
    state, seen = step_lib.init_state(model, tx, 0), []
    for i, bad in enumerate((False, False, True, False, False)):
      tokens = jnp.full((2, 3), -1.0 if bad else 0.3 + 0.1 * i)
      state, metrics = step(state, {"tokens": tokens})
      seen.append(jax.device_get(metrics))
    runs[check] = (jax.device_get(state), seen)
  (a, ma), (b, mb) = runs[True], runs[False]
  assert int(a.skipped) == int(b.skipped) == 1
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(x, y)
  for x, y in zip(ma, mb):
    assert x.keys() == y.keys()
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)
