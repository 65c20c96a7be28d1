"""Per-microbatch curvature estimators for Sophia: Gauss-Newton-Bartlett and Hutchinson.

The logits interface. A model exposes

    logits_fn(params, mb) -> (logits [..., V], mask [...])

where ``mask`` (0/1 or bool, broadcastable to ``logits.shape[:-1]``) marks the supervised
positions. This is all the GNB estimator needs; it does not read the labels of ``mb``.

Gauss-Newton-Bartlett (Sophia-G; Liu et al. 2023, Algorithm 2). For cross-entropy on a
softmax the Gauss-Newton matrix equals the Fisher, and Bartlett's identity gives it as the
second moment of the gradient against labels *sampled from the model itself*:

    y_hat_i ~ softmax(stop_grad(logits_i)),   L_hat = (1/n) sum_{i supervised} CE(logits_i, y_hat_i)
    E[ n * grad L_hat (.) grad L_hat ] = (1/n) sum_i diag(J_i^T (diag(p_i) - p_i p_i^T) J_i)

(the mean Gauss-Newton diagonal per supervised position, because the per-position sampled
gradients have mean zero and are independent given theta). ``gnb_grad`` returns grad L_hat for
one microbatch, with one forward pass and one VJP (the cotangent of the logits is
(p - onehot(y_hat)) * mask / n), and n, the number of supervised positions.

Hutchinson (Sophia-H): x = z (.) (H z) with Rademacher z; E[x] = diag(H) of the microbatch loss.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

PyTree = Any
LogitsFn = Callable[[PyTree, PyTree], tuple[jax.Array, jax.Array]]


def gnb_grad(logits_fn: LogitsFn, params: PyTree, mb: PyTree, key: jax.Array
             ) -> tuple[PyTree, jax.Array, jax.Array]:
  """Sampled-label gradient of one microbatch.

  Returns:
    (g, n, s): g = grad_theta (1/n) sum_{supervised i} CE(logits_i, y_hat_i) in float32,
    n = number of supervised positions (>= 1), s = number of sequences (leading axis of
    the logits).
  """
  logits, vjp_fn, mask = jax.vjp(lambda p: logits_fn(p, mb), params, has_aux=True)
  lf = logits.astype(jnp.float32)
  y = jax.random.categorical(key, lf, axis=-1)
  probs = jax.nn.softmax(lf, axis=-1)
  mask = jnp.broadcast_to(jnp.asarray(mask, jnp.float32), lf.shape[:-1])
  n = jnp.maximum(mask.sum(), 1.0)
  onehot = jax.nn.one_hot(y, lf.shape[-1], dtype=jnp.float32)
  dlogits = (probs - onehot) * (mask / n)[..., None]
  (g,) = vjp_fn(dlogits.astype(logits.dtype))
  s = jnp.asarray(logits.shape[0] if logits.ndim > 1 else 1, jnp.float32)
  return jax.tree.map(lambda x: x.astype(jnp.float32), g), n, s


def hutchinson_diag(loss_fn: Callable, params: PyTree, mb: PyTree, key: jax.Array) -> PyTree:
  """z (.) (H z) for the microbatch loss ``loss_fn(params, mb) -> (loss, aux)``; float32."""
  leaves, td = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  z = jax.tree.unflatten(td, [jax.random.rademacher(k, jnp.shape(x), jnp.float32).astype(x.dtype)
                              for k, x in zip(keys, leaves)])
  grad = jax.grad(lambda p: loss_fn(p, mb)[0])
  hz = jax.jvp(grad, (params,), (z,))[1]
  return jax.tree.map(lambda a, b: (a.astype(jnp.float32) * b.astype(jnp.float32)), z, hz)


def softmax_regression_gn_diag(w: jax.Array, x: jax.Array, mask: jax.Array) -> jax.Array:
  """Closed-form Gauss-Newton diagonal of the mean masked CE of ``logits = x @ w``.

  For one position with features x_i and probabilities p_i, J_i^T (diag(p) - p p^T) J_i has
  diagonal entries x_{ia}^2 p_{ic} (1 - p_{ic}) for weight w[a, c]; averaged over the
  supervised positions. (Used by tests; float64 if the inputs are.)
  """
  p = jax.nn.softmax(x @ w, axis=-1)
  mask = mask.astype(x.dtype)
  n = jnp.maximum(mask.sum(), 1.0)
  return jnp.einsum("ia,ic,i->ac", x * x, p * (1 - p), mask) / n
