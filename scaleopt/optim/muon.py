"""Muon for matrices, Adam for the other tensors (registered as ``muon`` by ``build``).

    matrices: optax.contrib.scale_by_muon (Newton-Schulz orthogonalized momentum, coefficient
              beta, ``ns_steps`` iterations), times optax.contrib.muon's shape factor
              sqrt(max(1, fan_out / fan_in)) (or ``consistent_rms`` sqrt(max(fan_in, fan_out)))
    others:   optax.scale_by_adam(adam_b1, adam_b2, eps) times ``adam_lr_ratio``
    then:     add_decayed_weights(weight_decay, wd_mask), scale_by_learning_rate(lr)

Built from optax's public pieces; pure Optax (no Flax).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import optax


def _scale_by_shape(consistent_rms: Optional[float]) -> optax.GradientTransformation:
  """optax.contrib.muon's shape scaling for matrices (last two dims fan_in, fan_out):
  sqrt(max(1, fan_out / fan_in)), or consistent_rms sqrt(max(fan_in, fan_out))."""
  def scale(u):
    if isinstance(u, optax.MaskedNode):
      return u
    fan_in, fan_out = u.shape[-2], u.shape[-1]
    if consistent_rms is None:
      return jnp.sqrt(jnp.maximum(1.0, fan_out / fan_in)) * u
    return (jnp.sqrt(max(fan_in, fan_out)) * consistent_rms) * u

  return optax.stateless(lambda u, p: jax.tree.map(
      scale, u, is_leaf=lambda x: isinstance(x, optax.MaskedNode)))


def muon_labels(params, sparse_filter=None):
  """'muon' for matrices, 'adam' for the rest. Matrices are rank >= 2 tensors (leading axes of
  rank >= 3 tensors are stacked layers; a rank-2 tensor whose first dim is such a stack size is
  a stack of vectors), except ``sparse_filter`` tensors (embeddings)."""
  leaves, td = jax.tree.flatten(params)
  sparse = (td.flatten_up_to(sparse_filter(params)) if sparse_filter is not None
            else [False] * len(leaves))
  stacks = {x.shape[0] for x in leaves if x.ndim >= 3}
  lab = ["muon" if (x.ndim >= 3 or (x.ndim == 2 and x.shape[0] not in stacks)) and not sp
         else "adam" for x, sp in zip(leaves, sparse)]
  return jax.tree.unflatten(td, lab)


def muon(lr, beta=0.95, eps=1e-8, weight_decay=0.1, wd_mask=None, sparse_filter=None, *,
         ns_steps=5, nesterov=True, adam_b1=0.9, adam_b2=0.95, adam_lr_ratio=1.0,
         consistent_rms=None) -> optax.GradientTransformation:
  """Muon for matrices, Adam for the rest (``muon_labels``), with decoupled weight decay under
  ``wd_mask`` on both and one learning-rate schedule (see the module docstring). With
  ``weight_decay=0`` and ``adam_lr_ratio=1`` this is ``optax.contrib.muon`` step for step."""
  from optax.contrib import MuonDimensionNumbers, scale_by_muon

  def dims(masked):
    return jax.tree.map(
        lambda x: x if isinstance(x, optax.MaskedNode) else MuonDimensionNumbers(
            reduction_axis=x.ndim - 2, output_axis=x.ndim - 1),
        masked, is_leaf=lambda x: isinstance(x, optax.MaskedNode))

  branch = optax.chain(scale_by_muon(ns_steps=ns_steps, beta=beta, eps=eps, nesterov=nesterov,
                                     weight_dimension_numbers=dims),
                       _scale_by_shape(consistent_rms))
  adam = optax.chain(optax.scale_by_adam(adam_b1, adam_b2, eps, nesterov=nesterov),
                     optax.scale(adam_lr_ratio))
  return optax.chain(
      optax.partition({"muon": branch, "adam": adam},
                      lambda params: muon_labels(params, sparse_filter)),
      optax.add_decayed_weights(weight_decay, wd_mask),
      optax.scale_by_learning_rate(lr))
