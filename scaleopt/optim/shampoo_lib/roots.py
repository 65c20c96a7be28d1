"""Inverse fourth roots of the damped factors: by ``eigh`` or by coupled Newton iterations."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from scaleopt.optim import delta


def _sym(a):
  return 0.5 * (a + jnp.swapaxes(a, -1, -2))


def eigh_damped(f: jax.Array, damping: float, floor: float,
                implementation: Optional[str] = None):
  """(lam, Q) of f + damping I (batched over leading axes), lam floored at ``floor``;
  ``implementation``: one of ``EIGH_IMPLEMENTATIONS``."""
  eye = jnp.eye(f.shape[-1], dtype=jnp.float32)
  impl = None if implementation is None else jax.lax.linalg.EighImplementation(implementation)
  q, lam = jax.lax.linalg.eigh(_sym(f.astype(jnp.float32)) + damping * eye,
                               symmetrize_input=False, implementation=impl)
  return jnp.maximum(lam, floor), q


def root_from_eig(lam, q, var=None, *, correction_scale: float = 1.0, d_max: float = 0.0):
  """Q diag(d) Q^T with d = lam^{-1/4} (minus (5/32) lam^{-9/4} Var when var is given)."""
  d = lam ** -0.25 if var is None else delta.inv_fourth_root_corrected(
      lam, var, scale=correction_scale)
  if d_max > 0:
    d = jnp.minimum(d, d_max)
  hp = jax.lax.Precision.HIGHEST
  return jnp.matmul(q * d[..., None, :], jnp.swapaxes(q, -1, -2), precision=hp)


def matrix_power(t, p: int, precision):
  """t^p by repeated squaring (2 matmuls for p = 4)."""
  out, sq = None, t
  while p:
    if p & 1:
      out = sq if out is None else jnp.matmul(out, sq, precision=precision)
    p >>= 1
    if p:
      sq = jnp.matmul(sq, sq, precision=precision)
  return out


def newton_inverse_root(f: jax.Array, damping: float, p: int = 4, iters: int = 30,
                        precision: str = "highest"):
  """(f + damping I)^{-1/p} by coupled Newton iterations (Higham 2008, eq. 7.18), batched.

  With A scaled by z = (1 + p) / (2 ||A||_F): M_0 = z A, X_0 = z^{1/p} I, and
  T_i = ((p + 1) I - M_i) / p,  X_{i+1} = X_i T_i,  M_{i+1} = T_i^p M_i;  X -> A^{-1/p}.
  The error e_i = ||M_i - I||_F bounds every eigenvalue's |m - 1|, and decreases at every
  step in exact arithmetic. Each matrix keeps its last X with a smaller error and stops once
  the error does not decrease (round-off: float32 makes the iteration diverge on
  ill-conditioned inputs, as in google-research's distributed Shampoo) or stalls in the
  quadratic phase (e_i < 0.1, where every eigenvalue converges quadratically, and
  e_{i+1} > e_i / 2: the round-off floor of ``precision``); the loop ends when every matrix of
  the batch has stopped or after ``iters`` iterations. T^p is taken by squaring (2 + 2 matmuls per
  iteration for p = 4), every matmul at ``precision`` (one of ``PRECISIONS``).
  """
  return newton_loop(f, damping, p, iters, precision)[1]


def newton_root_unconverged(f: jax.Array, damping: float, p: int, iters: int, precision: str):
  """(X, unconverged) of ``newton_inverse_root``: ``unconverged`` (one bool per matrix) where
  the iteration ended at ``iters`` before stopping, or stopped before the quadratic phase
  (||M - I||_F >= 0.1: round-off made the error grow); X is then the best iterate, not a
  root to working precision."""
  _, x, unconverged = newton_loop(f, damping, p, iters, precision)
  return x, unconverged


def newton_loop(f, damping, p, iters, precision):
  """(iterations run, X, unconverged per matrix) of ``newton_inverse_root``."""
  n = f.shape[-1]
  eye = jnp.eye(n, dtype=jnp.float32)
  a = _sym(f.astype(jnp.float32)) + damping * eye
  norm = jnp.sqrt(jnp.sum(a * a, axis=(-2, -1), keepdims=True))
  z = (1.0 + p) / (2.0 * norm)
  m0 = a * z
  x0 = jnp.broadcast_to(eye, a.shape) * z ** (1.0 / p)
  err = lambda m: jnp.sqrt(jnp.sum(jnp.square(m - eye), axis=(-2, -1), keepdims=True))

  def body(c):
    i, x, m, e, done = c
    t = ((p + 1.0) * eye - m) / p
    x_new = jnp.matmul(x, t, precision=precision)
    m_new = jnp.matmul(matrix_power(t, p, precision), m, precision=precision)
    e_new = err(m_new)
    take = ~done & (e_new < e)  # False for NaN
    stall = (e < 0.1) & (e_new > 0.5 * e)  # quadratic convergence at least halves the error
    return (i + 1, jnp.where(take, x_new, x), jnp.where(take, m_new, m),
            jnp.where(take, e_new, e), done | ~take | stall)

  cond = lambda c: (c[0] < iters) & ~jnp.all(c[4])
  done0 = jnp.zeros(norm.shape, bool)
  i, x, _, e, done = jax.lax.while_loop(cond, body, (0, x0, m0, err(m0), done0))
  return i, _sym(x), (~done | ~(e < 0.1)).reshape(e.shape[:-2])


def eig_counts(lam, var=None, *, floor: float, correction_scale: float = 1.0,
               d_max: float = 0.0) -> jax.Array:
  """Per matrix (int32, last axis): eigenvalues raised to ``floor`` (``eigh_damped``), corrected
  roots clamped at 0 (``var`` given: lam^{-1/4} - (5/32) lam^{-9/4} Var <= 0) and roots
  clipped at ``d_max`` (> 0) by ``root_from_eig``."""
  d = lam ** -0.25 if var is None else delta.inv_fourth_root_corrected(
      lam, var, scale=correction_scale)
  count = lambda b: jnp.sum(b, axis=-1, dtype=jnp.int32)
  zero = jnp.zeros(lam.shape[:-1], jnp.int32)
  return jnp.stack([count(lam <= floor), zero if var is None else count(d <= 0),
                    count(d > d_max) if d_max > 0 else zero], axis=-1)
