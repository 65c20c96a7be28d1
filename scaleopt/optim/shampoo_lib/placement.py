"""Where the factors and their per-block work live: the mesh's devices and host memory."""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from scaleopt import mesh_context


def _mesh():
  """The mesh the step is traced under (``scaleopt.mesh_context``, set by the trainer through
  ``scaleopt.models.sharding.constraints``), or None when it has a single device."""
  mesh = mesh_context.current()
  return mesh if mesh is not None and mesh.size > 1 else None


def _split_axes(mesh) -> list:
  """The mesh axes of size > 1, ``fsdp`` first: a block axis split over them gives each FSDP
  shard's rows to the devices that hold them (``Blocking.major``)."""
  axes = [a for a in mesh.axis_names if mesh.shape[a] > 1]
  return sorted(axes, key=lambda a: a != "fsdp")


def block_axes(mesh, n: int) -> tuple:
  """Mesh axes (of size > 1, ``fsdp`` first) over which a block axis of length ``n`` is split:
  all of them when their product divides ``n``, else the subset with the largest product that
  does (empty: replicated). One rule for the stored factors and the blocked momentum."""
  axes = _split_axes(mesh)
  best, best_size = (), 1
  for mask in range(1, 2 ** len(axes)):
    sub = tuple(a for i, a in enumerate(axes) if mask >> i & 1)
    size = math.prod(mesh.shape[a] for a in sub)
    if n % size == 0 and size > best_size:
      best, best_size = sub, size
  return best


def block_sharding(mesh, shape) -> NamedSharding:
  """Sharding of a block-stacked array ``[n, ...]``: the block axis split by ``block_axes``."""
  axes = block_axes(mesh, shape[0])
  return NamedSharding(mesh, P(axes or None, *([None] * (len(shape) - 1))))


def on_owner(x):
  """``x`` ``[n, ...]`` pinned to the block sharding (identity without a multi-device mesh), so
  per-block work runs on the devices that hold the block's factors."""
  mesh = _mesh()
  return x if mesh is None else jax.lax.with_sharding_constraint(x, block_sharding(mesh, x.shape))


def in_host_memory(x) -> bool:
  """Whether ``x`` (an array or a tracer) lives in host memory (``jax.memory.Space.Host``)."""
  typeof = getattr(jax, "typeof", None)
  space = getattr(typeof(x), "memory_space", None) if typeof is not None else None
  return space is not None and space == jax.memory.Space.Host


def to_device(x):
  """``x`` in device memory: a copy from host memory if it lives there, else ``x`` itself."""
  return jax.device_put(x, jax.memory.Space.Device) if in_host_memory(x) else x


def to_host(x):
  """``x`` moved to (pinned) host memory; inside jit XLA turns this into an asynchronous copy."""
  return jax.device_put(x, jax.memory.Space.Host)


def _divided(fn: Callable) -> Callable:
  """``fn`` over a batch ``[N, s, s]`` split evenly among all devices of the mesh in context:
  the batch is zero-padded to a multiple of the device count (padding blocks are identity
  matrices, harmless to eigh and Newton) and each device runs ``fn`` on its ``N_pad / ndev``
  matrices inside ``shard_map``; the result stays split (callers re-shard what they keep)."""
  mesh = _mesh()
  if mesh is None:
    return fn
  axes = tuple(_split_axes(mesh))
  ndev = math.prod(mesh.shape[a] for a in axes)

  def run(x):
    n = x.shape[0]
    pad = -n % ndev
    if pad:
      eye = jnp.broadcast_to(jnp.eye(x.shape[-1], dtype=x.dtype), (pad, *x.shape[1:]))
      x = jnp.concatenate([x, eye], axis=0)
    spec = P(axes, None, None)
    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    out = jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=P(axes), check_vma=False)(x)
    return jax.tree.map(lambda r: r[:n], out)

  return run


def _concat_call(arrs: list, fn: Callable) -> list:
  """``fn`` on the concatenation of ``arrs`` along axis 0, split back: one result per array."""
  x = jnp.concatenate(arrs, axis=0) if len(arrs) > 1 else arrs[0]
  res, out, o = fn(x), [], 0
  for a in arrs:
    out.append(jax.tree.map(lambda r, o=o, n=a.shape[0]: r[o:o + n], res))
    o += a.shape[0]
  return out


def _local_axes(arrs: list):
  """The mesh axes over which every array's block axis is split when ``block_axes`` splits
  each of them over all devices of the mesh in context (each device then holds 1/ndev of
  every array's blocks), else None."""
  mesh = _mesh()
  if mesh is None:
    return None
  axes = tuple(_split_axes(mesh))
  return axes if all(block_axes(mesh, a.shape[0]) == axes for a in arrs) else None


def batched_by_size(mats: dict, fn: Callable) -> dict:
  """Applies ``fn`` to every (n_i, s, s) array, batching all arrays of one size s together
  (one concatenation, one batched call, one split per size).

  On CPU the calls run one matrix at a time (``lax.map``) and one size after another
  (``optimization_barrier``): jaxlib's batched CPU LAPACK kernels split a batch over XLA's
  intra-op thread pool and block on it, and two such kernels in flight at once can take every
  pool thread and deadlock on a machine with few cores. Accelerators keep the batched call.

  Under a multi-device mesh every device decomposes only its share of each size's batch:
  ceil(N / ndev) matrices instead of N. When every array of a size has its blocks split over
  all devices (the block sharding of the state), each device concatenates and decomposes the
  blocks it already holds (``shard_map`` over the arrays' own sharding: no communication, and
  the results stay where their factors are); otherwise ``_divided`` splits the concatenation.
  """
  serial = jax.default_backend() == "cpu"
  per_matrix = lambda x: jax.lax.map(lambda a: jax.tree.map(lambda r: r[0], fn(a[None])), x)
  inner = per_matrix if serial else fn
  by_size: dict[int, list] = {}
  for key, a in mats.items():
    by_size.setdefault(a.shape[-1], []).append(key)
  out = {}
  prev = None
  for s, keys in by_size.items():
    arrs = [mats[k] for k in keys]
    if serial and prev is not None:
      arrs, _ = jax.lax.optimization_barrier((arrs, prev))
    axes = _local_axes(arrs)
    if axes:
      spec = P(axes, None, None)
      res = jax.shard_map(lambda *xs: tuple(_concat_call(list(xs), inner)), mesh=_mesh(),
                          in_specs=(spec,) * len(arrs), out_specs=P(axes),
                          check_vma=False)(*arrs)
    else:
      res = _concat_call(arrs, _divided(inner))
    prev = res
    out.update(zip(keys, res))
  return out
