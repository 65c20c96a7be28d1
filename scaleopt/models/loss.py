"""Fused LM head + cross-entropy: no float32 ``[tokens, vocab]`` array, forward or backward.

For hidden states h (``[B, T, d]``, compute dtype; n indexes the B T tokens), head W
(``[d, V]``) and targets y:

  z_n    = h_n W                                  (compute dtype, e.g. bf16)
  lse_n  = m_n + log sum_v exp(z_nv - m_n),  m_n = max_v z_nv      (float32 arithmetic)
  nll_n  = lse_n - z_{n, y_n}

and for a cotangent c_n of nll_n (the mean loss gives c_n = mask_n / sum(mask)):

  dz_nv  = c_n (exp(z_nv - lse_n) - [v = y_n])     (float32 arithmetic, stored in the
                                                    compute dtype)
  dh     = dz W^T,   dW = h^T dz

Plain autodiff of ``logsumexp(z.astype(f32))`` keeps ``exp(z - m)`` in float32 as a residual
and scatters the one-hot target gradient into another float32 ``[N, V]`` buffer. Here the
residuals are the compute-dtype logits and lse (``chunks=1``), or only h, W and lse
(``chunks > 1``: the sequence axis is processed in ``chunks`` slices under ``lax.map`` and
each slice's logits are recomputed in the backward pass, so at most ``B T / chunks x V``
logits exist at a time, at the price of one more head matmul).

With ``kernel=True`` (``chunks=1``) the forward pass computes lse, nll and d = dz / c in one
Pallas GPU kernel, :func:`scaleopt.models.kernels.xent_rows`, that reads the logits twice
and writes d over them; the residual is d and the backward pass is the two matmuls alone
(dh = c (d W^T), dW = (c h)^T d: c scales rows, no pass over ``[N, V]``). XLA's form reads
the logits twice in the forward pass and once more, with a write, in the backward pass.
Under a mesh the kernel runs per device on its rows (``shard_map`` over the batch axes); it
needs whole vocabulary rows, so tensor parallelism uses the XLA form.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from scaleopt.models import kernels, sharding

f32 = jnp.float32


def _lse_nll(z: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
  # max and the target gather read z in its own dtype (exact: the cast commutes with both),
  # so no float32 copy of z is needed for them.
  m = jnp.max(z, axis=-1, keepdims=True).astype(f32)
  lse = jnp.log(jnp.sum(jnp.exp(z.astype(f32) - m), axis=-1)) + m[..., 0]
  zy = jnp.take_along_axis(z, y[..., None], axis=-1)[..., 0].astype(f32)
  return lse, lse - zy


def _dlogits(z: jax.Array, lse: jax.Array, y: jax.Array, c: jax.Array) -> jax.Array:
  v = jax.lax.broadcasted_iota(jnp.int32, z.shape, z.ndim - 1)
  p = jnp.exp(z.astype(f32) - lse[..., None])
  return (c[..., None] * (p - (v == y[..., None]).astype(f32))).astype(z.dtype)


def _kernel_rows(z: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(nll ``[B, T]``, d ``[B, T, V]``) of logits z ``[B, T, V]`` by the Pallas kernel, per
  device on its rows under a mesh."""
  return sharding.on_rows(functools.partial(
      kernels.xent_rows, interpret=kernels.interpret()), z, y)


def _logits(h: jax.Array, w: jax.Array) -> jax.Array:
  return sharding.constrain(jnp.einsum("btd,dv->btv", h, w), ("batch", None, "tensor"))


