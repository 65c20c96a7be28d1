r"""Random-feature regression with a power-law data spectrum, reduced to quadratic statistics.

Model (random features as in Ramani & Jain, arXiv 2605.29387):

  latent input   x ~ N(0, Lambda),  Lambda = diag(lambda_1..lambda_M),
                 convention "zipf": lambda_k = k^{-s};  "mrs": lambda_k = k^{-(1+s)}
  teacher        y = W* x + sigma eps,  W* in R^{d x M}; "isotropic": W*_{ok} ~ N(0, 1);
                 "powerlaw": W*_{ok} = k^{-beta} g_{ok}, g ~ N(0, 1)
  features       z = phi(U x) in R^N,  U_{ij} ~ N(0, 1/M), nested: the first N rows of one U_max
  student        y_hat = W z,  W in R^{d x N},  W_0 = 0
  loss           L(W) = 1/2 E ||y - W z||^2
                      = 1/2 [tr(W A W^T) - 2 tr(W B^T) + c],  A = E[z z^T], B = E[y z^T], c = E||y||^2

Everything an optimizer sees is the quadratic (A, B, c): the gradient is G = W A - B and the
Gauss-Newton / Fisher curvature is A (x) I_d. Training and test statistics may differ:

  * population training (n_train = None): train = test = exact population statistics;
  * finite data (n_train = P): train statistics are the empirical ones of P samples (labels
    carry the noise); test statistics stay the population ones.

Exact population statistics exist for linear features (A = U Lambda U^T, B = W* Lambda U^T) and
for ReLU features (arc-cosine kernel, below). For tanh there is no closed form, so A, B, c are
Monte-Carlo estimates on `n_test` fresh samples (a test set); population training for tanh uses
a second, independent Monte-Carlo sample of the same size.

ReLU (Cho & Saul's degree-1 arc-cosine kernel, for jointly Gaussian u_i = U_i x, u_j = U_j x with
K = U Lambda U^T, sigma_i = sqrt(K_ii), cos theta_ij = K_ij / (sigma_i sigma_j)):

  E[relu(u_i) relu(u_j)] = sigma_i sigma_j (sin theta + (pi - theta) cos theta) / (2 pi),
  E[y_o relu(u_j)]       = Cov(y_o, u_j) P(u_j > 0) = (W* Lambda U^T)_{oj} / 2   (Stein's lemma).

The Bayes floor of the test loss is d sigma^2 / 2 (what "excess loss" subtracts).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Quadratic(NamedTuple):
  """The train/test quadratic statistics of one problem instance (padded to N_max features)."""
  a_train: jax.Array  # (N, N)
  b_train: jax.Array  # (d, N)
  a_test: jax.Array   # (N, N)
  b_test: jax.Array   # (d, N)
  c_test: jax.Array   # ()
  floor: jax.Array    # () Bayes floor d sigma^2 / 2


@dataclasses.dataclass(frozen=True)
class ProblemSpec:
  """Static (hashable) description of the problem family; s and the seed are dynamic."""
  spectrum: str = "zipf"
  latent_dim: int = 4096
  n_max: int = 1024
  d_out: int = 8
  feature_map: str = "linear"
  teacher: str = "isotropic"
  teacher_beta: float = 0.0
  noise: float = 0.0
  n_train: int | None = None
  n_test: int = 16384

  @classmethod
  def from_config(cls, p: dict) -> "ProblemSpec":
    return cls(spectrum=p["spectrum"], latent_dim=p["latent_dim"], n_max=max(p["n_features"]),
               d_out=p["d_out"], feature_map=p["feature_map"], teacher=p["teacher"],
               teacher_beta=p["teacher_beta"], noise=p["noise"], n_train=p["n_train"],
               n_test=p["n_test"])

  @property
  def shares_statistics(self) -> bool:
    """True when the training quadratic is the test quadratic (exact population training)."""
    return self.n_train is None and self.feature_map != "tanh"


def spectrum(s: jax.Array | float, m: int, convention: str = "zipf") -> jax.Array:
  """Latent eigenvalues lambda_k, k = 1..m: k^{-s} ("zipf") or k^{-(1+s)} ("mrs")."""
  k = jnp.arange(1, m + 1, dtype=jnp.result_type(float))
  a = s if convention == "zipf" else 1.0 + s
  return k ** (-a)


def _phi(u: jax.Array, feature_map: str) -> jax.Array:
  if feature_map == "linear":
    return u
  if feature_map == "relu":
    return jax.nn.relu(u)
  return jnp.tanh(u)


def relu_kernel(k: jax.Array) -> jax.Array:
  """E[relu(u) relu(u)^T] for u ~ N(0, K): the degree-1 arc-cosine kernel."""
  sd = jnp.sqrt(jnp.clip(jnp.diag(k), 1e-300))
  cos = jnp.clip(k / (sd[:, None] * sd[None, :]), -1.0, 1.0)
  theta = jnp.arccos(cos)
  return sd[:, None] * sd[None, :] * (jnp.sin(theta) + (jnp.pi - theta) * cos) / (2 * jnp.pi)


def _empirical(key: jax.Array, n: int, lam: jax.Array, u: jax.Array, w_star: jax.Array,
               spec: ProblemSpec, with_noise: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(Z^T Z / n, Y^T Z / n, mean ||y||^2) from n fresh samples."""
  kx, ke = jax.random.split(key)
  x = jax.random.normal(kx, (n, lam.shape[0]), lam.dtype) * jnp.sqrt(lam)
  z = _phi(x @ u.T, spec.feature_map)
  y = x @ w_star.T
  if with_noise and spec.noise > 0:
    y = y + spec.noise * jax.random.normal(ke, y.shape, y.dtype)
  return z.T @ z / n, y.T @ z / n, jnp.sum(y * y) / n


