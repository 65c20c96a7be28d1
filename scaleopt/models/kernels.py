"""Pallas GPU kernels: the cross-entropy rows of the fused LM head + loss, and the residual
add with the RMS norm that follows it.

**Cross-entropy rows.** For bf16 logits z ``[N, V]`` and targets y ``[N]``, one program per
row n computes, in float32 arithmetic,

  lse_n  = m_n + log sum_v exp(z_nv - m_n)       (an online max and rescaled sum: one exp
                                                  per element)
  nll_n  = lse_n - z_{n, y_n}                     (the target's logit: one scalar load)
  d_nv   = exp(z_nv - lse_n) - [v = y_n]          (stored in z's dtype, in z's buffer)

so the logit gradient of any per-row cotangent c is ``c_n d_nv``. The kernel reads each row
twice and writes it once; XLA's form reads it twice in the forward pass (max, sum of exp)
and once more, with a write, in the backward pass. The row is read in blocks of ``BLOCK``
columns, each viewed as ``LANES`` lanes of ``BLOCK / LANES`` columns; every lane keeps its own
running max and rescaled sum (reductions within the lane, no block-wide reduction per load),
and the lanes are combined once per row. ``NUM_WARPS`` warps per row. These settings are the
fastest of those ``benchmarks/loss_kernel.py`` tries at gpt2-small's shapes (docs/benchmarks.md).

**Residual add + RMS norm.** For the residual stream x and a branch output h (``[N, D]``),

  s_n = x_n + h_n                              (stored in x's dtype: the next residual stream)
  r_n = (mean_j s_nj^2 + eps)^(-1/2),  n_n = r_n s_n     (float32 arithmetic)

in one pass over the rows (XLA reads s twice: a reduction, then the normalization), and for
cotangents g_s of s and g_n of n, the cotangent of x (and of h), row by row

  g_x = g_s + r g_n - r^3 s mean_j(g_n,j s_j)

in one pass (XLA: a reduction pass, then the elementwise pass). ``ROWS`` rows per program and
``NORM_WARPS`` warps, from the settings ``benchmarks/norm_kernel.py`` tries (its table:
lab/benchmarks_history.md).

``interpret=True`` runs the same kernels through the Pallas interpreter (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

try:  # JAX marks the Pallas Triton backend deprecated; without it, ``auto`` picks XLA's forms
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover - depends on the installed JAX
  plgpu = None

f32 = jnp.float32
BLOCK = 2048  # columns per load
LANES = 16  # lanes per block, each with its own running max and sum
NUM_WARPS = 8
ROWS = 4  # rows per program of the add + norm kernels
NORM_WARPS = 4


def auto(dtype: jnp.dtype, backend: str | None = None) -> bool:
  """Whether a kernel setting ``auto`` picks the Pallas kernels: on GPU, for 16-bit compute
  dtypes (``backend`` defaults to ``jax.default_backend()``)."""
  return (plgpu is not None and (backend or jax.default_backend()) == "gpu"
          and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16))


def interpret() -> bool:
  """Whether the kernels run through the Pallas interpreter: everywhere but on GPU."""
  return jax.default_backend() != "gpu"


def _params(num_warps: int):
  if plgpu is None:
    raise RuntimeError("this JAX has no Pallas Triton backend "
                       "(jax.experimental.pallas.triton); set model.loss_kernel and "
                       "model.norm_kernel to xla or auto")
  return plgpu.CompilerParams(num_warps=num_warps)


def _row(z_ref, d_ref, r, y, block: int, lanes: int):
  """Row r of z (target y): writes row r of d, returns nll."""
  v = z_ref.shape[1]
  n_blocks = pl.cdiv(v, block)

  def stats(i, carry):  # per lane: running max m and sum s of exp(z - m)
    m, s = carry
    idx = i * block + jnp.arange(block).reshape(lanes, block // lanes)
    x = plgpu.load(z_ref.at[r, idx], mask=idx < v, other=-jnp.inf,
                   eviction_policy="evict_last").astype(f32)
    m_new = jnp.maximum(m, jnp.max(x, axis=1))
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # a lane with only padding so far
    s = s * jnp.exp(m - shift) + jnp.sum(jnp.exp(x - shift[:, None]), axis=1)
    return m_new, s

  m, s = jax.lax.fori_loop(0, n_blocks, stats, (jnp.full((lanes,), -jnp.inf, f32),
                                                jnp.zeros((lanes,), f32)))
  top = jnp.max(m)
  lse = top + jnp.log(jnp.sum(s * jnp.exp(m - top)))
  # The target's logit, read before d overwrites the row. z and d share a buffer that the
  # compiler does not know of, and it may move a load to just before its first use: the
  # stores below use lse through z_y (z_y + nll is lse up to rounding), so the load
  # cannot move past them.
  z_y = z_ref[r, y].astype(f32)
  nll = lse - z_y
  lse = z_y + nll

  def grad(i, carry):
    idx = i * block + jnp.arange(block)
    ok = idx < v
    x = plgpu.load(z_ref.at[r, idx], mask=ok, other=0.0,
                   eviction_policy="evict_first").astype(f32)
    d = jnp.exp(x - lse) - (idx == y).astype(f32)
    plgpu.store(d_ref.at[r, idx], d.astype(d_ref.dtype), mask=ok)
    return carry

  jax.lax.fori_loop(0, n_blocks, grad, 0)
  return nll


def _rows(z_ref, y_ref, nll_ref, d_ref, *, block: int, lanes: int):
  r = pl.program_id(0)
  nll_ref[r] = _row(z_ref, d_ref, r, y_ref[r], block, lanes)


@functools.partial(jax.jit, static_argnames=("block", "lanes", "num_warps", "interpret"))
def xent_rows(z_NxV: jax.Array, y_N: jax.Array, *, block: int = BLOCK, lanes: int = LANES,
              num_warps: int = NUM_WARPS, interpret: bool = False
              ) -> tuple[jax.Array, jax.Array]:
  """(nll ``[N]`` float32, d ``[N, V]`` in z's dtype) as in the module docstring; d takes
  z's buffer when z is not used afterwards. One program per row, ``block`` columns per load
  (at most the row's width rounded up to a power of two) as ``lanes`` lanes."""
  n, v = z_NxV.shape
  block = min(block, pl.next_power_of_2(v))
  return pl.pallas_call(
      functools.partial(_rows, block=block, lanes=min(lanes, block)), grid=(n,),
      out_shape=(jax.ShapeDtypeStruct((n,), f32), jax.ShapeDtypeStruct((n, v), z_NxV.dtype)),
      input_output_aliases={0: 1},
      compiler_params=_params(num_warps),
      interpret=interpret, name="xent_rows",
  )(z_NxV, y_N.astype(jnp.int32))


def _tile(ref, i: int, rows: int, block: int):
  """Indexers and mask of the ``rows x block`` tile of program i over a ``[N, D]`` ref."""
  n, d = ref.shape
  r = i * rows + jnp.arange(rows)
  c = jnp.arange(block)
  return (r[:, None], c[None, :]), (r[:, None] < n) & (c[None, :] < d), r, r < n


def _add_norm_fwd(x_ref, h_ref, s_ref, n_ref, r_ref, *, eps: float, rows: int, block: int):
  idx, ok, r, r_ok = _tile(x_ref, pl.program_id(0), rows, block)
  x = plgpu.load(x_ref.at[idx], mask=ok, other=0.0).astype(f32)
  h = plgpu.load(h_ref.at[idx], mask=ok, other=0.0).astype(f32)
  s = (x + h).astype(s_ref.dtype)
  plgpu.store(s_ref.at[idx], s, mask=ok)
  s = s.astype(f32)  # the norm reads the stored residual
  rs = jax.lax.rsqrt(jnp.sum(s * s, axis=1) / x_ref.shape[1] + eps)
  plgpu.store(n_ref.at[idx], (s * rs[:, None]).astype(n_ref.dtype), mask=ok)
  plgpu.store(r_ref.at[r], rs, mask=r_ok)


def _add_norm_bwd(gs_ref, gn_ref, s_ref, r_ref, g_ref, *, rows: int, block: int):
  idx, ok, r, r_ok = _tile(s_ref, pl.program_id(0), rows, block)
  gs = plgpu.load(gs_ref.at[idx], mask=ok, other=0.0).astype(f32)
  gn = plgpu.load(gn_ref.at[idx], mask=ok, other=0.0).astype(f32)
  s = plgpu.load(s_ref.at[idx], mask=ok, other=0.0).astype(f32)
  rs = plgpu.load(r_ref.at[r], mask=r_ok, other=0.0)
  c = jnp.sum(gn * s, axis=1) / s_ref.shape[1]
  g = gs + rs[:, None] * gn - s * (rs * rs * rs * c)[:, None]
  plgpu.store(g_ref.at[idx], g.astype(g_ref.dtype), mask=ok)


def _row_call(kernel, n: int, d: int, out_shape, rows: int, num_warps: int, interpret: bool,
              name: str, **kw):
  return pl.pallas_call(
      functools.partial(kernel, rows=rows, block=pl.next_power_of_2(d), **kw),
      grid=(pl.cdiv(n, rows),), out_shape=out_shape,
      compiler_params=_params(num_warps),
      interpret=interpret, name=name)


@functools.partial(jax.jit, static_argnames=("eps", "rows", "num_warps", "interpret"))
def add_rms_norm_fwd(x_NxD: jax.Array, h_NxD: jax.Array, *, eps: float, rows: int = ROWS,
                     num_warps: int = NORM_WARPS, interpret: bool = False
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(s = x + h in x's dtype, n = r s in x's dtype, r ``[N]`` float32) as in the module
  docstring, one pass over the rows."""
  n, d = x_NxD.shape
  out = (jax.ShapeDtypeStruct((n, d), x_NxD.dtype), jax.ShapeDtypeStruct((n, d), x_NxD.dtype),
         jax.ShapeDtypeStruct((n,), f32))
  return _row_call(_add_norm_fwd, n, d, out, rows, num_warps, interpret, "add_rms_norm_fwd",
                   eps=eps)(x_NxD, h_NxD)


@functools.partial(jax.jit, static_argnames=("rows", "num_warps", "interpret"))
def add_rms_norm_bwd(gs_NxD: jax.Array, gn_NxD: jax.Array, s_NxD: jax.Array, r_N: jax.Array,
                     *, rows: int = ROWS, num_warps: int = NORM_WARPS,
                     interpret: bool = False) -> jax.Array:
  """The cotangent ``g_s + r g_n - r^3 s mean(g_n s)`` (in s's dtype) of x and of h, one pass
  over the rows."""
  n, d = s_NxD.shape
  out = jax.ShapeDtypeStruct((n, d), s_NxD.dtype)
  return _row_call(_add_norm_bwd, n, d, out, rows, num_warps, interpret,
                   "add_rms_norm_bwd")(gs_NxD, gn_NxD, s_NxD, r_N)
