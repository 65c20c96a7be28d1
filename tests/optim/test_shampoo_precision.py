"""Shampoo's matmul precision options: where they reach and how far the update may move."""

import inspect
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from scaleopt.optim import shampoo_lib as S

BF16 = "lhs_precision_type = bf16, rhs_precision_type = bf16"


def _problem(seed=0, scale=1):
  """Two matrices and a vector; ``scale`` multiplies the matrices' dims."""
  rng = np.random.default_rng(seed)
  params = {"w": rng.normal(size=(8 * scale, 12 * scale)),
            "v": rng.normal(size=(12 * scale, 6 * scale)), "b": rng.normal(size=6)}
  grads = [{k: rng.normal(size=v.shape) * (1.0 + np.arange(v.shape[-1]) / 3.0)
            for k, v in params.items()} for _ in range(8)]
  f32 = lambda t: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), t)
  return f32(params), [f32(g) for g in grads]


def _dots(text):
  """(precision config, algorithm or '') of every dot_general in a StableHLO text."""
  out = []
  for line in text.splitlines():
    if "stablehlo.dot_general" in line:
      p = re.search(r"precision = \[(\w+), (\w+)\]", line)
      out.append((p.group(1) if p else "DEFAULT", BF16 if BF16 in line else ""))
  return out


def test_precisions_reach_their_dots_and_roots_stay_highest():
  """Two matrices: 2 statistics dots (G G^T, G^T G) and 2 preconditioner dots (P_L M, . P_R)
  each take their own option; the root dots stay HIGHEST."""
  params, grads = _problem()
  tx = lambda **kw: S.scale_by_shampoo(block_size=64, root_method="eigh", **kw)
  lowered = lambda **kw: jax.jit(tx(**kw).update).lower(
      grads[0], tx(**kw).init(params), params).as_text()
  base = _dots(lowered(matmul_precision="highest", stats_precision="highest"))
  assert base and all(d == ("HIGHEST", "") for d in base)
  defaults = _dots(lowered())  # "high": statistics and P_L M P_R of 2 matrices
  assert sum(d == ("HIGH", "") for d in defaults) == 8
  assert sum(d == ("HIGHEST", "") for d in defaults) == len(base) - 8 > 0  # roots
  got = _dots(lowered(matmul_precision="BF16_BF16_F32", stats_precision="default"))
  assert len(got) == len(base)
  assert sum(a == BF16 for _, a in got) == 2 * 2  # P_L M P_R of 2 matrices
  assert sum(d == ("DEFAULT", "") for d in got) == 2 * 2  # G G^T, G^T G of 2 matrices
  assert sum(d == ("HIGHEST", "") for d in got) == len(base) - 8 > 0  # roots
  only_stats = _dots(lowered(matmul_precision="highest"))
  assert sum(p == "HIGH" for p, _ in only_stats) == 4
  assert sum(p == "HIGHEST" for p, _ in only_stats) == len(base) - 4


def test_collector_statistics_take_stats_precision():
  """shampoo_bc's B-side statistics (the collector's factor pass) take stats_precision; the
  projections of the two-pass correction stay HIGHEST."""
  import scaleopt.optim as so
  params = {"w": jnp.zeros((6, 5), jnp.float32)}
  gs = jnp.ones((4, 6, 5), jnp.float32)
  loss_fn = lambda p, mb: (jnp.sum(p["w"] * mb), {})

  def dots(**kw):
    tx = S.scale_by_shampoo(block_size=64, root_every=1, mode="full", **kw)
    st = tx.init(params)
    return _dots(jax.jit(lambda s: so.collect(loss_fn, params, gs, s)).lower(st).as_text())

  base, got = dots(stats_precision="highest"), dots(stats_precision="BF16_BF16_F32")
  assert sum(d == ("HIGH", "") for d in dots()) == 2  # the default "high"
  assert base and all(d == ("HIGHEST", "") for d in base)
  assert len(got) == len(base) and sum(a == BF16 for _, a in got) == 2  # G G^T, G^T G
  assert sum(d == ("HIGHEST", "") for d in got) == len(base) - 2 > 0


