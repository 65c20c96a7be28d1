"""A plain ``optax.clip_by_global_norm`` in front of a bias-corrected transform clips the
numerator it feeds the transform but none of the statistics ``collect`` gathered: each
bias-corrected alias refuses that chain with one error naming ``so.clip_by_global_norm``,
and takes the scaleopt clip (consistent or numerator-only) in the same place."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scaleopt.optim as so

M, VOCAB, DIM = 4, 6, 8


def _problem():
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(DIM, VOCAB)), jnp.float32),
            "b": jnp.zeros(VOCAB, jnp.float32)}
  mbs = {"x": jnp.asarray(rng.normal(size=(M, 5, DIM)), jnp.float32),
         "y": jnp.asarray(rng.integers(0, VOCAB, size=(M, 5)), jnp.int32)}
  return params, mbs


def _logits(p, mb):
  return mb["x"] @ p["w"] + p["b"], jnp.ones(mb["y"].shape, jnp.float32)


def _loss(p, mb):
  logits, _ = _logits(p, mb)
  return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, mb["y"])), {}


ALIASES = {
    "adamw_bc": lambda: so.adamw_bc(1e-3),
    "sophia_bc": lambda: so.sophia_bc(1e-3, k=1),
    "shampoo_bc": lambda: so.shampoo_bc(1e-3, block_size=4, min_dim=2),
    "soap_bc": lambda: so.soap_bc(1e-3),
}


def _step(tx):
  """One jitted step (collect and update in one trace) from fresh state; returns the update."""
  params, mbs = _problem()
  state = tx.init(params)

  @jax.jit
  def step(params, state):
    stats = so.collect(_loss, params, mbs, state, key=jax.random.key(0), logits_fn=_logits)
    return tx.update(stats.numerator, state, params, bc_stats=stats)[0]

  return step(params, state)


@pytest.mark.parametrize("name", sorted(ALIASES))
def test_plain_optax_clip_before_a_bias_corrected_alias_is_refused(name):
  tx = optax.chain(optax.clip_by_global_norm(0.1), ALIASES[name]())
  with pytest.raises(ValueError, match=r"so\.clip_by_global_norm") as err:
    _step(tx)
  assert "optax.clip_by_global_norm" in str(err.value)
  assert str(err.value).count("\n") == 0  # one line


@pytest.mark.parametrize("numerator_only", [False, True])
@pytest.mark.parametrize("name", sorted(ALIASES))
def test_scaleopt_clip_in_the_same_place_trains(name, numerator_only):
  clip = so.clip_by_global_norm(0.1, numerator_only=numerator_only)
  u = _step(optax.chain(clip, ALIASES[name]()))
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(u))
  assert sum(float(jnp.sum(jnp.abs(x))) for x in jax.tree.leaves(u)) > 0


def test_the_guard_ignores_standard_modes_and_steps_without_bc_stats():
  """``mode='std'`` is optax's Adam: a plain clip in front gives optax's maths (the guard only
  covers the forms whose statistics come from ``collect``); without ``bc_stats`` no guard."""
  params, _ = _problem()
  g = jax.tree.map(jnp.ones_like, params)
  tx = optax.chain(optax.clip_by_global_norm(0.1), so.scale_by_adam_bc(mode="std"))
  ref = optax.chain(optax.clip_by_global_norm(0.1), optax.scale_by_adam(0.9, 0.95, 1e-8))
  u = tx.update(g, tx.init(params))[0]
  u_ref = ref.update(g, ref.init(params))[0]
  for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(u_ref)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
