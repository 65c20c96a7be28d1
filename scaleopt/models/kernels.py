"""Pallas GPU kernel for the cross-entropy rows of the fused LM head + loss.

For bf16 logits z ``[N, V]`` and targets y ``[N]``, one program per row n computes, in
float32 arithmetic,

  lse_n  = m_n + log sum_v exp(z_nv - m_n)       (an online max and rescaled sum over blocks
                                                  of the row: one exp per element)
  nll_n  = lse_n - z_{n, y_n}
  d_nv   = exp(z_nv - lse_n) - [v = y_n]          (stored in z's dtype, in z's buffer)

so the logit gradient of any per-row cotangent c is ``c_n d_nv``. The row is read twice
(the second read finds it in L2) and written once: the XLA form reads it three times in the
forward pass (max, sum of exp) and again, with a write, in the backward pass.

``interpret=True`` runs the same kernel through the Pallas interpreter (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

f32 = jnp.float32


def _row(z_ref, d_ref, r, y, block: int):
  """Row r of z (target y): writes row r of d, returns nll."""
  v = z_ref.shape[1]
  n_blocks = pl.cdiv(v, block)

  def cols(i):
    idx = i * block + jnp.arange(block)
    return idx, idx < v

  def stats(i, carry):
    m, s, zy = carry
    idx, ok = cols(i)
    x = plgpu.load(z_ref.at[r, idx], mask=ok, other=-jnp.inf,
                   eviction_policy="evict_last").astype(f32)
    m_new = jnp.maximum(m, jnp.max(x))
    s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(x - m_new))
    return m_new, s, zy + jnp.sum(jnp.where(idx == y, x, 0.0))

  m, s, zy = jax.lax.fori_loop(0, n_blocks, stats, (f32(-jnp.inf), f32(0.0), f32(0.0)))
  lse = m + jnp.log(s)

  def grad(i, carry):
    idx, ok = cols(i)
    x = plgpu.load(z_ref.at[r, idx], mask=ok, other=0.0,
                   eviction_policy="evict_first").astype(f32)
    d = jnp.exp(x - lse) - (idx == y).astype(f32)
    plgpu.store(d_ref.at[r, idx], d.astype(d_ref.dtype), mask=ok)
    return carry

  jax.lax.fori_loop(0, n_blocks, grad, 0)
  return lse - zy


def _rows(z_ref, y_ref, nll_ref, d_ref, *, block: int, programs: int):
  """Program p takes rows p, p + programs, ... (``programs`` = N: one row each). Fewer
  programs than rows keep fewer rows in flight, so a row's second read can find it in L2."""
  n, pid = z_ref.shape[0], pl.program_id(0)

  def body(t, carry):
    r = t * programs + pid

    @pl.when(r < n)
    def _():
      nll_ref[r] = _row(z_ref, d_ref, r, y_ref[r], block)
    return carry

  jax.lax.fori_loop(0, pl.cdiv(n, programs), body, 0)


BLOCK = 8192  # columns per load
NUM_WARPS = 16
PROGRAMS_PER_CORE = 0  # programs per GPU core (SM); 0: one program per row


@functools.partial(jax.jit, static_argnames=("block", "num_warps", "programs", "interpret"))
def xent_rows(z_NxV: jax.Array, y_N: jax.Array, *, block: int | None = None,
              num_warps: int | None = None, programs: int | None = None,
              interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """(nll ``[N]`` float32, d ``[N, V]`` in z's dtype) as in the module docstring; d takes
  z's buffer when z is not used afterwards. ``block`` (columns per load) and ``num_warps``
  default to ``BLOCK`` and ``NUM_WARPS``; ``programs``: that many programs, each taking
  every ``programs``-th row (default: ``PROGRAMS_PER_CORE`` per core of the device, or one
  per row)."""
  n, v = z_NxV.shape
  block = min(block or BLOCK, pl.next_power_of_2(v))
  params = dict(compiler_params=plgpu.CompilerParams(num_warps=num_warps or NUM_WARPS),
                input_output_aliases={0: 1}, interpret=interpret, name="xent_rows")
  if not programs and PROGRAMS_PER_CORE:
    programs = PROGRAMS_PER_CORE * getattr(jax.devices()[0], "core_count", 1)
  programs = min(programs or n, n)
  return pl.pallas_call(
      functools.partial(_rows, block=block, programs=programs), grid=(programs,),
      out_shape=(jax.ShapeDtypeStruct((n,), f32), jax.ShapeDtypeStruct((n, v), z_NxV.dtype)),
      **params)(z_NxV, y_N.astype(jnp.int32))
