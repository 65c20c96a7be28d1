"""Shared helpers for tests/models (unique module name: test dirs have no __init__.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from scaleopt import models


def tiny(**kw) -> models.ModelConfig:
  """The ``tiny`` preset in float32 with XLA attention (exact comparisons on CPU)."""
  return models.get_preset("tiny").replace(**{"dtype": "float32", "attention_impl": "xla", **kw})


def tiny_moe(**kw) -> models.ModelConfig:
  return models.get_preset("tiny-moe").replace(
      **{"dtype": "float32", "attention_impl": "xla", **kw})


def tokens(cfg, b=2, t=16, seed=1):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, cfg.vocab_size)


def randomize_scales(params, seed=0, spread=0.5):
  """Multiplies every scale-vector parameter (gamma, beta, alpha) by exp(spread * N(0, 1))."""
  roles = models.param_roles(params)
  leaves, treedef = jax.tree.flatten(params)
  keys = list(jax.random.split(jax.random.key(seed), len(leaves)))
  keys = jax.tree.unflatten(treedef, keys)

  def f(x, role, k):
    if role.endswith("scale"):
      return x * jnp.exp(spread * jax.random.normal(k, x.shape))
    return x

  return jax.tree.map(f, params, roles, keys)


def n_params(tree) -> int:
  return int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))



@functools.lru_cache(maxsize=None)
def jit_apply(cfg: models.ModelConfig):
  """A cached ``jax.jit`` of ``functional(cfg)[1]`` (one compile per config and shape)."""
  return jax.jit(models.functional(cfg)[1])


def init_params(cfg: models.ModelConfig, seed: int = 0):
  """Eager init (jit-compiling the init's threefry is slower than running it on CPU)."""
  return models.functional(cfg)[0](jax.random.key(seed))


def rel_err(a, b) -> float:
  """Largest per-coordinate difference relative to the reference's largest magnitude."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def vjp_random(fn, *args):
  """(fn(*args), cotangents of a fixed random cotangent of the output, per input)."""
  out, pull = jax.vjp(fn, *args)
  ct = jax.random.normal(jax.random.key(7), out.shape, jnp.float32).astype(out.dtype)
  return out, pull(ct)
