"""The logged gradient norms around the global-norm clip: ``grad_norm`` before the clip,
``grad_norm_clipped`` after it, and the logging window's ``clip_fraction``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from scaleopt.train import config as C, loop, metrics, progress

from train_helpers import compiled_steps, tiny_raw


def _full_batch_grad_norm(s, params, tokens):
  """||mean over microbatches of grad loss|| computed directly from the model's loss."""
  grad = jax.grad(lambda p, mb: s.model.loss_fn(p, mb)[0])
  gs = [grad(params, tokens[j]) for j in range(tokens.shape[0])]
  mean = jax.tree.map(lambda *xs: sum(xs) / len(xs), *gs)
  return float(optax.tree.norm(mean))


@pytest.mark.parametrize("clip_norm", [1e-3, 1e6])
def test_grad_norm_is_the_pre_clip_norm(clip_norm):
  """Against the full-batch gradient of the model's own loss: the clip that fires every step
  (1e-3) and one that never fires (1e6) log the same pre-clip ``grad_norm``."""
  raw = tiny_raw(optimizer={"clip_norm": clip_norm})
  s = loop.setup(C.from_dict(raw))
  fns, state, step, batches = compiled_steps(raw, steps=1)
  ref = _full_batch_grad_norm(s, jax.device_get(state.params), jnp.asarray(batches[0]["tokens"]))
  _, m = step(state, batches[0])
  m = jax.device_get(m)
  assert ref > 1e-2
  np.testing.assert_allclose(float(m["grad_norm"]), ref, rtol=2e-5)
  fired = clip_norm < ref
  assert float(m["clip_fired"]) == float(fired)
  np.testing.assert_allclose(float(m["grad_norm_clipped"]), clip_norm if fired else ref,
                             rtol=2e-5)


def test_rows_clip_fraction_over_the_window():
  """Each cell's row: the last step's values, ``clip_fraction`` over every step of the window,
  no per-step flag."""
  fetched = [{"loss": np.array([1.0, 2.0]), "clip_fired": np.array([1.0, 0.0]),
              "skipped": np.array([0, 0]), "consec": np.array([0, 0])},
             {"loss": np.array([3.0, 4.0]), "clip_fired": np.array([1.0, 1.0]),
              "skipped": np.array([0, 0]), "consec": np.array([0, 0])},
             {"loss": np.array([5.0, 6.0]), "clip_fired": np.array([0.0, 0.0]),
              "skipped": np.array([0, 1]), "consec": np.array([0, 1])}]
  rows = progress.rows(30, fetched, 2, metrics.Meter(10), 1.0)
  assert [r["loss"] for r in rows] == [5.0, 6.0]
  assert [r["clip_fraction"] for r in rows] == [2 / 3, 1 / 3]
  assert all("clip_fired" not in r for r in rows)
  assert [r["skipped"] for r in rows] == [0, 1]


def test_run_logs_clip_columns_to_jsonl_and_tensorboard(tmp_path):
  """A clip far below the gradient norm fires on every step of every window."""
  ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
  raw = tiny_raw(run={"steps": 4, "log_every": 2, "eval_every": 0, "checkpoint_every": 0,
                      "async_checkpoint": False},
                 optimizer={"clip_norm": 1e-3})
  loop.train(C.from_dict(raw), tmp_path)
  rows = metrics.read_metrics(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in rows] == [2, 4]
  for r in rows:
    assert r["clip_fraction"] == 1.0 and "clip_fired" not in r
    assert r["grad_norm"] > 1e-2
    np.testing.assert_allclose(r["grad_norm_clipped"], 1e-3, rtol=1e-5)
  acc = ea.EventAccumulator(str(tmp_path / "tb"), size_guidance={ea.SCALARS: 0})
  acc.Reload()
  for tag in ("grad_norm", "grad_norm_clipped", "clip_fraction"):
    assert [e.step for e in acc.Scalars(tag)] == [2, 4]
