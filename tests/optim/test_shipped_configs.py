"""Every shipped optimizer config trains: the tiny model beats the byte-unigram entropy.

Each optimizer section of ``configs/optim/*.yaml`` and ``configs/train/*.yaml`` (identical
sections once; the trainer configs under ``-m slow``) trains a small tiny-preset model on the embedded corpus through the real train
step (``scaleopt.train.step``), with the config's learning rate, betas, weight decay, clip and
``extra`` unchanged; only the schedule is fitted to the short run (its total steps, and a
warm-up of at most a fifth of them). The held-out loss must end below the byte-unigram entropy
of the validation files, computed directly from their bytes.
"""

import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from scaleopt import models
from scaleopt.train import bridge, data
from scaleopt.train import step as step_lib

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "train"))
from train_helpers import val_unigram_entropy  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS, SEQ, BATCH, M = 200, 32, 16, 2
# one layer of width 128: wide enough that the large-model learning rates (6e-4) reach the
# unigram entropy within STEPS (a narrower model needs ~5x the steps at that rate)
MODEL = {"preset": "tiny", "dtype": "float32", "d_model": 128, "n_layers": 1, "d_ff": 128}


def _sections():
  out = {}
  for path in sorted((ROOT / "configs" / "optim").glob("*.yaml")) + sorted(
      (ROOT / "configs" / "train").glob("*.yaml")):
    opt = yaml.safe_load(path.read_text()).get("optimizer")
    if opt is None:
      continue
    key = json.dumps(opt, sort_keys=True)
    out.setdefault(key, (f"{path.parent.name}/{path.stem}", opt))
  # configs/optim runs fast; the trainer configs (mostly the same optimizers at other learning
  # rates) run with the slow tests
  return [pytest.param(n, o, id=n, marks=() if n.startswith("optim/") else pytest.mark.slow)
          for n, o in out.values()]


SECTIONS = _sections()


def _fit_schedule(opt: dict) -> dict:
  sched = dict(opt.get("schedule") or {})
  sched["total_steps"] = STEPS
  sched["warmup_steps"] = min(sched.get("warmup_steps", 0), STEPS // 5)
  return dict(opt, schedule=sched)


@pytest.mark.parametrize("name,opt", SECTIONS)
def test_shipped_optimizer_config_trains_below_unigram_entropy(name, opt):
  model = bridge.make_model(MODEL)
  wd_mask = lambda p: models.weight_decay_mask(p, model.wd_policy)
  tx, spec, schedule = bridge.build_optimizer(_fit_schedule(opt), wd_mask,
                                              bridge.sparse_filter)
  train_w, _ = data.open_split("embedded", None, "train", SEQ)
  val_w, _ = data.open_split("embedded", None, "val", SEQ)
  m = max(M, 2 if spec.layout in ("loo", "symmetric") or spec.var_of else 1)
  it = data.Batches(train_w, BATCH, m, groups=spec.num_groups,
                    rolling_b=spec.layout == "rolling_b", seed=0)
  state = step_lib.init_state(model, tx, 0)
  train_step = jax.jit(step_lib.make_train_step(model, tx, spec, schedule))
  for _ in range(STEPS):
    state, metrics = train_step(state, jax.tree.map(jnp.asarray, it.next()))
  eval_step = jax.jit(step_lib.make_eval_step(model))
  es = data.eval_set(val_w, 4 * BATCH * SEQ)
  ev = float(es.mean(eval_step(state.params, jnp.asarray(es.microbatches(BATCH)[0]))))
  h = val_unigram_entropy()
  assert int(state.skipped) == 0, name
  assert ev < h, (name, ev, h)
