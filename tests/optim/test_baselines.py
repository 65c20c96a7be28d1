"""Lion, Adafactor and schedule-free AdamW: build's names follow optax's own implementations
step for step, map the config's keys as documented, and train the tiny model below the byte-
unigram entropy of the validation files (SOAP too, through the trainer)."""

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax import contrib

from scaleopt import optim

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "train"))
from train_helpers import tiny_raw, val_unigram_entropy  # noqa: E402

CONST = {"kind": "constant", "warmup_steps": 0}


def _params():
  k1, k2 = jax.random.split(jax.random.PRNGKey(0))
  return {"w": jax.random.normal(k1, (4, 3)), "b": jax.random.normal(k2, (3,))}


def _grads(i):
  p = _params()
  return jax.tree.map(lambda x: jnp.sin(x * (i + 1.3)) + 0.1 * i, p)


def _run(tx, steps=5):
  params = _params()
  state = tx.init(params)
  out = []
  for i in range(steps):
    u, state = tx.update(_grads(i), state, params)
    params = optax.apply_updates(params, u)
    out.append(params)
  return out, state


def _close(a, b, tol=1e-6):
  for x, y in zip(a, b):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=tol, atol=tol), x, y)


def _build(name, **kw):
  cfg = {"name": name, "learning_rate": 1e-2, "clip_norm": 0.0, "schedule": CONST, **kw}
  return optim.build(cfg)[0]


def test_lion_is_optax_lion():
  got, _ = _run(_build("lion", weight_decay=0.3, b1=0.8, b2=0.9))
  ref, _ = _run(optax.lion(1e-2, b1=0.8, b2=0.9, weight_decay=0.3))
  _close(got, ref)


def test_adafactor_is_optax_adafactor_with_decoupled_decay():
  """Without decay: optax.adafactor. With decay wd: theta_{t+1} - theta_t differs by exactly
  -lr(t) wd theta_t (AdamW's decoupled decay), also under a warmup schedule."""
  got, _ = _run(_build("adafactor", weight_decay=0.0, b1=0.5))
  ref, _ = _run(optax.adafactor(1e-2, momentum=0.5))
  _close(got, ref)
  sched = {"kind": "constant", "warmup_steps": 4}
  params = _params()
  g = _grads(2)
  for wd in (0.0, 0.5):
    tx = _build("adafactor", weight_decay=wd, schedule=sched)
    state = tx.init(params)
    for _ in range(2):  # lr(1) = 1e-2 * 1 / 4 on the second step
      u, state = tx.update(g, state, params)
    if wd == 0.0:
      u0 = u
  np.testing.assert_allclose(u["w"] - u0["w"], -0.5 * 1e-2 / 4 * params["w"], rtol=1e-5)


def test_schedule_free_is_optax_schedule_free_adamw():
  got, state = _run(_build("schedule_free_adamw", weight_decay=0.1, b1=0.8, b2=0.99))
  ref, ref_state = _run(contrib.schedule_free_adamw(1e-2, b1=0.8, b2=0.99, weight_decay=0.1))
  _close(got, ref)
  _close([optim.eval_params(state, got[-1])],
         [contrib.schedule_free_eval_params(ref_state, ref[-1])])
  # x differs from the trained y: eval_params must not be the identity here
  assert np.abs(optim.eval_params(state, got[-1])["w"] - got[-1]["w"]).max() > 1e-4


def test_schedule_free_masks_weight_decay():
  mask = {"w": True, "b": False}
  p = _params()
  tx = optim.build({"name": "schedule_free_adamw", "learning_rate": 1e-2, "clip_norm": 0.0,
                    "schedule": CONST, "weight_decay": 0.5}, wd_mask=mask)[0]
  ref = lambda wd: contrib.schedule_free_adamw(1e-2, weight_decay=wd)
  u = tx.update(_grads(0), tx.init(p), p)[0]
  np.testing.assert_allclose(u["w"], ref(0.5).update(_grads(0), ref(0.5).init(p), p)[0]["w"],
                             rtol=1e-6)
  np.testing.assert_allclose(u["b"], ref(0.0).update(_grads(0), ref(0.0).init(p), p)[0]["b"],
                             rtol=1e-6)


def test_eval_params_is_identity_without_schedule_free():
  p = _params()
  tx = _build("lion")
  assert optim.eval_params(tx.init(p), p) is p


@pytest.mark.parametrize("cfg, match", [
    ({"name": "schedule_free_adamw", "schedule": {"kind": "cosine"}},
     r"optimizer.schedule.kind='cosine'.*constant"),
    ({"name": "adafactor", "b2": 0.9}, r"optimizer.b2=0.9 is not used.*decay_rate"),
    ({"name": "lion", "eps": 1e-8}, r"optimizer.eps=1e-08 is not used"),
    ({"name": "lion", "extra": {"nesterov": True}}, r"optimizer.extra.nesterov"),
])
def test_bad_config_names_the_key(cfg, match):
  with pytest.raises(ValueError, match=match):
    optim.build(cfg)


# One end-to-end run per optimizer through the trainer (one compile each):
# the eval loss is the method's own (schedule-free's averaged point) on the validation files.
@pytest.mark.integration  # a whole training run: make test-integration
@pytest.mark.parametrize("name, lr", [("lion", 2e-3), ("adafactor", 5e-2),
                                      ("schedule_free_adamw", 1e-2), ("soap", 1e-2)])
def test_trains_below_unigram_entropy(name, lr, tmp_path):
  from scaleopt.train import config as C, loop
  raw = tiny_raw(run={"steps": 100, "log_every": 50, "eval_every": 0, "eval_tokens": 4096,
                      "checkpoint_every": 0, "tensorboard": False},
                 model={"d_model": 64, "n_layers": 1, "d_ff": 128},
                 data={"seq_len": 64, "batch_size": 16, "microbatches": 1},
                 optimizer={"name": name, "learning_rate": lr, "weight_decay": 0.1,
                            "schedule": {"kind": "constant", "warmup_steps": 10}})
  s = loop.train(C.from_dict(raw), tmp_path)
  h = val_unigram_entropy()
  assert s["final_eval_loss"] < h - 0.3, (name, s["final_eval_loss"], h)