# Stored mantissa bits of a matmul pass on NVIDIA GPUs: "high" and "default" run TF32 (on TPU
# "high" is three bfloat16 passes, about 16 bits: the 10-bit emulation bounds it too).
MANTISSA = {"BF16_BF16_F32": 7, "default": 10, "high": 10}
ACCELERATOR_ONLY = pytest.mark.skipif(
    jax.default_backend() == "cpu",
    reason="on CPU every precision option computes in float32: the test could not fail there")


def _round(x, bits):
  """float32 values rounded to ``bits`` stored mantissa bits (to nearest, ties to even)."""
  x = np.asarray(x, np.float32)
  if bits >= 23:
    return x
  u, drop = x.view(np.uint32).astype(np.uint64), 23 - bits
  u = (u + (1 << (drop - 1)) - 1 + ((u >> drop) & 1)) >> drop << drop
  return u.astype(np.uint32).view(np.float32)


def _mm(a, b, bits):
  """One emulated accelerator pass: inputs rounded to ``bits``, exact products (float64), the
  result stored in float32."""
  f64 = lambda x: _round(x, bits).astype(np.float64)
  return (f64(a) @ f64(b)).astype(np.float32)


def test_mantissa_rounding_matches_an_independent_rounding():
  """``_round`` (bit arithmetic) against frexp/ldexp with NumPy's round-half-even, and against
  JAX's bfloat16 cast at 7 bits."""
  rng = np.random.default_rng(5)
  x = (rng.normal(size=4000) * 10.0 ** rng.uniform(-6, 6, 4000)).astype(np.float32)
  x[:4] = [1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, -(1 + 2.0 ** -8), 0.0]  # ties, a negative, 0
  for bits in (7, 10):
    m, e = np.frexp(x.astype(np.float64))
    ref = np.ldexp(np.round(m * 2.0 ** (bits + 1)), e - bits - 1)
    np.testing.assert_array_equal(_round(x, bits).astype(np.float64), ref)
  np.testing.assert_array_equal(
      _round(x, 7), np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)))


def _newton_emulated(a, damping, bits, p=4, iters=30):
  """``newton_inverse_root`` of each matrix of ``a`` (float32), transcribed with every matmul
  an emulated pass of ``bits`` (``_mm``): the same scaling, iteration and stopping rules."""
  n = a.shape[-1]
  eye = np.eye(n, dtype=np.float32)
  out = []
  for f in a:
    f = (0.5 * (f + f.T)).astype(np.float32) + np.float32(damping) * eye
    z = np.float32((1.0 + p) / (2.0 * np.linalg.norm(f.astype(np.float64))))
    m, x = f * z, eye * np.float32(z ** (1.0 / p))
    e = np.linalg.norm(m - eye)
    for _ in range(iters):
      t = (((p + 1.0) * eye - m) / p).astype(np.float32)
      x_new, t2 = _mm(x, t, bits), _mm(t, t, bits)
      m_new = _mm(_mm(t2, t2, bits), m, bits)
      e_new = np.linalg.norm(m_new - eye)
      if not e_new < e:
        break
      stall = e < 0.1 and e_new > 0.5 * e
      x, m, e = x_new, m_new, e_new
      if stall:
        break
    out.append(0.5 * (x + x.T))
  return np.stack(out)


# The update test's Shampoo: learning rate, b1, b2, eps and block size (shared by the run and
# its emulation).
UPDATE_HP = dict(lr=1e-2, b1=0.9, b2=0.95, eps=1e-8, block_size=96)


def _update_error_emulated(state, params, bits, lr, b1, b2, eps, block_size):
  """{name: lr x (the grafted P_L M P_R of every block with ``_mm`` passes of ``bits`` - the
  same in float64)} from the optimizer state after a step (the P_L, P_R, momentum and Adam
  moments that step used)."""
  names = sorted(params)  # a dict's leaves are in key order
  t = float(state.count)
  out = {}
  for i, k in enumerate(names):
    f = state.factors.get(str(i))
    if f is None:
      continue
    blk = S.blocking(params[k].shape, block_size)
    mu, nu = np.asarray(state.mu[k]), np.asarray(state.nu[k])
    adam = (mu / (1 - b1 ** t)) / (np.sqrt(nu / (1 - b2 ** t)) + eps)
    a = np.asarray(S.block_norms(jnp.asarray(adam, jnp.float32), blk), np.float64)
    pl, m, pr = np.asarray(f.PL), np.asarray(S.to_blocks(jnp.asarray(mu), blk)), np.asarray(f.PR)
    exact = pl.astype(np.float64) @ m.astype(np.float64) @ pr.astype(np.float64)
    got = _mm(_mm(pl, m, bits), pr, bits).astype(np.float64)
    unit = lambda u: u / np.linalg.norm(u, axis=(1, 2), keepdims=True)
    diff = lr * a * (unit(got) - unit(exact))
    out[k] = np.asarray(S.from_blocks(jnp.asarray(diff, jnp.float32), params[k].shape, blk),
                        np.float64)
  return out


