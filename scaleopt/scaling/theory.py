r"""Closed forms: the loss after T steps in the eigenbasis, mode counting, anchor exponents.

1. Exact loss after T steps. For population training (train = test quadratic)
   with A = V diag(mu) V^T, b~ = B V, W_0 = 0 and a preconditioner that is a function of A,
   the error E_t = W_t - W_ls obeys E_{t+1} = E_t (I - eta P A), so mode k contracts by
   r_k = 1 - eta p(mu_k) mu_k per step and

     L_T = 1/2 c - 1/2 sum_k (1 - r_k^{2T}) ||b~_k||^2 / mu_k.

   gd: p = 1, eta = lr / mu_max;  ng: p = (mu + delta)^{-1}, eta = lr / rho (r_k = delta/(mu_k +
   delta) at lr = 1 when rho = 1);  kron_sqrt: p = (mu + delta)^{-1/2};  delta = damping mu_max.

2. Mode counting (Bordelon et al. 2024, Maloney et al. 2022 without the random
   projection): per output, with an isotropic teacher the power on latent mode k is lambda_k, and

     L(T, N) ~= 1/2 [ sum_{k<=N} lambda_k r_k^{2T} + sum_{k>N} lambda_k ],

   with r_k from the *latent* spectrum. It predicts alpha(T, N-window) of every eig optimizer.

3. Anchor exponents (T -> infinity, N << M): convention zipf with an isotropic teacher gives
   alpha_inf = s - 1 (s > 1; only a logarithmic decay at s = 1, so the fitted value is set by
   the M cut-off), convention mrs gives alpha_inf = s (Maloney-Roberts-Sully). Bordelon et al.'s
   model-limited exponent min(a - 1, 2b) with task exponent a = s and spectral exponent b = s is
   the same s - 1. GD with T steps resolves k <~ T^{1/a} modes (a = s or 1 + s), so its fitted
   alpha falls towards 0 once N >> T^{1/a}.
"""

from __future__ import annotations

import numpy as np

from scaleopt.scaling import fit as fit_lib

_POWER = {"gd": 0.0, "kron_sqrt": 0.5, "ng": 1.0}


def contraction(mu: np.ndarray, kind: str, lr: float = 1.0, damping: float = 0.0) -> np.ndarray:
  """r_k = 1 - eta p(mu_k) mu_k with the sweep's curvature-scaled step eta = lr / rho."""
  mu = np.clip(np.asarray(mu, float), 0.0, None)
  p = _POWER[kind]
  delta = damping * mu.max()
  pre = np.ones_like(mu) if p == 0 else (mu + delta) ** (-p)
  rho = np.max(mu * pre)
  return 1.0 - lr * pre * mu / rho


def closed_form_loss(a: np.ndarray, b: np.ndarray, c: float, steps: int | np.ndarray,
                     kind: str, lr: float = 1.0, damping: float = 0.0) -> np.ndarray:
  """Exact population loss after `steps` (scalar or array) steps from W_0 = 0."""
  mu, v = np.linalg.eigh(np.asarray(a, float))
  keep = mu > mu.max() * 1e-14
  bt = np.asarray(b, float) @ v
  power = (bt * bt).sum(axis=0)[keep] / mu[keep]
  r = contraction(mu, kind, lr, damping)[keep]
  t = np.atleast_1d(np.asarray(steps))[:, None]
  out = 0.5 * c - 0.5 * ((1.0 - r[None, :] ** (2 * t)) * power[None, :]).sum(axis=1)
  return out if np.ndim(steps) else out[0]


def mode_counting_loss(lam: np.ndarray, n: np.ndarray, steps: int, kind: str, lr: float = 1.0,
                       damping: float = 0.0) -> np.ndarray:
  """Mode-counting loss per output for each N (top-N latent modes, no projection noise)."""
  lam = np.asarray(lam, float)
  out = []
  for nn in np.atleast_1d(n):
    head = lam[:nn]
    r = contraction(head, kind, lr, damping)
    out.append(0.5 * ((head * r ** (2 * steps)).sum() + lam[nn:].sum()))
  return np.asarray(out)


def mode_counting_alpha(s_values, n, steps: int, kind: str, m: int, convention: str = "zipf",
                        lrs=(0.25, 0.5, 1.0, 1.5, 1.9), damping: float = 1e-4) -> np.ndarray:
  """alpha of the mode-counting loss (best lr per N from `lrs`, as in the sweep) per s."""
  k = np.arange(1, m + 1, dtype=float)
  out = []
  for s in np.atleast_1d(s_values):
    lam = k ** (-(s if convention == "zipf" else 1.0 + s))
    losses = np.stack([mode_counting_loss(lam, n, steps, kind, lr, damping) for lr in lrs], -1)
    out.append(fit_lib.fit_power_law(n, losses.min(axis=-1))[0])
  return np.asarray(out)


def converged_alpha(s_values, convention: str = "zipf") -> np.ndarray:
  """Anchor-theory T -> infinity exponent: s - 1 (zipf, clipped at 0) or s (mrs)."""
  s = np.asarray(s_values, float)
  return np.clip(s - 1.0, 0.0, None) if convention == "zipf" else s


def gd_resolved_modes(steps: int, a: float) -> float:
  """k_GD(T) ~= T^{1/a}: latent modes GD at eta = 1/lambda_1 fits within T steps."""
  return float(steps) ** (1.0 / a)
