"""The collector's microbatching options against the two-pass scan: one-pass leave-one-out
(``loo_passes=1``, the default, its folds in blocks) and vmapped microbatch gradients
(``vmap_microbatches=True``) must give the same statistics and the same updates, per
coordinate, and cost the expected memory.

Tolerance. The options change where the per-microbatch gradients are computed (inside the scan,
stored from the first sweep, or from one batched ``vmap``), not the arithmetic of the
statistics: the accumulation order over microbatches is the same. One-pass LOO one fold at a
time runs the same gradient computation and the same folds, so it must agree exactly (measured:
bitwise); in blocks (the default) the sums' order changes (float32 rounding). Vmapped gradients
differ by the rounding of the batched forward/backward (XLA blocks a batched matmul
differently), a few float32 ulps per entry (measured ~3e-6 relative on the mean gradient); the
LOO fold's m_hat / d^3 term triples a relative error of d and the fold variance is a difference
of close terms (measured 4e-5). rtol 1e-4 (final parameters 2e-5; fold blocks, which change
only the order of float32 sums, 2e-5 throughout) with an absolute floor of 1e-6 of each leaf's
scale: a 10% change of any coefficient fails by orders of magnitude.
"""


import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scaleopt.optim as so
from scaleopt.optim.collect import CollectorSpec
from scaleopt.study import engines

M = 8


def close(a, b, rtol=1e-4):
  """Per coordinate; rtol=0: exactly equal."""
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(la) == len(lb) and la
  for x, y in zip(la, lb):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    atol = 1e-6 * max(np.abs(y).max(), 1e-30) if rtol else 0.0
    np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


# ----------------------------------------------------------------------------- a small MLP

def mlp():
  k1, k2, k3, k4 = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {"w1": jax.random.normal(k1, (6, 5)) * 0.5, "b1": jnp.full((5,), 0.1),
            "w2": jax.random.normal(k2, (5, 3)) * 0.5}
  mbs = {"x": jax.random.normal(k3, (M, 4, 6)), "y": jax.random.normal(k4, (M, 4, 3))}

  def loss(p, mb):
    err = jnp.tanh(mb["x"] @ p["w1"] + p["b1"]) @ p["w2"] - mb["y"]
    return jnp.mean(err ** 2), {"abs": jnp.mean(jnp.abs(err))}

  return params, mbs, loss


def run(tx, params, mbs, loss, steps=2, **kw):
  """``steps`` jitted steps of collect + update; (stats of every step, final params)."""
  @jax.jit
  def step(p, st, k):
    stats = so.collect(loss, p, mbs, st, key=k, **kw)
    u, st = tx.update(stats.numerator, st, p, bc_stats=stats)
    return optax.apply_updates(p, u), st, stats

  st, out = tx.init(params), []
  for t in range(steps):
    params, st, stats = step(params, st, jax.random.PRNGKey(t))
    out.append(stats)
  return out, params


def adamw_bc_chain(opts, **bc):
  """clip (consistent, active) + options + adamw_bc under inject_hyperparams."""
  inner = optax.inject_hyperparams(so.adamw_bc, static_args=("mode", "crossfit"))(
      learning_rate=1e-2, b2=0.9, **bc)
  return optax.chain(so.clip_by_global_norm(0.05), so.collector_options(**opts), inner)


@functools.cache
def two_pass_loo():
  params, mbs, loss = mlp()
  return run(adamw_bc_chain(dict(loo_passes=2)), params, mbs, loss)


# ----------------------------------------------------------------------------- adamw_bc

@pytest.mark.parametrize("opts,rtol", [  # more storages and k: test_loo_storage
    (dict(loo_fold_chunk=3), 2e-5),  # 3 folds per step of the folds' scan; 3 does not divide 8
    (dict(loo_passes=1, loo_fold_chunk=1), 0.0), (dict(vmap_microbatches=True), 1e-4)],
    ids=["fold_blocks", "one_pass_one_fold", "vmap"])
