"""scaleopt.scaling: optimizer-dependent scaling exponents in random-feature regression.

docs/scaling.md. One job per module:
  config      sweep config schema, YAML + overrides, validation
  problem     random-feature regression reduced to quadratic statistics
  optimizers  gd, adam, kron_sqrt, shampoo, msign, ng as Optax transforms
  sweep       the jitted, vmapped sweep; summaries, CSV/PNG outputs; `sweep_main` (CLI)
  fit         learning-rate selection, alpha fits, draw-cluster t intervals, fit-window report
  theory      closed-form loss after T steps, mode counting, anchor exponents
  diagnostic  spectral exponent of a covariance and the predicted alpha gain (`diagnose`)
  corpus      diagnostic inputs: byte statistics, scaleopt.models LM activations, a byte MLP
  lm_alpha    alpha of L(N) from a language-model study's results.csv
  plots, blas, demo

`scaleopt.scaling.diagnose(X or eigenvalues, table=...)` is re-exported here.
"""

from scaleopt.scaling.diagnostic import diagnose

__all__ = ["diagnose"]
