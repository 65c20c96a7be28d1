"""configs/optim/paper/*.yaml: the paper's Table 2 optimizers as its code ran them. Each ships
with a comment naming its source, carries the paper's values, builds through the trainer's
path and trains one step of a tiny model (finite loss, every tensor moved)."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from scaleopt.train import bridge, data
from scaleopt.train import step as step_lib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "configs" / "optim" / "paper"
MODEL = {"preset": "tiny", "dtype": "float32", "d_model": 32, "n_layers": 1, "d_ff": 64}

# the paper's values (its Table 2 rows as the authors' scripts run them), one entry per config
PAPER = {
    "adamw_loo": dict(name="adamw_bc", learning_rate=9e-4, clip_numerator_only=True,
                      all_dense=False, b1=0.9, b2=0.95, weight_decay=0.1,
                      schedule=dict(warmup_steps=20, min_lr_ratio=0.2),
                      extra=dict(mode="full", crossfit="loo", sparse_lr_ratio=6e-4 / 9e-4)),
    "sophia_g": dict(name="sophia_bc", learning_rate=2e-5, clip_numerator_only=True,
                     b1=0.965, b2=0.99, eps=1e-12, weight_decay=0.1,
                     schedule=dict(warmup_steps=20, min_lr_ratio=0.0),
                     extra=dict(mode="full", k=5, rho=0.05, clip=3.0,
                                denominator_scale="reference")),
    "shampoo": dict(name="shampoo_bc", learning_rate=6e-4, clip_numerator_only=True,
                    b1=0.9, b2=0.95, weight_decay=0.1,
                    schedule=dict(warmup_steps=20, min_lr_ratio=0.0),
                    extra=dict(mode="full", graft="none", root_every=5, max_dim=4864,
                               damping=1e-6)),
}


def _load(name):
  path = ROOT / f"{name}.yaml"
  text = path.read_text()
  return text, yaml.safe_load(text)["optimizer"]


def _sub(want, got, where=""):
  for k, v in want.items():
    if isinstance(v, dict):
      _sub(v, got[k], f"{where}{k}.")
    elif isinstance(v, float):
      assert got[k] == pytest.approx(v, rel=1e-9), f"{where}{k}"
    else:
      assert got[k] == v, f"{where}{k}"


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_config_ships_with_its_source_and_values(name):
  text, opt = _load(name)
  assert text.startswith("# The paper's Table 2") and "arXiv 2605.20756" in text
  _sub(PAPER[name], opt)


@pytest.mark.integration  # a whole training run: make test-integration
@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_config_trains_one_step(name):
  _, opt = _load(name)
  model = bridge.make_model(MODEL)
  tx, spec, schedule = bridge.build_optimizer(opt, None, bridge.sparse_filter)
  train_w, _ = data.open_split("embedded", None, "train", 16)
  it = data.Batches(train_w, 4, 2, groups=spec.num_groups,
                    rolling_b=spec.layout == "rolling_b", seed=0)
  state = step_lib.init_state(model, tx, 0)
  train_step = jax.jit(step_lib.make_train_step(model, tx, spec, schedule))
  new, metrics = train_step(state, jax.tree.map(jnp.asarray, it.next()))
  new, metrics = train_step(new, jax.tree.map(jnp.asarray, it.next()))  # past the 0-lr step
  assert np.isfinite(float(metrics["loss"])) and int(new.skipped) == 0
  moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(state.params),
                                                    jax.tree.leaves(new.params))]
  assert all(moved), name
