"""Pallas GPU kernel for the cross-entropy rows of the fused LM head + loss.

For bf16 logits z ``[N, V]`` and targets y ``[N]``, one program per row n computes, in
float32 arithmetic,

  lse_n  = m_n + log sum_v exp(z_nv - m_n)       (an online max and rescaled sum over blocks
                                                  of the row: one exp per element)
  nll_n  = lse_n - z_{n, y_n}
  d_nv   = exp(z_nv - lse_n) - [v = y_n]          (stored in z's dtype, in z's buffer)

so the logit gradient of any per-row cotangent c is ``c_n d_nv``. The kernel reads each row
twice and writes it once; XLA's form reads it twice in the forward pass (max, sum of exp)
and once more, with a write, in the backward pass. Blocks of ``BLOCK`` columns, ``NUM_WARPS``
warps per row: within 0.1 ms of the fastest setting in each comparison on an H100 at
gpt2-small's shapes (``benchmarks/loss_kernel.py``; docs/benchmarks.md).

``interpret=True`` runs the same kernel through the Pallas interpreter (CPU tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

f32 = jnp.float32
BLOCK = 8192  # columns per load
NUM_WARPS = 16


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


def _rows(z_ref, y_ref, nll_ref, d_ref, *, block: int):
  r = pl.program_id(0)
  nll_ref[r] = _row(z_ref, d_ref, r, y_ref[r], block)


@functools.partial(jax.jit, static_argnames=("block", "num_warps", "interpret"))
def xent_rows(z_NxV: jax.Array, y_N: jax.Array, *, block: int = BLOCK,
              num_warps: int = NUM_WARPS, interpret: bool = False
              ) -> tuple[jax.Array, jax.Array]:
  """(nll ``[N]`` float32, d ``[N, V]`` in z's dtype) as in the module docstring; d takes
  z's buffer when z is not used afterwards. One program per row, ``block`` columns per load
  (at most the row's width rounded up to a power of two)."""
  n, v = z_NxV.shape
  return pl.pallas_call(
      functools.partial(_rows, block=min(block, pl.next_power_of_2(v))), grid=(n,),
      out_shape=(jax.ShapeDtypeStruct((n,), f32), jax.ShapeDtypeStruct((n, v), z_NxV.dtype)),
      input_output_aliases={0: 1},
      compiler_params=plgpu.CompilerParams(num_warps=num_warps),
      interpret=interpret, name="xent_rows",
  )(z_NxV, y_N.astype(jnp.int32))