def sample_problem(key: jax.Array, s: jax.Array, spec: ProblemSpec) -> Quadratic:
  """Draw (U_max, W*) from `key` and return the train/test quadratics for spectral index s.

  The key depends only on the seed, so every s shares the same random draws (common random
  numbers make the alpha(s) curve smoother).
  """
  ku, kw, ktr, kte = jax.random.split(key, 4)
  dt = jnp.result_type(float)
  m, n, d = spec.latent_dim, spec.n_max, spec.d_out
  lam = spectrum(s, m, spec.spectrum)
  u = jax.random.normal(ku, (n, m), dt) / jnp.sqrt(m)
  w_star = jax.random.normal(kw, (d, m), dt)
  if spec.teacher == "powerlaw":
    w_star = w_star * jnp.arange(1, m + 1, dtype=dt) ** (-spec.teacher_beta)
  noise_power = d * spec.noise ** 2
  floor = jnp.asarray(noise_power / 2, dt)

  if spec.feature_map in ("linear", "relu"):
    ul = u * lam
    k = ul @ u.T
    b = w_star @ ul.T
    if spec.feature_map == "linear":
      a = k
    else:
      a, b = relu_kernel(k), b / 2
    c = jnp.sum(w_star * w_star * lam) + noise_power
  else:
    a, b, c = _empirical(kte, spec.n_test, lam, u, w_star, spec, with_noise=True)

  if spec.n_train is not None:
    a_tr, b_tr, _ = _empirical(ktr, spec.n_train, lam, u, w_star, spec, with_noise=True)
  elif spec.feature_map == "tanh":
    a_tr, b_tr, _ = _empirical(ktr, spec.n_test, lam, u, w_star, spec, with_noise=True)
  else:
    a_tr, b_tr = a, b
  return Quadratic(a_tr, b_tr, a, b, c, floor)


def mask_features(q: Quadratic, mask: jax.Array) -> Quadratic:
  """Restrict a padded quadratic to the features where mask == 1 (others: zero rows/columns).

  With zero rows/columns the padded coordinates get zero gradient, stay at W = 0 and never
  contribute to the loss, so the padded problem is exactly the N-feature problem.
  """
  mm = mask[:, None] * mask[None, :]
  return Quadratic(q.a_train * mm, q.b_train * mask, q.a_test * mm, q.b_test * mask,
                   q.c_test, q.floor)


def loss(q: Quadratic, w: jax.Array) -> jax.Array:
  """Test loss 1/2 [tr(W A W^T) - 2 tr(W B^T) + c]."""
  return 0.5 * (jnp.sum((w @ q.a_test) * w) - 2 * jnp.sum(w * q.b_test) + q.c_test)


def grad(q: Quadratic, w: jax.Array) -> jax.Array:
  """Training gradient G = W A_train - B_train."""
  return w @ q.a_train - q.b_train