def test_loo_one_pass_and_vmap_equal_the_two_pass_scan(opts, rtol):
  params, mbs, loss = mlp()
  ref, p_ref = two_pass_loo()
  got, p_got = run(adamw_bc_chain(opts), params, mbs, loss)
  assert float(ref[0].clip_factor) < 0.5  # the clip is active and scales every fold
  for r, g in zip(ref, got):
    close(g.loo.mean, r.loo.mean, rtol)
    close(g.loo.var, r.loo.var, rtol)
    close((g.numerator, g.full, g.loss, g.aux, g.clip_factor),
          (r.numerator, r.full, r.loss, r.aux, r.clip_factor), rtol)
  close(p_got, p_ref, rtol and 2e-5)
  assert not np.allclose(p_got["w1"], params["w1"], rtol=1e-3)  # the steps moved


def _per_microbatch_grads(params, mbs, loss):
  """float64 gradients of each microbatch, one ``jax.grad`` call each (no collector)."""
  out = [jax.grad(lambda p: loss(p, jax.tree.map(lambda x: x[j], mbs))[0])(params)
         for j in range(M)]
  return {k: np.stack([np.asarray(o[k], np.float64) for o in out]) for k in params}


@pytest.mark.parametrize("opts", [{}, dict(loo_passes=2), dict(vmap_microbatches=True)],
                         ids=["default", "two_pass", "vmap"])
def test_loo_first_step_equals_float64_reference(opts):
  """Independent reference, first step (m = v = 0, t = 1, b1 = b2 = 0.9): c = min(1, 0.05 /
  ||g_full||); per fold m_hat_r = c g_r, d_r = |c g_{-r}| + eps (g_{-r} the leave-one-out
  mean), LOO terms mean_r m_hat_r / d_r and mean_r m_hat_r / d_r^3, Var_r(d_r) (ddof 1)."""
  params, mbs, loss = mlp()
  got, _ = run(adamw_bc_chain(opts), params, mbs, loss, steps=1)
  g = _per_microbatch_grads(params, mbs, loss)
  gf = {k: v.mean(0) for k, v in g.items()}
  c = min(1.0, 0.05 / np.sqrt(sum(np.sum(x * x) for x in gf.values())))
  np.testing.assert_allclose(float(got[0].clip_factor), c, rtol=1e-5)
  for k in params:
    g_mr = (M * gf[k] - g[k]) / (M - 1)
    d = np.abs(c * g_mr) + 1e-8
    want = {"first": np.mean(c * g[k] / d, 0), "third": np.mean(c * g[k] / d ** 3, 0)}
    for t in want:
      close(got[0].loo.mean[t][k], want[t], 1e-4)
    close(got[0].loo.var[k], np.var(d, 0, ddof=1), 1e-4)
    close(got[0].numerator[k], c * gf[k], 1e-5)


def test_ab_group_statistics_equal_float64_reference():
  """Independent reference for the A/B layout (vmapped gradients): group means, B's variance
  of the mean M2 / (m_B (m_B - 1)), all scaled by the consistent clip's c (c^2 for Var)."""
  params, mbs, loss = mlp()
  got, _ = run(adamw_bc_chain(dict(vmap_microbatches=True), mode="full", crossfit="ab"),
               params, mbs, loss, steps=1)
  g = _per_microbatch_grads(params, mbs, loss)
  gf = {k: v.mean(0) for k, v in g.items()}
  c = min(1.0, 0.05 / np.sqrt(sum(np.sum(x * x) for x in gf.values())))
  h = M // 2
  for k in params:
    close(got[0].a.mean[k], c * g[k][:h].mean(0), 1e-4)
    close(got[0].b.mean[k], c * g[k][h:].mean(0), 1e-4)
    close(got[0].b.var[k], c * c * np.var(g[k][h:], 0, ddof=1) / h, 1e-4)


@pytest.mark.parametrize("mode,crossfit", [
    ("full", "ab"), pytest.param("inv", "ab", marks=pytest.mark.integration)])
