"""Per-layer optimizer telemetry: group norms, BC statistics, and where they are written."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from scaleopt import optim
from scaleopt.train import bridge, config as C, loop, metrics as M, telemetry as T
from train_helpers import tiny_raw

ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")

MODEL = {"preset": "tiny", "dtype": "float32", "d_model": 16, "n_layers": 3, "d_ff": 32,
         "n_heads": 2, "n_kv_heads": 1}


def _params():
  model = bridge.make_model(MODEL)
  return model, model.init(jax.random.PRNGKey(0))


def test_group_norms_per_layer_and_role():
  _, params = _params()
  got = {k: float(v) for k, v in T.group_sum(params, params).items()}
  want: dict = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
    names = [p.key for p in path]
    x = np.asarray(leaf, np.float64)
    if names[0] == "blocks":  # [n_layers, ...] stacked (period 1: block b0 is every layer)
      for layer in range(x.shape[0]):
        g = f"layer{layer}.{names[2]}"
        want[g] = want.get(g, 0.0) + float(np.sum(x[layer] ** 2))
    else:
      want[names[0]] = want.get(names[0], 0.0) + float(np.sum(x ** 2))
  assert set(got) == set(want) and {"layer2.attn", "layer0.mlp", "embed"} <= set(got)
  for g in want:
    np.testing.assert_allclose(got[g], want[g], rtol=1e-5, err_msg=g)


def _stats_and_update(opt_section, seed=0):
  model, params = _params()
  cfg = optim.OptimizerConfig.from_dict(opt_section)
  tx, _ = optim.build(cfg)
  state = tx.init(params)
  toks = jax.random.randint(jax.random.PRNGKey(seed), (2, 4, 17), 0, 256)  # m=2 microbatches
  stats = jax.jit(lambda: optim.collect(model.loss_fn, params, toks, state))()
  updates, _ = jax.jit(lambda: tx.update(stats.numerator, state, params, bc_stats=stats))()
  return tx, state, params, stats, updates


@pytest.mark.integration
def test_bc_plugin_is_adam_and_clamped_coordinates_are_zero_updates():
  """mode=inv on one group: the plug-in (no variance correction) is Adam on the same mean
  gradient, so optax.adam is an independent reference for u0; without weight decay a clamped
  coordinate (inverse clamped at 0) has an update of exactly 0."""
  sec = {"name": "adamw_bc", "learning_rate": 1e-2, "clip_norm": 1e9, "weight_decay": 0.0,
         "b1": 0.9, "b2": 0.5, "eps": 1e-8, "schedule": {"kind": "constant"},
         "extra": {"mode": "inv"}}
  tx, state, params, stats, updates = _stats_and_update(sec)
  adam = optax.adam(1e-2, b1=0.9, b2=0.5, eps=1e-8)
  u_adam, _ = adam.update(stats.full, adam.init(params), params)
  out = jax.jit(lambda: T.compute(tx, state, params, stats, updates, params))()
  like = params
  diff = T.group_sum(jax.tree.map(lambda a, b: a - b, updates, u_adam), like)
  plug = T.group_sum(u_adam, like)
  zero = T.group_sum(jax.tree.map(lambda u, a: ((u == 0) & (a != 0)).astype(jnp.float32),
                                  updates, u_adam), like, lambda x: x)
  size = T.group_sum(params, like, jnp.ones_like)
  clamped_any = False
  for g in plug:
    np.testing.assert_allclose(out[f"bc_correction/{g}"], np.sqrt(diff[g] / plug[g]),
                               rtol=1e-4, err_msg=g)
    # exact but for coordinates at the clamp boundary (the variance of g_bar^2 is quadratic
    # in Var(g_bar), so a 1% larger variance can unclamp a barely clamped coordinate)
    np.testing.assert_allclose(out[f"bc_clamped/{g}"], zero[g] / size[g], atol=0.003,
                               err_msg=g)
    clamped_any |= float(zero[g]) > 0
    assert 0.0 < float(out[f"bc_correction/{g}"]) < 1.0
  assert clamped_any  # m = 2 on the first step: noisy coordinates clamp (not vacuous)
  # the variance ratio of the mean gradient: Var_hat(g_bar) / g_bar^2 from the same microbatches
  grads = jax.vmap(lambda mb: jax.grad(lambda p: bridge.make_model(MODEL).loss_fn(p, mb)[0])(
      params))(jax.random.randint(jax.random.PRNGKey(0), (2, 4, 17), 0, 256))
  var = jax.tree.map(lambda g: jnp.var(g, axis=0, ddof=1) / 2, grads)
  mean = jax.tree.map(lambda g: jnp.mean(g, axis=0), grads)
  num, den = T.group_sum(var, like, lambda x: x), T.group_sum(mean, like)
  for g in num:
    np.testing.assert_allclose(out[f"bc_var_ratio/{g}"], num[g] / den[g], rtol=1e-3,
                               err_msg=g)


@pytest.mark.integration  # the grouped-norm test above stays in the fast tier
def test_plain_adamw_has_norms_only():
  tx, state, params, stats, updates = _stats_and_update(
      {"name": "adamw", "learning_rate": 1e-3, "schedule": {"kind": "constant"}})
  out = jax.jit(lambda: T.compute(tx, state, params, stats, updates, params))()
  assert out and all(k.split("/")[0] in T.NORMS for k in out)


@pytest.mark.integration
def test_run_writes_telemetry_every_n_steps_to_jsonl_and_tensorboard(tmp_path):
  raw = tiny_raw(run={"steps": 4, "log_every": 1, "telemetry_every": 2, "eval_every": 0,
                      "checkpoint_every": 0, "async_checkpoint": False},
                 model={"n_layers": 2},
                 optimizer={"name": "adamw_bc", "extra": {"mode": "full", "crossfit": "loo"},
                            "schedule": {"kind": "cosine", "warmup_steps": 1}})
  loop.train(C.from_dict(raw), tmp_path)
  rows = M.read_metrics(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in rows] == [1, 2, 3, 4]
  for r in rows:
    tel = {k for k in r if T.is_telemetry_key(k)}
    assert "telemetry" not in r
    if r["step"] % 2:
      assert not tel
      continue
    assert {"grad_norm/layer1.attn", "update_norm/layer0.mlp", "param_norm/embed",
            "bc_correction/layer0.attn", "bc_clamped/layer1.mlp"} <= tel
    for q in ("grad_norm", "update_norm", "param_norm"):  # groups partition the parameters
      total = sum(r[k] ** 2 for k in tel if k.startswith(q + "/"))
      np.testing.assert_allclose(total, r[q] ** 2, rtol=1e-4)
  acc = ea.EventAccumulator(str(tmp_path / "tb"), size_guidance={ea.SCALARS: 0})
  acc.Reload()
  assert [e.step for e in acc.Scalars("bc_correction/layer0.attn")] == [2, 4]


def test_telemetry_every_must_be_a_multiple_of_log_every():
  with pytest.raises(C.ConfigError, match="run.telemetry_every = 3: must be a multiple"):
    C.from_dict(tiny_raw(run={"log_every": 2, "telemetry_every": 3}))
