"""Sharding constraints inside the model: FSDP and tensor parallelism without GSPMD guesswork.

Parameters are *stored* with the logical axes of :func:`scaleopt.models.partition_rules`
(``fsdp`` on the model dimension d of every matrix, ``tensor`` on heads / hidden / vocab).
Left to itself, GSPMD propagates the parameters' d-sharding into the activations (the embedding
lookup returns ``[B, T, d]`` split on d), and every matmul then contracts a split dimension and
all-reduces full-batch activations: tensor parallelism over d instead of FSDP. Inside
:func:`constraints` the model pins the layout the way FSDP means it:

  activations   ``[B, T, ...]`` split on B over the batch axes (mesh ``data`` x ``fsdp``), heads
                / hidden / vocab over ``tensor``
  kernels       cast to the compute dtype on their shards, then all-gathered over ``fsdp``
                (:func:`use_kernel`): one bf16 all-gather per kernel and forward, and its
                transpose, a reduce-scatter of the gradient, per backward

Outside a :func:`constraints` context every function here is the identity, so the model runs
unchanged on one device and wherever no mesh is given.

Logical axis names -> mesh axes: ``batch`` -> (``data``, ``fsdp``), ``fsdp`` -> ``fsdp``,
``tensor`` -> ``tensor``; other names (``expert``) and a mesh axis that does not divide the
dimension mean replicated.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Iterator, Optional, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from scaleopt import mesh_context

LOGICAL_TO_MESH = {"batch": ("data", "fsdp"), "fsdp": ("fsdp",), "tensor": ("tensor",)}
_FREED: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("scaleopt_freed_axes",
                                                                         default=())


@contextlib.contextmanager
def constraints(mesh: Optional[Mesh]) -> Iterator[None]:
  """Within this context (entered while tracing), the model constrains its activations and
  kernels on ``mesh`` (axes named ``data``, ``fsdp``, ``tensor``; missing axes count as 1).
  The mesh is held by ``scaleopt.mesh_context``, where the optimizer reads it too."""
  with mesh_context.use(mesh):
    yield


@contextlib.contextmanager
def microbatch_axis(axis: str) -> Iterator[None]:
  """Within this context the logical ``batch`` axis leaves the mesh axis ``axis`` out: it
  belongs to an enclosing ``jax.vmap(..., spmd_axis_name=axis)`` over microbatches (each
  device holds whole microbatches; the rows of one are split over the remaining batch axes)."""
  token = _FREED.set(_FREED.get() + (axis,))
  try:
    yield
  finally:
    _FREED.reset(token)


def current_mesh() -> Optional[Mesh]:
  return mesh_context.current()


def _axis_size(mesh: Mesh, axis: str) -> int:
  return int(mesh.shape[axis]) if axis in mesh.shape else 1


def mesh_spec(mesh: Mesh, logical: Sequence[Optional[str]], shape: Sequence[int]) -> P:
  """PartitionSpec for an array of ``shape`` with logical axes ``logical``.

  Each logical name maps to its mesh axes (``LOGICAL_TO_MESH``) of size > 1; if their product
  does not divide the dimension, the dimension stays replicated.
  """
  out, freed = [], _FREED.get()
  for name, dim in zip(logical, shape):
    axes = tuple(a for a in LOGICAL_TO_MESH.get(name, ())
                 if _axis_size(mesh, a) > 1 and a not in freed)
    size = 1
    for a in axes:
      size *= _axis_size(mesh, a)
    if not axes or dim % size:
      out.append(None)
    else:
      out.append(axes[0] if len(axes) == 1 else axes)
  return P(*out)


def constrain(x: jax.Array, logical: Sequence[Optional[str]]) -> jax.Array:
  """``x`` with the sharding of its logical axes (identity outside :func:`constraints`)."""
  mesh = mesh_context.current()
  if mesh is None:
    return x
  if len(logical) != x.ndim:
    raise ValueError(f"logical axes {tuple(logical)} do not match an array of shape {x.shape}")
  return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, mesh_spec(mesh, logical,
                                                                           x.shape)))


def use_kernel(w: jax.Array, logical: Sequence[Optional[str]]) -> jax.Array:
  """A kernel (already in the compute dtype) gathered for use: its ``fsdp`` axis is dropped,
  ``tensor`` kept (identity outside :func:`constraints`).

  Forward: the kernel keeps its stored layout (so the cast runs on shards), then is
  all-gathered over ``fsdp``. Backward: the gradient is constrained back to the stored layout,
  so the per-device partial sums are reduce-scattered in the compute dtype (half the bytes of
  an all-reduce, and no full-size float32 gradient). Call it after the cast to bf16.
  """
  mesh = mesh_context.current()
  if mesh is None:
    return w
  stored = NamedSharding(mesh, mesh_spec(mesh, logical, w.shape))
  used = NamedSharding(mesh, mesh_spec(mesh, [None if n == "fsdp" else n for n in logical],
                                       w.shape))
  if stored == used:
    return jax.lax.with_sharding_constraint(w, used)
  return _gather(w, stored, used)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _gather(w, stored, used):
  return jax.lax.with_sharding_constraint(jax.lax.with_sharding_constraint(w, stored), used)


def _gather_fwd(w, stored, used):
  return _gather(w, stored, used), None


def _gather_bwd(stored, used, _, ct):
  del used
  return (jax.lax.with_sharding_constraint(ct, stored),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def on_rows(fn, *arrays: jax.Array):
  """``fn`` over row views of arrays whose leading axes are the first array's all but last
  (``[B, T, D]`` and ``[B, T]`` -> ``[B T, D]`` and ``[B T]``), its outputs reshaped back;
  under :func:`constraints` per device on its own rows (``shard_map`` over the batch axes of
  the first axis, the other axes whole on each device). For row-wise kernels."""
  lead = arrays[0].shape[:-1]

  def local(*xs):
    k = len(lead)
    rows = xs[0].shape[:k]
    out = fn(*(x.reshape(-1, *x.shape[k:]) for x in xs))
    return jax.tree.map(lambda y: y.reshape(*rows, *y.shape[1:]), out)

  mesh = mesh_context.current()
  if mesh is None:
    return local(*arrays)
  batch = mesh_spec(mesh, ("batch",), lead[:1])[0]
  spec = lambda x: P(batch, *(None,) * (x.ndim - 1))
  outs = jax.eval_shape(local, *arrays)
  return jax.shard_map(local, mesh=mesh, in_specs=tuple(spec(x) for x in arrays),
                       out_specs=jax.tree.map(spec, outs), check_vma=False)(*arrays)


def tensor_parallel() -> bool:
  """True inside :func:`constraints` on a mesh whose ``tensor`` axis has size > 1."""
  mesh = mesh_context.current()
  return mesh is not None and _axis_size(mesh, "tensor") > 1