def test_vmap_equals_scan_for_group_layouts(mode, crossfit):
  params, mbs, loss = mlp()
  bc = dict(mode=mode, crossfit=crossfit)
  ref, p_ref = run(adamw_bc_chain({}, **bc), params, mbs, loss)
  got, p_got = run(adamw_bc_chain(dict(vmap_microbatches=True), **bc), params, mbs, loss)
  for r, g in zip(ref, got):
    close((g.numerator, g.full, g.loss, g.aux, g.a, g.b), (r.numerator, r.full, r.loss, r.aux,
                                                          r.a, r.b))
  close(p_got, p_ref)


# ----------------------------------------------------------------------------- sophia, shampoo

def softmax_regression():
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(3), 3)
  params = {"w": jax.random.normal(k1, (4, 3)) * 0.3}
  mbs = {"x": jax.random.normal(k2, (M, 5, 4)), "y": jax.random.randint(k3, (M, 5), 0, 3)}

  def logits_fn(p, mb):
    return mb["x"] @ p["w"], jnp.ones(mb["y"].shape, jnp.float32)

  def loss(p, mb):
    lg = logits_fn(p, mb)[0]
    ll = jnp.take_along_axis(jax.nn.log_softmax(lg), mb["y"][:, None], -1)
    return -jnp.mean(ll), {}

  return params, mbs, loss, logits_fn


def test_sophia_bc_vmap_equals_scan(estimator="gnb"):
  params, mbs, loss, logits_fn = softmax_regression()
  make = lambda opts: optax.chain(so.clip_by_global_norm(0.05), so.collector_options(**opts),
                                  so.sophia_bc(1e-2, k=2, estimator=estimator,
                                               statistic="mean_sq"))
  ref, p_ref = run(make({}), params, mbs, loss, logits_fn=logits_fn)
  got, p_got = run(make(dict(vmap_microbatches=True)), params, mbs, loss, logits_fn=logits_fn)
  assert bool(ref[0].precond.refresh) and not bool(ref[1].precond.refresh)
  assert float(ref[0].clip_factor) < 0.5
  for r, g in zip(ref, got):
    close((g.numerator, g.loss, g.precond.var, g.clip_factor),
          (r.numerator, r.loss, r.precond.var, r.clip_factor))
    close(g.precond.h_step, r.precond.h_step)
  close(p_got, p_ref)


def test_shampoo_bc_vmap_equals_scan():
  k1, k2 = jax.random.split(jax.random.PRNGKey(5))
  params = {"w": jax.random.normal(k1, (6, 4)) * 0.3}
  mbs = jax.random.normal(k2, (M, 3, 6))
  loss = lambda p, x: (jnp.mean(jnp.tanh(x @ p["w"]) ** 2), {})
  make = lambda opts: optax.chain(so.clip_by_global_norm(0.05), so.collector_options(**opts),
                                  so.shampoo_bc(1e-2, block_size=64, root_every=1,
                                                damping=1e-3))
  ref, p_ref = run(make({}), params, mbs, loss)
  got, p_got = run(make(dict(vmap_microbatches=True)), params, mbs, loss)
  assert float(ref[0].clip_factor) < 0.5
  for r, g in zip(ref, got):
    close((g.numerator, g.full, g.loss, g.clip_factor), (r.numerator, r.full, r.loss,
                                                         r.clip_factor))
    close(g.precond, r.precond, rtol=1e-4)  # eigenvectors: float32 eigh of the same factors
  close(p_got, p_ref, rtol=1e-4)


# ----------------------------------------------------------------------------- memory

