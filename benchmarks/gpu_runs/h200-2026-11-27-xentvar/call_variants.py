"""Scratch: cross-entropy row kernel variants (lane-local online stats, scalar target load)."""
import functools, os, sys
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
sys.path.insert(0, "benchmarks")
from loss_lse import time_ms
from loss_kernel import _errors
from scaleopt.models import kernels
f32 = jnp.float32


EV = {"last": "evict_last", "first": "evict_first"}


def _row_lanes(z_ref, d_ref, r, y, block, lanes, evict=True):
  v = z_ref.shape[1]
  n_blocks = pl.cdiv(v, block)
  width = block // lanes

  def stats(i, carry):
    m, s = carry
    idx = i * block + jnp.arange(block).reshape(lanes, width)
    x = plgpu.load(z_ref.at[r, idx], mask=idx < v, other=-jnp.inf,
                   eviction_policy="evict_last" if evict else None).astype(f32)
    m_new = jnp.maximum(m, jnp.max(x, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    s = s * jnp.exp(m - m_safe) + jnp.sum(jnp.exp(x - m_safe[:, None]), axis=1)
    return m_new, s

  m, s = jax.lax.fori_loop(0, n_blocks, stats, (jnp.full((lanes,), -jnp.inf, f32),
                                                jnp.zeros((lanes,), f32)))
  top = jnp.max(m)
  lse = top + jnp.log(jnp.sum(s * jnp.exp(m - top)))
  zy = z_ref[r, y].astype(f32)

  def grad(i, carry):
    idx = i * block + jnp.arange(block)
    ok = idx < v
    x = plgpu.load(z_ref.at[r, idx], mask=ok, other=0.0,
                   eviction_policy="evict_first" if evict else None).astype(f32)
    d = jnp.exp(x - lse) - (idx == y).astype(f32)
    plgpu.store(d_ref.at[r, idx], d.astype(d_ref.dtype), mask=ok)
    return carry

  jax.lax.fori_loop(0, n_blocks, grad, 0)
  return lse - zy


def _rows(z_ref, y_ref, nll_ref, d_ref, *, block, lanes, evict, persist):
  if not persist:
    r = pl.program_id(0)
    nll_ref[r] = _row_lanes(z_ref, d_ref, r, y_ref[r], block, lanes, evict)
    return
  n = z_ref.shape[0]
  pid = pl.program_id(0)

  def one(k, c):
    r = pid + k * persist
    nll_ref[r] = _row_lanes(z_ref, d_ref, r, y_ref[r], block, lanes, evict)
    return c
  jax.lax.fori_loop(0, n // persist, one, 0)


@functools.partial(jax.jit, static_argnames=("block", "lanes", "num_warps", "interpret",
                                             "stages", "evict", "persist"))
def xent_lanes(z, y, *, block=8192, lanes=64, num_warps=16, interpret=False, stages=None,
               evict=True, persist=0):
  n, v = z.shape
  cp = (plgpu.CompilerParams(num_warps=num_warps) if stages is None else
        plgpu.CompilerParams(num_warps=num_warps, num_stages=stages))
  return pl.pallas_call(
      functools.partial(_rows, block=min(block, pl.next_power_of_2(v)), lanes=lanes,
                        evict=evict, persist=persist),
      grid=(persist or n,),
      out_shape=(jax.ShapeDtypeStruct((n,), f32), jax.ShapeDtypeStruct((n, v), z.dtype)),
      input_output_aliases={0: 1}, compiler_params=cp,
      interpret=interpret, name="xent_rows")(z, y.astype(jnp.int32))


def main():
  quick = "--quick" in sys.argv
  interpret = jax.default_backend() != "gpu"
  n, v, d, reps = (64, 1000, 32, 2) if quick else (65536, 50304, 768, 20)
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  h = jax.random.normal(k1, (n, d), f32).astype(jnp.bfloat16)
  w = (jax.random.normal(k2, (d, v), f32) * 0.1).astype(jnp.bfloat16)
  y = jax.random.randint(k3, (n,), 0, v)
  z = h @ w
  print(f"# {jax.devices()[0].device_kind}, N={n} V={v}", flush=True)
  rows = [("matmul", jax.jit(lambda h, w, y: h @ w)),
          ("shipped b8192 w16", jax.jit(lambda h, w, y: kernels.xent_rows(
              h @ w, y, interpret=interpret)))]
  variants = [dict(block=2048, lanes=16, num_warps=4), dict(block=2048, lanes=8, num_warps=4),
              dict(block=2048, lanes=32, num_warps=4), dict(block=2048, lanes=16, num_warps=2),
              dict(block=1024, lanes=8, num_warps=4), dict(block=1024, lanes=8, num_warps=2),
              dict(block=1024, lanes=16, num_warps=2), dict(block=2048, lanes=16, num_warps=8),
              dict(block=1024, lanes=4, num_warps=1), dict(block=512, lanes=4, num_warps=1),
              dict(block=2048, lanes=16, num_warps=4, stages=4)]
  if quick:
    variants = [dict(block=1024, lanes=8, num_warps=4), dict(block=256, lanes=4, num_warps=4,
                                                             persist=16)]
  for kw in variants:
    rows.append((f"lanes {kw}", jax.jit(
        lambda h, w, y, kw=kw: xent_lanes(h @ w, y, interpret=interpret, **kw))))
  base = None
  for name, fn in rows:
    try:
      ms = time_ms(fn, h, w, y, reps=reps)
    except Exception as e:  # noqa
      print(f"| {name} | failed: {str(e).splitlines()[0][:200]} |", flush=True)
      continue
    base = ms if base is None else base
    err = "" if name == "matmul" else "%.1e / %.1e" % _errors(*fn(h, w, y), z, y)
    print(f"| {name} | {ms:.3f} | {ms - base:.3f} | {err} |", flush=True)


main()
