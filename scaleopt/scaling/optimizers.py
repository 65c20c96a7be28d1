r"""The optimizers of the sweep, as Optax GradientTransformations on the readout W (d x N).

Notation: G = W A - B the gradient, A = V diag(mu) V^T the (training) feature covariance, which
is also the Gauss-Newton / Fisher curvature of the readout (F = A (x) I_d for squared error),
eta_t = lr * schedule(t), delta = damping * mu_max (damping is *relative* to the top eigenvalue).

  gd         W <- W - eta G
  adam       W <- W - eta m_hat / (sqrt(v_hat) + eps)            (diagonal, bias-corrected)
  kron_sqrt  W <- W - eta G (A + delta I)^{-1/2}                 (Shampoo-like Kronecker
             square root: the Kronecker factors of the curvature are I_d (output side, exact for
             squared error) and A (input side); each factor is raised to -1/2)
  shampoo    L <- L + G G^T, R <- R + G^T G,
             W <- W - eta (L + eps I)^{-1/4} G (R + eps I)^{-1/4}  (Gupta et al. 2018, gradient
             statistics, eps relative to the top eigenvalue of each factor; an eigh per step)
  msign      M <- momentum M + G,  W <- W - eta_t msign(M),  msign(M) = U V^T of the thin SVD
             M = U S V^T (Muon proxy), computed like Muon by Newton-Schulz iterations
             X_0 = M / ||M||_F,  X_{k+1} = 3/2 X_k - 1/2 X_k X_k^T X_k  (ns_steps of them; each
             multiplies a small singular value by ~3/2, so 40 steps converge for sigma_min /
             ||M||_F >~ 1e-6; only matmuls, no LAPACK inside the scan)
  ng         W <- W - eta G (A + delta I)^{-1}                   (full natural gradient; with
             eta = 1 and delta -> 0 it jumps to the least-squares readout in one step)

The learning rate of "curvature"-scaled optimizers is lr / rho with rho = max_k mu_k / (mu_k +
delta)^p the largest eigenvalue of the preconditioned curvature (p = 0 gd, 1/2 kron_sqrt, 1 ng),
so lr is a multiple of the stable step 2/rho for every one of them (stable iff lr < 2).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

EIG_POWER = {"gd": 0.0, "kron_sqrt": 0.5, "ng": 1.0}


class Curvature(NamedTuple):
  """Eigendecomposition of the training feature covariance A = V diag(mu) V^T."""
  mu: jax.Array  # (N,)
  v: jax.Array   # (N, N)

  @property
  def top(self) -> jax.Array:
    return jnp.max(self.mu)


def scale_by_eig_preconditioner(curv: Curvature, power: float,
                                damping: jax.Array) -> optax.GradientTransformation:
  """G -> G (A + delta I)^{-power},  delta = damping * mu_max  (stateless)."""
  delta = damping * curv.top
  scale = (jnp.clip(curv.mu, 0.0) + delta) ** (-power)

  def update_fn(updates, state, params=None):
    del params
    return ((updates @ curv.v) * scale) @ curv.v.T, state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def _sym_power(s: jax.Array, p: float, eps_rel: jax.Array) -> jax.Array:
  """(S + eps I)^p for symmetric PSD S, eps = eps_rel * max(eig(S), tiny)."""
  w, q = jnp.linalg.eigh(s)
  w = jnp.clip(w, 0.0)
  eps = eps_rel * jnp.maximum(w[-1], jnp.finfo(s.dtype).tiny)
  return (q * (w + eps) ** p) @ q.T


def matrix_sign(m: jax.Array, ns_steps: int = 40) -> jax.Array:
  """msign(M) = U V^T (the orthogonal polar factor of M, d <= N) by cubic Newton-Schulz."""
  x = m / (jnp.sqrt(jnp.sum(m * m)) + jnp.finfo(m.dtype).tiny)

  def body(_, x):
    return 1.5 * x - 0.5 * (x @ x.T) @ x

  return jax.lax.fori_loop(0, ns_steps, body, x)


def scale_by_matrix_sign(ns_steps: int = 40) -> optax.GradientTransformation:
  """G -> msign(G) (stateless; put optax.trace before it for momentum)."""

  def update_fn(updates, state, params=None):
    del params
    return matrix_sign(updates, ns_steps), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


class ShampooState(NamedTuple):
  left: jax.Array
  right: jax.Array


def scale_by_shampoo(eps: jax.Array) -> optax.GradientTransformation:
  """Shampoo for one matrix: accumulate L = sum G G^T, R = sum G^T G; G -> L^{-1/4} G R^{-1/4}."""

  def init_fn(params):
    d, n = params.shape
    return ShampooState(jnp.zeros((d, d), params.dtype), jnp.zeros((n, n), params.dtype))

  def update_fn(updates, state, params=None):
    del params
    left = state.left + updates @ updates.T
    right = state.right + updates.T @ updates
    left_root = _sym_power(left, -0.25, eps)
    # one LAPACK eigh at a time (see sweep._chunk_fn on jaxlib's batched-LAPACK deadlock)
    right, left_root = jax.lax.optimization_barrier((right, left_root))
    new = left_root @ updates @ _sym_power(right, -0.25, eps)
    return new, ShampooState(left, right)

  return optax.GradientTransformation(init_fn, update_fn)


def schedule_fn(name: str, lr: jax.Array, steps: int) -> Callable[[jax.Array], jax.Array]:
  """eta_t for t = 0..steps-1: constant, linear (1 - t/T), cosine, inv_sqrt (1/sqrt(1+t))."""
  if name == "constant":
    return lambda t: lr
  if name == "linear":
    return lambda t: lr * (1.0 - t / steps)
  if name == "cosine":
    return lambda t: lr * 0.5 * (1.0 + jnp.cos(jnp.pi * t / steps))
  if name == "inv_sqrt":
    return lambda t: lr / jnp.sqrt(1.0 + t)
  raise ValueError(f"schedule {name!r}: allowed values are constant, linear, cosine, inv_sqrt")


def curvature_scale(kind: str, curv: Curvature, damping: jax.Array | float) -> jax.Array:
  """rho: the top eigenvalue of the preconditioned curvature of an eig-based optimizer."""
  p = EIG_POWER.get(kind, 0.0)
  if p == 0.0:
    return curv.top
  mu = jnp.clip(curv.mu, 0.0)
  return jnp.max(mu * (mu + damping * curv.top) ** (-p))


def build(kind: str, hyper: dict[str, jax.Array], fixed: dict[str, Any], curv: Curvature,
          steps: int) -> optax.GradientTransformation:
  """The transform for one grid point. `hyper` values may be traced (vmapped over)."""
  lr = hyper["lr"]
  if fixed.get("lr_scale", "abs") == "curvature":
    lr = lr / curvature_scale(kind, curv, hyper.get("damping", 0.0))
  sched = schedule_fn(fixed.get("schedule", "constant"), lr, steps)
  if kind == "gd":
    core = optax.identity()
  elif kind == "adam":
    core = optax.scale_by_adam(b1=hyper["b1"], b2=hyper["b2"], eps=hyper["eps"])
  elif kind in ("kron_sqrt", "ng"):
    core = scale_by_eig_preconditioner(curv, EIG_POWER[kind], hyper["damping"])
  elif kind == "shampoo":
    core = scale_by_shampoo(hyper["eps"])
  elif kind == "msign":
    core = optax.chain(optax.trace(decay=hyper["momentum"]),
                       scale_by_matrix_sign(int(fixed.get("ns_steps", 40))))
  else:
    raise ValueError(f"optimizer kind {kind!r}: allowed values are gd, adam, kron_sqrt, "
                     "shampoo, msign, ng")
  return optax.chain(core, optax.scale_by_learning_rate(sched))
