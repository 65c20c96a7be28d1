"""Sophia's safeguard counters (``state.rules``, ``so.rule_counts``) against the same rules
applied to a float64 NumPy transcription of one refresh step."""

import jax.numpy as jnp
import numpy as np

import scaleopt.optim as so
from scaleopt.optim.collect import BCStats
from scaleopt.optim.sophia_lib import RULES, SophiaCurvature, scale_by_sophia

B1, B2, EPS, RHO, CLIP = 0.9, 0.9, 1e-13, 0.05, 1.0


def _step(g, h_step, var, refresh, mode):
  tx = scale_by_sophia(B1, B2, EPS, rho=RHO, clip=CLIP, k=1, mode=mode)
  f = lambda x: jnp.asarray(x, jnp.float32)
  pre = SophiaCurvature(h_step=f(h_step), var=f(var), refresh=jnp.asarray(refresh))
  grad = f(g)
  stats = BCStats(numerator=grad, full=grad, a=None, b=None, loo=None, loss=jnp.zeros(()),
                  aux={}, precond=pre)
  _, st = tx.update(grad, tx.init(grad), grad, bc_stats=stats)
  return {k: int(v) for k, v in so.rule_counts(st).items()}


def _case(seed=0, d=64):
  rng = np.random.default_rng(seed)
  g = rng.normal(0, 1e-3, d)
  h = rng.gamma(2.0, 0.5, d) * 1e-2
  h[:5] = 0.0  # p = eps = 1e-13 < 1e-12: below the floor
  var = h ** 2 * rng.uniform(0.0, 30.0, d)  # large relative variance: some inverses hit 0
  return g, h, var


def test_refresh_counts_match_float64():
  g, h, var = _case()
  p = RHO * (1 - B2) * h + EPS
  var_p = (RHO * (1 - B2)) ** 2 * var
  inv = np.maximum(1 / np.maximum(p, 1e-12) - var_p / np.maximum(p, 1e-12) ** 3, 0.0)
  ratio = (1 - B1) * g * inv
  want = {"curvature_below_floor": (p < 1e-12).sum(), "inverse_clamped": (inv <= 0).sum(),
          "ratio_clipped": (np.abs(ratio) > CLIP).sum()}
  assert all(0 < v < len(g) for v in want.values()), want
  got = _step(g, h, var, True, "full")
  assert set(got) == set(RULES)
  assert got == want


def test_uncorrected_and_non_refresh_steps():
  """std: no inverse is clamped (1/p); without a refresh the cached inverse 1/eps = 1e13
  clips every nonzero coordinate and nothing is refreshed."""
  g, h, var = _case(1)
  p = RHO * (1 - B2) * h + EPS
  ratio = (1 - B1) * g / p
  got = _step(g, h, var, True, "std")
  assert got == {"curvature_below_floor": (p < 1e-12).sum(), "inverse_clamped": 0,
                 "ratio_clipped": (np.abs(ratio) > CLIP).sum()}
  got = _step(g, h, var, False, "std")
  assert got == {"curvature_below_floor": 0, "inverse_clamped": 0,
                 "ratio_clipped": (np.abs((1 - B1) * g / EPS) > CLIP).sum()}
