"""The momentum's input in Sophia's and Shampoo's ``ab`` layout (``ab_numerator``): the
default takes group A on refresh steps and all 2m microbatches on the others; ``"a"`` (the
authors' code) takes group A on every step. Checked against the microbatch means (the
gradients are the microbatch data)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scaleopt.optim as so

M = 8  # 2m microbatches: A = first 4, B = last 4


def _numerators(tx, gs, logits_fn=None):
  params = {"w": jnp.zeros(gs.shape[1:], jnp.float32)}
  loss = lambda p, mb: (jnp.sum(p["w"] * mb["g"]), {})
  st = tx.init(params)
  out = []
  for t in range(2):  # refresh at count 0, none at count 1 (k = root_every = 2)
    mbs = {"g": jnp.asarray(gs, jnp.float32), "x": jnp.ones((M, 3, gs.shape[1]))}
    stats = so.collect(loss, params, mbs, st, key=jax.random.PRNGKey(t), logits_fn=logits_fn)
    _, st = tx.update(stats.numerator, st, params, bc_stats=stats)
    out.append(np.asarray(stats.numerator["w"], np.float64))
  return out


def _logits(p, mb):
  return mb["x"] @ p["w"], jnp.ones(mb["x"].shape[:-1])


@pytest.mark.parametrize("opt", ["sophia", "shampoo"])
@pytest.mark.parametrize("ab_numerator", ["all_off_refresh", "a"])
def test_ab_numerator(opt, ab_numerator):
  gs = np.random.default_rng(0).normal(size=(M, 4, 3))
  if opt == "sophia":
    tx = so.sophia_bc(1e-3, k=2, mode="cf", crossfit="ab", ab_numerator=ab_numerator)
    nums = _numerators(tx, gs, _logits)
  else:
    tx = so.shampoo_bc(1e-3, root_every=2, mode="cf", crossfit="ab", block_size=8,
                       ab_numerator=ab_numerator)
    nums = _numerators(tx, gs)
  a, both = gs[:M // 2].mean(0), gs.mean(0)
  np.testing.assert_allclose(nums[0], a, rtol=1e-5, atol=1e-7)  # refresh step: A in both
  np.testing.assert_allclose(nums[1], a if ab_numerator == "a" else both, rtol=1e-5, atol=1e-7)


def test_ab_numerator_is_checked():
  with pytest.raises(ValueError, match="ab_numerator='b' is not allowed"):
    so.sophia_bc(1e-3, ab_numerator="b")
  with pytest.raises(ValueError, match="ab_numerator='b' is not allowed"):
    so.shampoo_bc(1e-3, ab_numerator="b")