def _chunked(x: jax.Array, chunks: int) -> jax.Array:
  """``[B, T, ...] -> [chunks, B, T / chunks, ...]`` (slices of the sequence axis, so the
  batch axis keeps its sharding)."""
  b, t = x.shape[:2]
  return jnp.swapaxes(x.reshape(b, chunks, t // chunks, *x.shape[2:]), 0, 1)


def _unchunked(x: jax.Array) -> jax.Array:
  c, b, tc = x.shape[:3]
  return jnp.swapaxes(x, 0, 1).reshape(b, c * tc, *x.shape[3:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _nll(h, w, y, chunks, kernel):
  del kernel  # without a gradient, d is not needed: XLA's lse alone
  return _nll_fwd(h, w, y, chunks, False)[0]


def _nll_fwd(h, w, y, chunks, kernel):
  if chunks == 1 and kernel:
    nll, d = _kernel_rows(_logits(h, w), y)
    return nll, (h, w, y, d, None)
  if chunks == 1:
    z = _logits(h, w)
    lse, nll = _lse_nll(z, y)
    return nll, (h, w, y, z, lse)
  lse, nll = jax.lax.map(lambda a: _lse_nll(_logits(a[0], w), a[1]),
                         (_chunked(h, chunks), _chunked(y, chunks)))
  return _unchunked(nll), (h, w, y, None, _unchunked(lse))


def _nll_bwd(chunks, kernel, res, c):
  h, w, y, z, lse = res
  c = c.astype(f32)
  if chunks == 1 and kernel:  # z holds d = softmax - onehot; c scales the rows of h and dh
    dh = c[..., None] * jnp.einsum("btv,dv->btd", z, w, preferred_element_type=f32)
    dw = jnp.einsum("btd,btv->dv", (c[..., None] * h).astype(h.dtype), z)
    return dh.astype(h.dtype), dw, None
  if chunks == 1:
    dz = _dlogits(z, lse, y, c)
    dh = jnp.einsum("btv,dv->btd", dz, w)
    dw = jnp.einsum("btd,btv->dv", h, dz)
    return dh, dw, None

  def one(dw, a):
    hc, yc, lc, cc = a
    dz = _dlogits(_logits(hc, w), lc, yc, cc)
    dw = dw + jnp.einsum("btd,btv->dv", hc, dz, preferred_element_type=f32)
    return dw, jnp.einsum("btv,dv->btd", dz, w)

  xs = tuple(_chunked(a, chunks) for a in (h, y, lse, c))
  dw, dh = jax.lax.scan(one, jnp.zeros(w.shape, f32), xs)
  return _unchunked(dh), dw.astype(w.dtype), None


_nll.defvjp(_nll_fwd, _nll_bwd)


def use_kernel(setting: str, dtype: jnp.dtype, chunks: int = 1,
               backend: str | None = None) -> bool:
  """Whether the fused loss runs :func:`scaleopt.models.kernels.xent_rows` for the setting
  ``auto | pallas | xla`` (``ModelConfig.loss_kernel``): ``auto`` on GPU with a 16-bit
  dtype, one chunk and no tensor parallelism. Call it while tracing (it reads the mesh);
  ``backend`` defaults to ``jax.default_backend()``."""
  if setting == "pallas" and sharding.tensor_parallel():
    raise ValueError("loss_kernel='pallas' needs whole vocabulary rows per device; the mesh "
                     "splits them over its tensor axis (use auto or xla)")
  return setting == "pallas" or (setting == "auto" and chunks == 1 and
                                 kernels.auto(dtype, backend) and not sharding.tensor_parallel())


def head_nll(h_BxTxD: jax.Array, w_DxV: jax.Array, targets_BxT: jax.Array,
             chunks: int = 1, kernel: bool = False) -> jax.Array:
  """Per-token ``logsumexp(h W) - (h W)[y]`` in float32 (``[B, T]``), differentiable in h
  and W (h and W in the compute dtype).

  ``chunks`` must divide T (1: the whole sequence at once, logits kept in the compute dtype
  for the backward pass; k > 1: k slices of the sequence axis, logits recomputed in the
  backward pass). ``kernel``: the per-row work as one Pallas kernel (``chunks=1`` only; the
  Pallas interpreter off GPU).
  """
  t = h_BxTxD.shape[1]
  if chunks < 1 or t % chunks:
    raise ValueError(f"loss_chunks={chunks} must be >= 1 and divide the sequence length {t}")
  if kernel and chunks != 1:
    raise ValueError(f"loss_kernel='pallas' needs loss_chunks=1, got {chunks}")
  return _nll(h_BxTxD, w_DxV, targets_BxT.astype(jnp.int32), chunks, kernel)


def head_loss(h_BxTxD: jax.Array, w_DxV: jax.Array, targets_BxT: jax.Array,
              mask_BxT: jax.Array | None = None, chunks: int = 1,
              kernel: bool = False) -> jax.Array:
  """Mean cross-entropy over supervised positions of the logits ``h W`` (float32):
  ``sum_{b,t} m_{bt} nll_{bt} / max(sum m, 1)``; equals ``lm_loss(h W, targets, mask)``."""
  nll = head_nll(h_BxTxD, w_DxV, targets_BxT, chunks, kernel)
  if mask_BxT is None:
    return jnp.mean(nll)
  m = mask_BxT.astype(f32)
  return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)