def _shampoo_run(params, grads, **kw):
  """(updates, Shampoo states) of the precision test's problem, one per step (float32 Newton
  roots, as a GPU run with ``newton_precision="highest"`` takes)."""
  hp = UPDATE_HP
  tx = S.shampoo(hp["lr"], hp["b1"], hp["b2"], hp["eps"], block_size=hp["block_size"],
                 root_every=3, damping=1e-3, root_method="newton", newton_precision="highest",
                 stats_precision="highest", **kw)
  th, st, out = params, tx.init(params), []
  step = jax.jit(tx.update)
  for g in grads:
    u, st = step(g, st, th)
    th = optax.apply_updates(th, u)
    out.append((u, st[0]))
  return out


@ACCELERATOR_ONLY
@pytest.mark.parametrize("prec", sorted(MANTISSA))
def test_lower_precision_update_within_its_bound(prec):
  """The update at ``matmul_precision=prec`` against "highest", per step and tensor: its
  largest and RMS coordinate error within 2x those of an emulation of the same steps (P_L M
  and (P_L M) P_R with inputs rounded to the pass's mantissa, ``_update_error_emulated``) plus
  a few float32 ulps. The statistics stay "highest" (their rounding would reach the update
  through the roots). Blocks of 64 x 96 and 96 x 96: on tiny blocks XLA:GPU picks float32
  kernels whatever the precision, and the check that the update moved would fail."""
  params, grads = _problem(1, scale=16)
  ref = _shampoo_run(params, grads, matmul_precision="highest")
  got = _shampoo_run(params, grads, matmul_precision=prec)
  moved = max(np.abs(np.asarray(u[k]) - np.asarray(r[k])).max() for (r, _), (u, _) in
              zip(ref, got) for k in ("w", "v"))
  assert moved > 0, f"{prec} computed the same update as 'highest': nothing was rounded"
  for (u_ref, st), (u, _) in zip(ref, got):
    emu = _update_error_emulated(st, params, MANTISSA[prec], **UPDATE_HP)
    for k in ("w", "v"):
      a, b = np.asarray(u_ref[k], np.float64), np.asarray(u[k], np.float64)
      floor = 4 * 2.0 ** -24 * np.abs(a).max()
      assert np.abs(b - a).max() <= 2 * np.abs(emu[k]).max() + floor, k
      assert np.sqrt(np.mean((b - a) ** 2)) <= 2 * np.sqrt(np.mean(emu[k] ** 2)) + floor, k


def test_bad_precision_is_a_one_line_error():
  with pytest.raises(ValueError, match=r"matmul_precision='fp8' is not allowed; choose one of"):
    S.scale_by_shampoo(matmul_precision="fp8")
  with pytest.raises(ValueError, match=r"stats_precision='bf16'"):
    S.shampoo(1e-3, stats_precision="bf16")


def test_block_norms_equal_norms_of_the_blocks():
  """block_norms (no block layout) equals the norms of to_blocks' blocks, padding included."""
  x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 7, 10)), jnp.float32)
  blk = S.blocking(x.shape, 4)
  ref = np.linalg.norm(np.asarray(S.to_blocks(x, blk)), axis=(1, 2))
  np.testing.assert_allclose(np.asarray(S.block_norms(x, blk))[:, 0, 0], ref, rtol=1e-6)


