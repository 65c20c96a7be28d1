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


# Per-coordinate tolerance of the update, in units of its RMS over the tensor. Emulating the
# accelerator passes on 768 x 768 blocks of realistic factors (inputs of P_L M and of (P_L M)
# P_R rounded to the pass's mantissa, float32 accumulation; docs/optim.md) gives a largest
# coordinate error of 0.12 RMS and an RMS error of 0.0034 RMS for one bfloat16 pass (7
# stored mantissa bits), 0.013 and 0.0004 for TF32 (10 bits); the bounds below leave 2x room.
# The bound is for P_L M P_R alone (``matmul_precision``; the statistics stay "highest": their
# rounding reaches the update through the roots, amplified by the factors' conditioning).
# The blocks are 64 x 64 and 96 x 96 (matrices 128 x 192 and 192 x 96): on tiny blocks
# (5 x 5) XLA:GPU and cuBLAS pick float32 SIMT kernels whatever the precision level, so
# "high" and "default" computed exactly the "highest" update there and the bound tested
# nothing. On CPU every option computes in float32 (XLA:CPU ignores the precision levels and
# runs the bfloat16 preset in float32 too), so the test could not fail there: it runs on
# accelerators only, and checks there that the option rounded something (the update moved).
TOL = {"BF16_BF16_F32": (0.25, 7e-3), "default": (0.03, 1e-3), "high": (0.03, 1e-3)}


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="on CPU every precision option "
                    "computes in float32, identical to the reference: the test could not fail")
@pytest.mark.parametrize("prec", sorted(TOL))
def test_lower_precision_update_within_its_bound(prec):
  params, grads = _problem(1, scale=16)
  max_tol, rms_tol = TOL[prec]

  def run(**kw):
    tx = S.shampoo(1e-2, block_size=96, root_every=3, damping=1e-3, stats_precision="highest",
                   **kw)
    th, st, out = params, tx.init(params), []
    step = jax.jit(tx.update)
    for g in grads:
      u, st = step(g, st, th)
      th = optax.apply_updates(th, u)
      out.append(u)
    return out

  ref, got = run(matmul_precision="highest"), run(matmul_precision=prec)
  moved = max(np.abs(np.asarray(u[k]) - np.asarray(r[k])).max() for r, u in zip(ref, got)
              for k in ("w", "v"))
  assert moved > 0, f"{prec} computed the same update as 'highest': nothing was rounded"
  for u_ref, u in zip(ref, got):
    for k in ("w", "v"):
      a, b = np.asarray(u_ref[k], np.float64), np.asarray(u[k], np.float64)
      rms = np.sqrt(np.mean(a ** 2))
      assert np.abs(b - a).max() <= max_tol * rms, k
      assert np.sqrt(np.mean((b - a) ** 2)) <= rms_tol * rms, k


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


@pytest.mark.skipif(jax.default_backend() == "cpu", reason="'auto' takes the Newton "
                    "roots on accelerators only (eigh on CPU)")
def test_newton_roots_at_default_precision_against_float64():
  """The roots a GPU run takes by default (``root_method="auto"`` -> Newton at the default
  ``newton_precision``, float32) against float64 eigendecompositions, on factors of the shape
  and conditioning of real statistics (eigenvalues spread over 4 decades, blocks of 512).
  Float32 iterations err by < 1e-4 here (NumPy emulation, docs/optim.md, Newton roots in
  float32); TF32 ones by 2.4-2.9%, which the bound of 1e-3 refuses."""
  assert S.resolve_root_method("auto", "std") == "newton"
  rng = np.random.default_rng(0)
  n, k, damping = 512, 4, 1e-6
  q = np.linalg.qr(rng.normal(size=(k, n, n)))[0]
  lam = 10.0 ** -np.linspace(0, 4, n)
  f = np.einsum("bij,j,bkj->bik", q, lam, q)
  prec = inspect.signature(S.scale_by_shampoo).parameters["newton_precision"].default
  x = np.asarray(S.newton_inverse_root(jnp.asarray(f, jnp.float32), damping, 4, 30, prec),
                 np.float64)
  w, v = np.linalg.eigh(f + damping * np.eye(n))
  ref = np.einsum("bij,bj,bkj->bik", v, w ** -0.25, v)
  rel = np.linalg.norm(x - ref, axis=(1, 2)) / np.linalg.norm(ref, axis=(1, 2))
  assert np.all(rel < 1e-3), rel
