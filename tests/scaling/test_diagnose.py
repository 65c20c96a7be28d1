"""Spectral diagnostic: exponent recovery, goodness of fit, interpolation of the alpha table."""

import numpy as np
import pytest

from scaleopt.scaling import diagnostic as diagnose

TABLE = [
    {"s": 0.5, "optimizer": "gd", "alpha": 0.1}, {"s": 0.5, "optimizer": "ng", "alpha": 0.1},
    {"s": 1.0, "optimizer": "gd", "alpha": 0.12}, {"s": 1.0, "optimizer": "ng", "alpha": 0.32},
    {"s": 2.0, "optimizer": "gd", "alpha": 0.06}, {"s": 2.0, "optimizer": "ng", "alpha": 0.86},
]


@pytest.mark.parametrize("s_true", [0.7, 1.0, 1.6])
def test_recovers_exponent_from_eigenvalues_and_data(s_true):
  k = np.arange(1, 2001)
  d = diagnose.diagnose(k ** -s_true, TABLE)
  assert abs(d.s_hat - s_true) < 1e-9 and d.r2 > 0.999999
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8000, 200)) * np.arange(1, 201) ** (-s_true / 2)
  dx = diagnose.diagnose(x, k_max=60)
  assert abs(dx.s_hat - s_true) < 0.1 and dx.r2 > 0.98
  # a rotation does not change the spectrum
  q, _ = np.linalg.qr(rng.standard_normal((200, 200)))
  assert abs(diagnose.diagnose(x @ q, k_max=60).s_hat - dx.s_hat) < 1e-8


def test_prediction_interpolates_table_and_flags_extrapolation():
  d = diagnose.diagnose(np.arange(1, 3001) ** -1.5, TABLE)
  assert abs(d.predicted_shift["ng"] - 0.5 * (0.2 + 0.8)) < 1e-6
  assert not d.extrapolated
  d = diagnose.diagnose(np.arange(1, 3001) ** -3.0, TABLE)
  assert d.extrapolated and abs(d.predicted_shift["ng"] - 0.8) < 1e-9
  assert diagnose.diagnose(np.arange(1, 3001) ** -2.0, TABLE, convention="mrs").s == pytest.approx(1.0)


def test_goodness_of_fit_detects_non_power_law():
  k = np.arange(1, 2001)
  assert diagnose.diagnose(np.exp(-k / 50.0)).r2 < 0.95
  assert diagnose.diagnose(k ** -1.0).r2 > 0.9999


def test_gd_resolved_modes():
  k = np.arange(1, 1001.0)
  d = diagnose.diagnose(k ** -1.0, steps=10)
  assert d.gd_resolved_modes == 10


def test_package_level_diagnose_is_the_function():
  import scaleopt.scaling as scaling
  d = scaling.diagnose(np.arange(1, 500) ** -1.2)
  assert abs(d.s_hat - 1.2) < 1e-9


def test_lm_hidden_states_reproduce_the_models_logits():
  """The diagnostic's LM activations are what the unembedding reads: logits = h W_eff."""
  import jax
  from flax import nnx

  from scaleopt.models import Transformer, functional, get_preset
  from scaleopt.models.layers import effective_kernel, get_scale
  from scaleopt.models.transformer import final_scale_name
  from scaleopt.scaling import corpus

  cfg = get_preset("tiny")
  init_fn, apply_fn = functional(cfg)
  params = jax.jit(init_fn)(jax.random.key(3))
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
  logits, _ = jax.jit(apply_fn)(params, tokens)
  h = np.asarray(jax.jit(corpus.lm_hidden_states, static_argnums=0)(cfg, params, tokens))
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  model = nnx.merge(graphdef, params)
  assert h.shape == (2, 16, cfg.d_model)
  name = final_scale_name(cfg)
  w = effective_kernel(model.embed.embedding[...].T, get_scale(model, name) if name else None)
  ref = np.asarray(logits)
  np.testing.assert_allclose(h @ np.asarray(w), ref, atol=0.02 * np.abs(ref).max())
  # per-token RMS norm: every row has unit root-mean-square
  np.testing.assert_allclose(np.sqrt((h ** 2).mean(-1)), 1.0, rtol=2e-2)
