"""Evaluation: a fixed held-out set chosen by the data, scored one microbatch at a time."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from scaleopt.train import bridge, data as D, step as step_lib


def _windows():
  rng = np.random.default_rng(3)
  return D.Windows([rng.integers(1, 50, 700).astype(np.uint16),
                    rng.integers(1, 50, 300).astype(np.uint16)], seq_len=16, sep=0)


def test_eval_set_is_chosen_by_the_data_not_the_batch_size():
  w = _windows()  # 43 + 18 = 61 windows
  ev = D.eval_set(w, 40 * 16)
  assert ev.n == 40 and len(set(ev.index.tolist())) == 40  # no window twice
  want = sorted(w.get(ev.index).tolist())
  for size in (1, 3, 8, 40, 64):  # microbatch sizes of different batch sizes
    toks, valid = ev.microbatches(size)
    assert toks.shape[1:] == (size, 17) and valid.shape == toks.shape[:2]
    assert sorted(toks[valid].tolist()) == want  # every window once, padding marked
  # two processes each hold half of every microbatch; together they hold the same windows
  halves = [ev.microbatches(8, p, 2)[0] for p in range(2)]
  np.testing.assert_array_equal(np.concatenate(halves, axis=1), ev.microbatches(8)[0])
  assert D.eval_set(_windows(), 40 * 16).ident == ev.ident  # same data, same set
  small = D.eval_set(w, 10 * 16)
  assert set(small.index.tolist()) <= set(ev.index.tolist()) and small.ident != ev.ident
  other = D.Windows([np.asarray(a).copy() for a in w.arrays], 16, sep=0)
  other.arrays[1][5] += 1  # one token of one window
  assert D.eval_set(other, 10**6).ident != D.eval_set(w, 10**6).ident


def test_eval_set_mean_leaves_padding_out():
  ev = D.eval_set(_windows(), 5 * 16)
  ce = np.arange(6.0).reshape(3, 2)  # 5 windows in microbatches of 2: one padded row
  ce[2, 1] = 1e6
  np.testing.assert_allclose(ev.mean(ce), np.mean([0, 1, 2, 3, 4]))
  np.testing.assert_allclose(ev.mean(np.stack([ce, 2 * ce])), [2.0, 4.0])  # vmapped cells


def _ref_window_ce(model, params, x):
  """Per-window mean CE in float64 NumPy from the model's (unfused) float32 logits."""
  z = np.asarray(jax.jit(model.apply)(params, jnp.asarray(x[:, :-1]))[0], np.float64)
  z -= z.max(-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  return -np.take_along_axis(logp, x[:, 1:, None].astype(np.int64), -1)[..., 0].mean(-1)


def _largest(jaxpr):
  """The most elements of any value a jaxpr (and its sub-jaxprs) makes."""
  most = 0
  for eqn in jaxpr.eqns:
    for v in eqn.outvars:
      most = max(most, int(np.prod(getattr(v.aval, "shape", ()))))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      most = max(most, _largest(sub))
  return most


def test_microbatched_eval_equals_unmicrobatched_per_window():
  model = bridge.make_model({"preset": "tiny", "dtype": "float32", "d_model": 32,
                             "n_layers": 1, "d_ff": 64, "vocab_size": 64})
  params = jax.jit(model.init)(jax.random.PRNGKey(0))
  x = np.random.default_rng(0).integers(0, 64, (12, 17)).astype(np.int32)
  ref = _ref_window_ce(model, params, x)
  step = jax.jit(step_lib.make_eval_step(model))
  whole = np.asarray(step(params, jnp.asarray(x[None])))[0]  # one microbatch of 12
  micro = np.asarray(step(params, jnp.asarray(x.reshape(4, 3, 17)))).ravel()  # 4 of 3
  np.testing.assert_allclose(whole, ref, rtol=2e-6)
  np.testing.assert_allclose(micro, ref, rtol=2e-6)
  # no value as large as all windows' logits (12 x 16 positions x 64 ids), which the same
  # step on one microbatch of all 12 windows does make
  size = lambda t: _largest(jax.make_jaxpr(step_lib.make_eval_step(model))(params, t).jaxpr)
  assert size(jnp.asarray(x.reshape(4, 3, 17))) < 12 * 16 * 64 <= size(jnp.asarray(x[None]))
