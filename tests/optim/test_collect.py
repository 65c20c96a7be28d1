"""The microbatch statistics collector against a naive stack-every-gradient reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from typing import NamedTuple

import scaleopt.optim as so
from scaleopt.optim.collect import CollectorSpec, Static, StateHooks


class Needs(NamedTuple):
  """A user-registered state type that asks the collector for a spec (the protocol)."""
  spec: Static
  hp: dict


class LooNeeds(NamedTuple):
  spec: Static
  hp: dict


so.register_bc_state(Needs)


def needs(**kw):
  return Needs(Static(CollectorSpec(**kw)), {})


def mlp_params(key, d_in=6, d_h=5, d_out=3):
  k1, k2 = jax.random.split(key)
  return {"l1": {"w": jax.random.normal(k1, (d_in, d_h)) * 0.5, "b": jnp.full((d_h,), 0.1)},
          "l2": {"w": jax.random.normal(k2, (d_h, d_out)) * 0.5}}


def mlp_loss(p, mb):
  x, y = mb["x"], mb["y"]
  h = jnp.tanh(x @ p["l1"]["w"] + p["l1"]["b"])
  err = h @ p["l2"]["w"] - y
  return jnp.mean(err ** 2), {"abs_err": jnp.mean(jnp.abs(err))}


def make_mbs(key, m, mb=4, d_in=6, d_out=3):
  kx, ky = jax.random.split(key)
  return {"x": jax.random.normal(kx, (m, mb, d_in)), "y": jax.random.normal(ky, (m, mb, d_out))}


def stacked(params, mbs):
  """Per-microbatch gradients, losses and aux, stacked (float64 numpy)."""
  vg = jax.value_and_grad(mlp_loss, has_aux=True)
  out = [vg(params, jax.tree.map(lambda x: x[j], mbs)) for j in range(mbs["x"].shape[0])]
  gs = [jax.tree.map(lambda a: np.asarray(a, np.float64), o[1]) for o in out]
  g = jax.tree.map(lambda *a: np.stack(a), *gs)
  loss = np.array([float(o[0][0]) for o in out])
  aux = np.array([float(o[0][1]["abs_err"]) for o in out])
  return g, loss, aux


def ref_group(g):
  m = jax.tree.leaves(g)[0].shape[0]
  mean = jax.tree.map(lambda a: a.mean(0), g)
  sq = jax.tree.map(lambda a: (a * a).mean(0), g)
  var_g = jax.tree.map(lambda a: a.var(0, ddof=1) / m, g)
  var_sq = jax.tree.map(lambda a: (a * a).var(0, ddof=1) / m, g)
  return mean, sq, var_g, var_sq


def assert_tree_close(a, b, rtol=2e-5, atol=1e-7):
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    np.testing.assert_allclose(np.asarray(x, np.float64), np.asarray(y, np.float64),
                               rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def setup():
  params = mlp_params(jax.random.PRNGKey(0))
  mbs = make_mbs(jax.random.PRNGKey(1), 8)
  return params, mbs, stacked(params, mbs)


@pytest.mark.parametrize("var_of", [None, "grad", "sq"])
def test_all_layout(setup, var_of):
  params, mbs, (g, loss, aux) = setup
  spec = CollectorSpec(layout="all", var_of=var_of, need_sq=True)
  st = jax.jit(lambda p, b: so.collect(mlp_loss, p, b, Needs(Static(spec), {})))(params, mbs)
  mean, sq, var_g, var_sq = ref_group(g)
  assert_tree_close(st.full, mean)
  assert_tree_close(st.numerator, mean)
  assert_tree_close(st.b.sq, sq, rtol=1e-4)
  if var_of == "grad":
    assert_tree_close(st.b.var, var_g, rtol=1e-4, atol=1e-9)
  elif var_of == "sq":
    assert_tree_close(st.b.var, var_sq, rtol=1e-4, atol=1e-9)
  else:
    assert st.b.var is None
  np.testing.assert_allclose(float(st.loss), loss.mean(), rtol=1e-5)
  np.testing.assert_allclose(float(st.aux["abs_err"]), aux.mean(), rtol=1e-5)


@pytest.mark.parametrize("layout", ["ab", "symmetric", "rolling_b"])
def test_two_group_layouts(setup, layout):
  params, mbs, (g, loss, _) = setup
  spec = needs(layout=layout, var_of="grad", need_sq=True)
  if layout == "rolling_b":
    b_mbs = make_mbs(jax.random.PRNGKey(7), 5)
    g_b, loss_b, _ = stacked(params, b_mbs)
    g_a, loss_a = g, loss
    st = jax.jit(lambda p, a, b: so.collect(mlp_loss, p, a, spec, b_microbatches=b))(
        params, mbs, b_mbs)
  else:
    g_a = jax.tree.map(lambda a: a[:4], g)
    g_b = jax.tree.map(lambda a: a[4:], g)
    loss_a, loss_b = loss[:4], loss[4:]
    st = jax.jit(lambda p, b: so.collect(mlp_loss, p, b, spec))(params, mbs)
  mean_a, sq_a, var_a, _ = ref_group(g_a)
  mean_b, sq_b, var_b, _ = ref_group(g_b)
  assert_tree_close(st.a.mean, mean_a)
  assert_tree_close(st.b.mean, mean_b)
  assert_tree_close(st.b.sq, sq_b, rtol=1e-4)
  assert_tree_close(st.b.var, var_b, rtol=1e-4, atol=1e-9)
  if layout == "symmetric":
    assert_tree_close(st.a.var, var_a, rtol=1e-4, atol=1e-9)
    assert_tree_close(st.a.sq, sq_a, rtol=1e-4)
    assert_tree_close(st.numerator, jax.tree.map(lambda a: a.mean(0), g))
  else:
    assert st.a.var is None  # the numerator group needs no variance
    assert_tree_close(st.numerator, mean_a)
  if layout == "rolling_b":  # B is the next step's A: the step's own data is A
    assert_tree_close(st.full, mean_a)
    np.testing.assert_allclose(float(st.loss), loss_a.mean(), rtol=1e-5)
    return
  g_all = jax.tree.map(lambda a, b: np.concatenate([a, b]), g_a, g_b)
  assert_tree_close(st.full, jax.tree.map(lambda a: a.mean(0), g_all))
  np.testing.assert_allclose(float(st.loss), np.concatenate([loss_a, loss_b]).mean(), rtol=1e-5)


@pytest.mark.parametrize("passes", [None, 2], ids=["default_one_pass", "two_pass"])
def test_loo_layout_runs_fold_fn_on_every_microbatch(setup, passes):
  params, mbs, (g, _, _) = setup
  m = 8

  def fold_fn(state, hp, g_full, m_):
    def fold(g_r):  # leave-one-out mean and a nonlinear per-fold quantity
      g_mr = jax.tree.map(lambda r, f: (m_ * f - r) / (m_ - 1), g_r, g_full)
      return {"loo": g_mr}, jax.tree.map(lambda x: x * x, g_mr)
    return fold

  so.register_bc_state(LooNeeds, StateHooks(fold_fn=fold_fn))
  state = LooNeeds(Static(CollectorSpec(layout="loo", loo_passes=passes)), {})
  st = jax.jit(lambda p, b: so.collect(mlp_loss, p, b, state))(params, mbs)
  full = jax.tree.map(lambda a: a.mean(0), g)
  loo = jax.tree.map(lambda a, f: (m * f[None] - a) / (m - 1), g, full)  # [m, ...]
  assert_tree_close(st.full, full)
  assert_tree_close(st.loo.mean["loo"], jax.tree.map(lambda a: a.mean(0), loo))
  assert_tree_close(st.loo.var, jax.tree.map(lambda a: (a * a).var(0, ddof=1), loo),
                    rtol=1e-3, atol=1e-9)


def test_errors():
  params = mlp_params(jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match="layout"):
    CollectorSpec(layout="abc")
  with pytest.raises(ValueError, match="at least 2 microbatches"):
    so.collect(mlp_loss, params, make_mbs(jax.random.PRNGKey(1), 2),
               needs(layout="ab", var_of="grad"))
  with pytest.raises(ValueError, match="odd"):
    so.collect(mlp_loss, params, make_mbs(jax.random.PRNGKey(1), 5), needs(layout="ab"))
  with pytest.raises(ValueError, match="b_microbatches"):
    so.collect(mlp_loss, params, make_mbs(jax.random.PRNGKey(1), 4), needs(layout="rolling_b"))
  with pytest.raises(ValueError, match="different layouts"):
    so.collect(mlp_loss, params, make_mbs(jax.random.PRNGKey(1), 4),
               (needs(layout="ab"), needs(layout="loo")))


def _temp_bytes(m, d=256):
  params = {"w1": jnp.zeros((d, d)), "w2": jnp.zeros((d, d)), "w3": jnp.zeros((d, d))}

  def loss(p, mb):
    h = jnp.tanh(mb["x"] @ p["w1"])
    h = jnp.tanh(h @ p["w2"])
    return jnp.mean((h @ p["w3"] - mb["y"]) ** 2), {}

  mbs = {"x": jnp.zeros((m, 2, d)), "y": jnp.zeros((m, 2, d))}
  spec = needs(layout="ab", var_of="grad", need_sq=True)
  f = jax.jit(lambda p, b: so.collect(loss, p, b, spec))
  return f.lower(params, mbs).compile().memory_analysis().temp_size_in_bytes


def test_memory_independent_of_microbatch_count():
  t4, t32 = _temp_bytes(4), _temp_bytes(32)
  param_bytes = 3 * 256 * 256 * 4
  assert t32 > 0
  # stacking 32 gradient copies would cost 32 * param_bytes more; allow 10%
  assert abs(t32 - t4) <= 0.10 * t4, (t4, t32, param_bytes)


def test_memory_measurement_detects_stacking():
  """Negative control: a collector that stacks m gradients does show growing temporaries."""
  d = 256
  params = {"w1": jnp.zeros((d, d)), "w2": jnp.zeros((d, d))}

  def loss(p, mb):
    return jnp.mean((jnp.tanh(mb["x"] @ p["w1"]) @ p["w2"] - mb["y"]) ** 2)

  def temp(m):
    mbs = {"x": jnp.zeros((m, 2, d)), "y": jnp.zeros((m, 2, d))}
    naive = lambda p, b: jax.tree.map(lambda a: a.var(0), jax.vmap(
        lambda mb: jax.grad(loss)(p, mb))(b))
    return jax.jit(naive).lower(params, mbs).compile().memory_analysis().temp_size_in_bytes

  assert temp(32) > 4 * temp(4)
