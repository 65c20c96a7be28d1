"""Every-N work picked by the host (``scaleopt.optim.phases``) against the device branch.

Shampoo with statistics every 2 and roots every 3 steps, run as one jitted update with
``lax.cond`` and as updates traced under ``phases.static`` with the outcomes the step count
gives: the same update per coordinate at every step; the static trace holds no conditional.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from scaleopt import optim
from scaleopt.optim import phases

ROOT, STATS = 3, 2


def _problem():
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  params = {"w": jax.random.normal(k1, (24, 40)), "b": jnp.zeros((40,)),
            "s": jax.random.normal(k2, (2, 16, 24))}
  grads = [jax.tree.map(lambda p, i=i: jax.random.normal(jax.random.fold_in(k3, i), p.shape),
                        params) for i in range(7)]
  tx = optim.shampoo(1e-2, block_size=16, root_every=ROOT, stats_every=STATS, min_dim=8,
                     root_method="eigh")
  return params, grads, tx


def test_schedules_are_recorded_from_one_device_trace():
  params, grads, tx = _problem()
  with phases.record() as found:
    jax.eval_shape(tx.update, grads[0], tx.init(params), params)
  assert found == {phases.Schedule("count", ROOT), phases.Schedule("count", STATS)}


def test_host_outcomes_give_the_device_branch_update_per_coordinate():
  params, grads, tx = _problem()
  device = jax.jit(tx.update)
  programs = {}  # one per combination of outcomes

  def program(outcomes):
    key = tuple(sorted(outcomes.items()))
    if key not in programs:
      def host(g, st, p):
        with phases.static(outcomes):
          return tx.update(g, st, p)
      programs[key] = jax.jit(host)
    return programs[key]

  st_d = st_h = tx.init(params)
  for step, g in enumerate(grads):
    outcomes = {phases.Schedule("count", n): step % n == 0 for n in (ROOT, STATS)}
    host = program(outcomes)
    assert "conditional" not in host.lower(g, st_h, params).as_text(dialect="hlo")
    u_d, st_d = device(g, st_d, params)
    u_h, st_h = host(g, st_h, params)
    for a, b in zip(jax.tree.leaves((u_d, st_d)), jax.tree.leaves((u_h, st_h))):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7,
                                 err_msg=f"step {step}")
    params = optax.apply_updates(params, u_d)


def test_cond_on_a_python_bool_traces_only_its_branch():
  calls = []
  out = phases.cond(True, lambda x: calls.append("t") or x + 1,
                    lambda x: calls.append("f") or x, jnp.float32(1))
  assert calls == ["t"] and float(out) == 2.0
  assert isinstance(phases.due(jnp.int32(5), 5), jax.Array)  # no context: on the device
  with phases.static({phases.Schedule("count", 5): False}):
    assert phases.due(jnp.int32(5), 5) is False
    assert not isinstance(phases.due(jnp.int32(5), 7), bool)  # not given: on the device