@pytest.mark.integration  # six compiles (~10 s)
def test_compiled_memory_grows_by_m_gradient_copies():
  """One-pass LOO and vmapped microbatches hold the m float32 gradients: from m to 2m
  microbatches their compiled temporaries grow by m x params x 4 bytes, the two-pass scan's
  not at all (its temporaries do not depend on m, tests/optim/test_collect.py)."""
  d, m = 192, 8
  params = {"w1": jnp.zeros((d, d)), "w2": jnp.zeros((d, d))}
  loss = lambda p, mb: (jnp.mean((jnp.tanh(mb["x"] @ p["w1"]) @ p["w2"] - mb["y"]) ** 2), {})

  def temp(opts, n=m, **bc):
    mbs = {"x": jnp.zeros((n, 2, d)), "y": jnp.zeros((n, 2, d))}
    tx = optax.chain(so.collector_options(**opts), so.adamw_bc(1e-3, **bc))
    f = jax.jit(lambda p, b, s: so.collect(loss, p, b, s))
    return f.lower(params, mbs, tx.init(params)).compile().memory_analysis().temp_size_in_bytes

  extra = m * 2 * d * d * 4
  grows = lambda opts, **bc: temp(opts, 2 * m, **bc) - temp(opts, m, **bc)
  one = dict(loo_fold_chunk=1)  # unrolled folds' temporaries could add to the count
  assert abs(grows(dict(loo_passes=2))) <= 0.05 * extra
  assert 0.95 * extra <= grows(dict(loo_passes=1, **one)) <= 1.05 * extra
  assert temp(one) == temp(dict(loo_passes=1, **one))  # the default stores the m gradients
  assert 0.95 * extra <= grows(dict(vmap_microbatches=True, **one)) <= 1.1 * extra
  # A/B: two groups of m/2, each stacked (m/2 to m copies alive, as XLA schedules them)
  ab, ab_vm = temp({}, crossfit="ab"), temp(dict(vmap_microbatches=True), crossfit="ab")
  assert 0.45 * extra <= ab_vm - ab <= 1.1 * extra, (ab, ab_vm, extra)

# ----------------------------------------------------------------------------- spec, accounting

def test_options_set_the_spec_and_the_sweep_accounting():
  base = dict(name="adamw_bc", learning_rate=1e-3)
  spec = lambda **ex: so.build({**base, "extra": ex})[1]
  assert spec().passes_per_step == 1.0 and spec().loo_one_pass and not spec().vmap
  assert spec(loo_passes=1).passes_per_step == 1.0
  assert spec(loo_passes=2).passes_per_step == 2.0 and not spec(loo_passes=2).loo_one_pass
  assert spec(vmap_microbatches=True).passes_per_step == 1.0 and spec(vmap_microbatches=True).vmap
  assert spec(mode="full", crossfit="ab", vmap_microbatches=True).passes_per_step == 1.0

  class Data:
    batch_size = 16

  class Cfg:
    data = Data

  assert engines.gradient_passes(Cfg, spec(loo_passes=1), 10) == 160.0
  assert engines.gradient_passes(Cfg, spec(), 10) == 160.0
  assert engines.gradient_passes(Cfg, spec(loo_passes=2), 10) == 320.0
  sh = so.build({"name": "shampoo_bc", "learning_rate": 1e-3,
                 "extra": {"vmap_microbatches": True}})[1]
  assert sh.vmap and sh.estimator == "shampoo"


@pytest.mark.parametrize("extra,match", [
    (dict(crossfit="ab", loo_passes=1), "leave-one-out layout"),
    (dict(loo_passes=2, vmap_microbatches=True), "loo_passes=1"),
    (dict(loo_passes=3), "loo_passes=3"),
    (dict(vmap_microbatches="yes"), "vmap_microbatches='yes'"),
])
def test_bad_options_are_one_line_errors(extra, match):
  with pytest.raises(ValueError, match=match):
    so.build({"name": "adamw_bc", "learning_rate": 1e-3, "extra": extra})


def test_conflicting_options_in_one_chain():
  tx = optax.chain(so.collector_options(vmap_microbatches=True),
                   so.collector_options(vmap_microbatches=False), so.adamw_bc(1e-3))
  with pytest.raises(ValueError, match="vmap_microbatches"):
    so.collector_spec(tx)
  with pytest.raises(ValueError, match="loo_passes"):
    so.build({"name": "adamw", "learning_rate": 1e-3, "extra": {"loo_passes": 1}})
  assert CollectorSpec().passes_per_step == 1.0
