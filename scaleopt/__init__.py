"""scaleopt: bias-corrected preconditioned optimizers, normalization scale vectors and
optimizer-dependent scaling exponents, in JAX/Optax/Flax.

Subpackages (each with one job; see docs/architecture.md):
  scaleopt.optim    Optax transforms and the microbatch statistics collector (no Flax).
  scaleopt.models   Flax NNX language models with scale-vector variants.
  scaleopt.train    configs, data, sharded jitted training, checkpoints, metrics.
  scaleopt.scaling  random-feature scaling-exponent sweeps, fits and diagnostics.
"""

__version__ = "0.1.0"
