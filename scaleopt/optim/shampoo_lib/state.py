"""Shampoo's optimizer state and the collector's statistics it reads."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from scaleopt.optim.collect import Static, register_bc_state


PyTree = Any
MaskedNode = optax.MaskedNode


class ShampooFactors(NamedTuple):
  """Blocked Kronecker factors of one tensor: (n_blocks, bs1, bs1) and (n_blocks, bs2, bs2)."""
  L: jax.Array
  R: jax.Array
  PL: jax.Array
  PR: jax.Array


# What a safeguard changed at the last update (``ScaleByShampooState.rules``): Newton roots
# (one per block and side) that stopped unconverged, block roots replaced by the previous root
# because a root of their factor was not finite, and eigenvalues raised to the floor, corrected
# roots clamped at 0 and roots clipped at d_max on the eigh path.
RULES = ("newton_unconverged", "root_nonfinite", "eig_floor_clamped", "inverse_clamped",
         "d_max_clamped")


def no_rules() -> dict:
  return {k: jnp.zeros((), jnp.int32) for k in RULES}


class ScaleByShampooState(NamedTuple):
  """count; momentum mu (all tensors); Adam second moment nu (fallback tensors, and all with
  grafting; scalar zeros elsewhere); factors: {str(leaf index): ShampooFactors} of the eligible
  tensors (indices in the flattened parameter tree); spec: the ``CollectorSpec``; hp: b2,
  damping and eig_floor_ratio as arrays (the collector's two-pass eigendecomposition); rules:
  {name in ``RULES``: int32 count} of what a safeguard changed at the last update (zeros on
  steps without roots; ``scaleopt.optim.rule_counts``)."""
  count: jax.Array
  mu: PyTree
  nu: PyTree
  factors: dict
  spec: Static
  hp: dict
  rules: dict


register_bc_state(ScaleByShampooState)


class ShampooPrecond(NamedTuple):
  """``bc_stats.precond`` for Shampoo-BC ({leaf index: array} dicts, blocked).

  stat_L, stat_R: (1/m) sum_{j in B} G_j G_j^T and G_j^T G_j; eig_L, eig_R: (lam, Q) of the
  new damped factors (two-pass form; None for ``cf``); var_L, var_R: Var_k of the eigenvalue
  projections (None for ``cf``); root: scalar bool, whether this is a root step.
  """
  stat_L: dict
  stat_R: dict
  eig_L: Optional[dict]
  eig_R: Optional[dict]
  var_L: Optional[dict]
  var_R: Optional[dict]
  root: jax.Array

