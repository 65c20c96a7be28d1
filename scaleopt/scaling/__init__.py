"""scaleopt.scaling: optimizer-dependent scaling exponents in random-feature regression.

Issue 6 (docs/scaling.md). One job per module:
  config      sweep config schema, YAML + overrides, validation
  problem     random-feature regression reduced to quadratic statistics
  optimizers  gd, adam, kron_sqrt, shampoo, msign, ng as Optax transforms
  sweep       the jitted, vmapped sweep; summaries, CSV/PNG outputs; `sweep_main` (CLI)
  fit         learning-rate selection, alpha fits, seed bootstrap
  theory      closed-form loss after T steps, mode counting, anchor exponents
  diagnostic  spectral exponent of a covariance and the predicted alpha gain (`diagnose`)
  corpus      stdlib-source byte statistics and a tiny byte MLP (diagnostic inputs)
  plots, blas, demo

`scaleopt.scaling.diagnose(X or eigenvalues, table=...)` is re-exported here.
"""

from scaleopt.scaling.diagnostic import diagnose

__all__ = ["diagnose"]
