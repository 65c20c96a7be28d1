"""Delta-method corrections of the inverse maps used by preconditioners.

If x_hat estimates p without bias and with variance sigma^2, a smooth T satisfies

    E[T(x_hat)] = T(p) + (1/2) T''(p) sigma^2 + O(sigma^4),

so T_tilde(x_hat) = T(x_hat) - (1/2) T''(x_hat) Var_hat(x_hat) removes the leading bias.
For the convex, decreasing maps below the correction subtracts; results are clamped at 0 so
that a correction never flips the sign of a step.

| T(x)          | (1/2) T''(x)          | used by                                  |
|---------------|-----------------------|------------------------------------------|
| 1/x           | x^{-3}                | Sophia (x = rho * bs * h + eps)          |
| x^{-1/2}      | (3/8) x^{-5/2}        | Adam written on v                        |
| x^{-1/4}      | (5/32) x^{-9/4}       | Shampoo eigenvalues                      |

``var`` is the variance of the estimate itself (for a mean of m microbatch statistics,
M2 / (m (m - 1))). ``scale`` multiplies the subtracted term.
"""

from __future__ import annotations

import jax.numpy as jnp


# the smallest x the corrections divide by
FLOOR = 1e-12


def inv_power_corrected(x, var, p: float, *, scale: float = 1.0, floor: float = FLOOR):
  """x^{-p} - scale * (1/2) p (p+1) x^{-p-2} var, clamped at 0 (x floored at ``floor``)."""
  x = jnp.maximum(x, floor)
  half_t2 = 0.5 * p * (p + 1.0)
  return jnp.maximum(x ** (-p) - scale * half_t2 * var * x ** (-p - 2.0), 0.0)


def inv_corrected(x, var, **kw):
  """1/x - var / x^3."""
  return inv_power_corrected(x, var, 1.0, **kw)


def inv_sqrt_corrected(x, var, **kw):
  """x^{-1/2} - (3/8) var x^{-5/2}."""
  return inv_power_corrected(x, var, 0.5, **kw)


def inv_fourth_root_corrected(x, var, **kw):
  """x^{-1/4} - (5/32) var x^{-9/4}."""
  return inv_power_corrected(x, var, 0.25, **kw)
