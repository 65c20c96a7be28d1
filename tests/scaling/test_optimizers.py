"""Each optimizer transform against a plain-numpy reference of its update rule."""

import jax
import jax.numpy as jnp
import numpy as np

from scaleopt.scaling import optimizers as opt


def _rand(seed, d=3, n=7):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((50, n)) * np.arange(1, n + 1) ** -0.8
  a = x.T @ x / 50
  return rng.standard_normal((d, n)), a


def _curv(a):
  mu, v = np.linalg.eigh(a)
  return opt.Curvature(jnp.asarray(mu), jnp.asarray(v))


def test_matrix_sign_is_polar_factor():
  with jax.enable_x64(True):
    g, _ = _rand(0)
    u, _, vt = np.linalg.svd(g, full_matrices=False)
    np.testing.assert_allclose(opt.matrix_sign(jnp.asarray(g)), u @ vt, atol=1e-9)


def test_eig_preconditioners_match_numpy():
  with jax.enable_x64(True):
    g, a = _rand(1)
    curv = _curv(a)
    delta = 1e-2 * np.linalg.eigvalsh(a).max()
    ng = opt.build("ng", {"lr": jnp.asarray(1.0), "damping": jnp.asarray(1e-2)},
                   {"lr_scale": "abs"}, curv, 5)
    upd, _ = ng.update(jnp.asarray(g), ng.init(jnp.asarray(g)))
    np.testing.assert_allclose(upd, -g @ np.linalg.inv(a + delta * np.eye(7)), rtol=1e-8)
    mu, v = np.linalg.eigh(a)
    inv_sqrt = v @ np.diag((mu + delta) ** -0.5) @ v.T
    ks = opt.build("kron_sqrt", {"lr": jnp.asarray(0.3), "damping": jnp.asarray(1e-2)},
                   {"lr_scale": "abs"}, curv, 5)
    upd, _ = ks.update(jnp.asarray(g), ks.init(jnp.asarray(g)))
    np.testing.assert_allclose(upd, -0.3 * g @ inv_sqrt, rtol=1e-8)


def test_ng_solves_quadratic_in_one_step():
  with jax.enable_x64(True):
    w_star, a = _rand(2)
    b = w_star @ a
    tx = opt.build("ng", {"lr": jnp.asarray(1.0), "damping": jnp.asarray(1e-13)},
                   {"lr_scale": "curvature"}, _curv(a), 1)
    w = jnp.zeros_like(jnp.asarray(b))
    upd, _ = tx.update(w @ a - b, tx.init(w))
    np.testing.assert_allclose(w + upd, w_star, rtol=1e-6, atol=1e-8)


def test_curvature_scaled_gd_step_is_lr_over_lambda_max():
  with jax.enable_x64(True):
    g, a = _rand(3)
    tx = opt.build("gd", {"lr": jnp.asarray(0.5)}, {"lr_scale": "curvature"}, _curv(a), 1)
    upd, _ = tx.update(jnp.asarray(g), tx.init(jnp.asarray(g)))
    np.testing.assert_allclose(upd, -0.5 * g / np.linalg.eigvalsh(a).max(), rtol=1e-10)


def test_shampoo_two_steps_match_numpy():
  def mpow(s, p, eps):
    w, q = np.linalg.eigh(s)
    w = np.clip(w, 0, None)
    return q @ np.diag((w + eps * w.max()) ** p) @ q.T

  with jax.enable_x64(True):
    g1, a = _rand(4)
    g2, _ = _rand(5)
    tx = opt.build("shampoo", {"lr": jnp.asarray(0.1), "eps": jnp.asarray(1e-6)},
                   {"lr_scale": "abs"}, _curv(a), 2)
    st = tx.init(jnp.asarray(g1))
    _, st = tx.update(jnp.asarray(g1), st)
    upd, _ = tx.update(jnp.asarray(g2), st)
    left = g1 @ g1.T + g2 @ g2.T
    right = g1.T @ g1 + g2.T @ g2
    ref = -0.1 * mpow(left, -0.25, 1e-6) @ g2 @ mpow(right, -0.25, 1e-6)
    np.testing.assert_allclose(upd, ref, rtol=1e-7)


def test_msign_linear_schedule_and_adam_match_reference():
  with jax.enable_x64(True):
    g, a = _rand(6)
    tx = opt.build("msign", {"lr": jnp.asarray(0.2), "momentum": jnp.asarray(0.0)},
                   {"lr_scale": "abs", "schedule": "linear"}, _curv(a), 4)
    st = tx.init(jnp.asarray(g))
    u, _, vt = np.linalg.svd(g, full_matrices=False)
    for t in range(3):
      upd, st = tx.update(jnp.asarray(g), st)
      np.testing.assert_allclose(upd, -0.2 * (1 - t / 4) * u @ vt, atol=1e-9)
    ad = opt.build("adam", {"lr": jnp.asarray(0.1), "b1": jnp.asarray(0.9),
                            "b2": jnp.asarray(0.999), "eps": jnp.asarray(1e-8)},
                   {"lr_scale": "abs"}, _curv(a), 4)
    upd, _ = ad.update(jnp.asarray(g), ad.init(jnp.asarray(g)))
    np.testing.assert_allclose(upd, -0.1 * g / (np.abs(g) + 1e-8), rtol=1e-7)
