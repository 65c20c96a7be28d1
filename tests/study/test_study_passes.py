"""`gradient_passes` in results.csv against the forward+backward passes a step really executes.

The reference counts them at run time: ``jax.debug.callback`` in the loss (true-label
gradients) and in the logits function (Sophia's Gauss-Newton pass) fires once per executed
microbatch, and ``lax.cond`` runs only the branch taken, so refresh and non-refresh steps count
what they do, not what was traced.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scaleopt.optim as so
from scaleopt.study import engines

M, POS, F, C, K, STEPS = 4, 8, 3, 5, 3, 6  # microbatches of 1 sequence; 2 refreshes in 6 steps


class _Data:
  batch_size = M  # sequences per group (one per microbatch)


class _Cfg:
  data = _Data


def _executed(name: str, extra: dict) -> tuple[float, float]:
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(0, 0.5, (F, C)), jnp.float32)}
  tx, spec = so.build({"name": name, "learning_rate": 1e-2, "extra": extra})
  groups = spec.num_groups if spec.layout == "ab" else 1
  calls = []

  def logits_fn(p, mb):  # Sophia's Gauss-Newton pass: one executed microbatch per call
    jax.debug.callback(lambda: calls.append(1))
    return mb["x"] @ p["w"], jnp.ones(mb["y"].shape, jnp.float32)

  def loss_fn(p, mb):  # a true-label gradient: one executed microbatch per call
    jax.debug.callback(lambda: calls.append(1))
    z = mb["x"] @ p["w"]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(z), mb["y"][..., None], -1)[..., 0]
    return nll.mean(), {}

  def batch(i):
    r = np.random.default_rng(i)
    return {"x": jnp.asarray(r.normal(size=(M * groups, POS, F)), jnp.float32),
            "y": jnp.asarray(r.integers(0, C, (M * groups, POS)))}

  @jax.jit
  def step(p, st, key, mbs, b_mbs):
    stats = so.collect(loss_fn, p, mbs, st, key=key, logits_fn=logits_fn,
                       b_microbatches=b_mbs if spec.layout == "rolling_b" else None)
    u, st = tx.update(stats.numerator, st, p, bc_stats=stats)
    return optax.apply_updates(p, u), st

  st = tx.init(params)
  for t in range(STEPS):
    params, st = step(params, st, jax.random.PRNGKey(t), batch(t), batch(t + 1))
  jax.block_until_ready(params)
  jax.effects_barrier()
  return float(len(calls)), engines.gradient_passes(_Cfg, spec, STEPS)


@pytest.mark.parametrize("name,extra", [
    ("sophia", {"k": K}),                     # std Sophia: the GNB pass is one more sweep
    ("sophia_bc", {"k": K, "mode": "full", "crossfit": "ab"}),  # GNB takes group B's place
    ("sophia_bc", {"k": K, "mode": "full", "crossfit": "rolling_b"}),
    ("adamw_bc", {}),                         # LOO, default: one sweep, folds on stored g_r
    ("adamw_bc", {"loo_passes": 2}),          # LOO, two sweeps
], ids=["sophia_std", "sophia_ab", "sophia_rolling_b", "loo_default", "loo_two_pass"])
def test_gradient_passes_are_the_passes_executed(name, extra):
  executed, reported = _executed(name, extra)
  assert reported == executed
  if name == "adamw_bc":  # the LOO sweeps themselves: M microbatches, once or twice a step
    assert executed == STEPS * M * extra.get("loo_passes", 1)