def test_eigh_implementation_reaches_the_solver():
  """"jacobi" selects cuSOLVER's Jacobi solver (lowered for a GPU: no GPU needed); "qr" on CPU
  gives the default roots; "jacobi" on CPU is a one-line error."""
  f = jnp.asarray(np.random.default_rng(4).normal(size=(3, 8, 8)), jnp.float32)
  f = f @ jnp.swapaxes(f, 1, 2)
  algo = lambda impl: re.findall(r"algorithm = (\d) : ui8", jax.jit(
      lambda x: S.eigh_damped(x, 1e-3, 1e-6, impl)).trace(f).lower(
          lowering_platforms=("cuda",)).as_text())
  assert algo(None) == ["0"] and algo("qr") == ["1"] and algo("jacobi") == ["2"]
  ref = np.asarray(S.root_from_eig(*S.eigh_damped(f, 1e-3, 1e-6)), np.float64)
  got = np.asarray(S.root_from_eig(*S.eigh_damped(f, 1e-3, 1e-6, "qr")), np.float64)
  # Two backward-stable solvers (on GPU below 32: Jacobi vs syevd) each perturb f by at most
  # ~n u ||f||; the root f^{-1/4} has relative condition number <= kappa / 4, so the roots may
  # differ by n u kappa / 2 in Frobenius norm relative to theirs (entries near 0 or in
  # near-degenerate eigenspaces may differ more entrywise without mattering).
  lam = np.linalg.eigvalsh(np.asarray(f, np.float64)) + 1e-3
  bound = f.shape[-1] * 2.0 ** -24 * (lam[:, -1] / lam[:, 0]) / 2
  rel = np.linalg.norm(got - ref, axis=(1, 2)) / np.linalg.norm(ref, axis=(1, 2))
  assert np.all(rel <= bound), (rel, bound)
  if jax.default_backend() == "cpu":
    with pytest.raises(ValueError, match="eigh_implementation='jacobi' needs a GPU"):
      S.scale_by_shampoo(eigh_implementation="jacobi")
  with pytest.raises(ValueError, match="eigh_implementation='svd' is not allowed"):
    S.scale_by_shampoo(eigh_implementation="svd")


def _conditioned_factors(n=512, k=4, decades=4):
  """k factors of the shape and conditioning of real statistics (eigenvalues spread over
  ``decades``) and their damped inverse fourth roots by float64 eigh."""
  rng = np.random.default_rng(0)
  q = np.linalg.qr(rng.normal(size=(k, n, n)))[0]
  f = np.einsum("bij,j,bkj->bik", q, 10.0 ** -np.linspace(0, decades, n), q)
  w, v = np.linalg.eigh(f + NEWTON_DAMPING * np.eye(n))
  return f.astype(np.float32), np.einsum("bij,bj,bkj->bik", v, w ** -0.25, v)


NEWTON_DAMPING = 1e-6
_rel = lambda x, ref: np.linalg.norm(x - ref, axis=(1, 2)) / np.linalg.norm(ref, axis=(1, 2))


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="'auto' takes the Newton roots on "
                    "accelerators only (eigh on CPU), and on CPU every precision is float32")
def test_newton_roots_at_default_precision_against_float64():
  """The roots a GPU run takes by default (``root_method="auto"`` -> Newton at the default
  ``newton_precision``) against float64 eigh, on factors of kappa 1e4 in blocks of 512: within
  2x the error of ``_newton_emulated`` with every matmul input rounded to the default's
  mantissa (TF32 on NVIDIA GPUs), plus a few float32 ulps."""
  assert S.resolve_root_method("auto", "std") == "newton"
  prec = inspect.signature(S.scale_by_shampoo).parameters["newton_precision"].default
  f, ref = _conditioned_factors()
  x = np.asarray(S.newton_inverse_root(jnp.asarray(f), NEWTON_DAMPING, 4, 30, prec), np.float64)
  emulated = _rel(_newton_emulated(f, NEWTON_DAMPING, MANTISSA[prec]), ref)
  assert np.all(_rel(x, ref) <= 2 * emulated + 4 * 2.0 ** -23), (_rel(x, ref), emulated)


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="'auto' takes the Newton roots on "
                    "accelerators only (eigh on CPU)")
def test_newton_roots_in_float32_against_float64():
  """``newton_precision="highest"`` (float32 iterations) on the same factors: within 1e-3 of
  float64 eigh (float32 emulation: < 1e-5; TF32's error is far above this bound)."""
  f, ref = _conditioned_factors()
  x = np.asarray(S.newton_inverse_root(jnp.asarray(f), NEWTON_DAMPING, 4, 30, "highest"),
                 np.float64)
  assert np.all(_rel(x, ref) < 1e-3), _rel(x, ref)
