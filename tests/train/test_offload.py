"""Shampoo's statistics in host memory through the trainer (one CPU device).

The trainer gives every optimizer-state leaf that ``tx.init`` puts in host memory a
``pinned_host`` sharding, so the jitted step keeps it there between steps and checkpoints
restore into it (also a run saved without offload: where the statistics live is a resumable
setting); the update is the same as with the statistics on the device. Std Shampoo on two
devices: tests/train/test_shampoo_blocks.py.
"""

import jax
import numpy as np
import pytest

from scaleopt.optim.shampoo_lib import ShampooFactors
from scaleopt.train import checkpoint, config as C, loop

from train_helpers import tiny_raw

SHAMPOO = {"name": "shampoo", "learning_rate": 3e-3,
           "schedule": {"kind": "constant", "warmup_steps": 0},
           "extra": {"block_size": 16, "root_every": 2, "stats_every": 2}}


def _raw(offload, name="shampoo", **run):
  opt = {**SHAMPOO, "name": name,
         "extra": {**SHAMPOO["extra"], "offload_statistics": offload}}
  return tiny_raw(model={"n_layers": 2}, optimizer=opt, data={"microbatches": 4},
                  run={"eval_every": 0, "tensorboard": False, **run})


def _factors(opt_state):
  is_f = lambda x: isinstance(x, ShampooFactors)
  return [x for x in jax.tree.leaves(opt_state, is_leaf=is_f) if is_f(x)]


def _kinds(factors):
  return {f: {getattr(x, f).sharding.memory_kind for x in factors} for f in ShampooFactors._fields}


HOST = {"L": {"pinned_host"}, "R": {"pinned_host"}, "PL": {"device"}, "PR": {"device"}}


def _same_state(got, want):
  """Per coordinate. The roots P_L, P_R relative to their largest entry: with damping 1e-6
  their near-null directions (entries ~ damping^(-1/4) = 31.6) turn float32 rounding
  differences of L, R into differences of ~1e-3 (one part in 3e4)."""
  flat = lambda t: jax.tree_util.tree_flatten_with_path(t)[0]
  assert [p for p, _ in flat(want)] == [p for p, _ in flat(got)]
  for (path, a), (_, b) in zip(flat(want), flat(got)):
    a, b, key = np.asarray(a), np.asarray(b), jax.tree_util.keystr(path)
    if key.endswith((".PL", ".PR")):
      assert np.abs(b - a).max() <= 1e-4 * np.abs(a).max(), key
    else:
      np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.slow  # a minute on CPU; offload's equality on 2 devices runs in test_shampoo_blocks
def test_a_run_saved_on_the_device_resumes_with_offloaded_statistics(tmp_path):
  """Shampoo-BC (the collector reads L, R on root steps) saved with its statistics on the
  device, resumed with them in host memory: the checkpoint restores into host memory and the
  state after the offloaded steps equals a run that kept them on the device."""
  device = tmp_path / "device"
  loop.train(C.from_dict(_raw(False, "shampoo_bc", steps=4, checkpoint_every=2)), device)
  run = tmp_path / "run"
  loop.train(C.from_dict(_raw(False, "shampoo_bc", steps=2, checkpoint_every=2)), run)
  cfg = C.from_dict(_raw(True, "shampoo_bc", steps=4, checkpoint_every=2))
  loop.train(cfg, run, resume=True)
  fns = loop.compile_fns(loop.setup(cfg))
  got = []
  for d in (device, run):
    ck = checkpoint.Checkpointer(d / "checkpoints", 2, False)
    state, _ = ck.restore_verified(4, checkpoint.abstract(fns.state_shape, fns.state_sh))
    ck.close()
    assert _kinds(_factors(state.opt_state)) == HOST
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.params)} == {"device"}
    got.append(jax.device_get(state))
  _same_state(got[1], got[0])
  assert float(np.abs(_factors(got[1].opt_state)[0].L).max()) > 0  # statistics were taken
