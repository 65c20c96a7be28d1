"""How a matrix (or a stack of them) is cut into equal blocks, and back."""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from scaleopt.optim.tree_utils import is_masked


class Blocking(NamedTuple):
  """How a tensor ``(..., d1, d2)`` is cut: ``nb`` blocks of size ``bs`` along each of its last
  two dims, and ``major``, the order of the blocks on the block axis: ``None`` (stacked layers
  lead: ``(n, nb1, nb2)``), ``-2`` (row blocks lead: ``(nb1, n, nb2)``) or ``-1`` (column
  blocks lead: ``(nb2, n, nb1)``). With ``major`` the dim a mesh axis splits (FSDP's model
  dimension), the block axis split evenly over that axis gives every device the blocks of the
  rows (columns) it already holds whenever the axis size divides ``nb`` and the dim needs no
  padding: blocking, P_L M P_R and unblocking then move no data between devices."""
  nb1: int
  bs1: int
  nb2: int
  bs2: int
  major: Optional[int] = None


# block axes of (n, nb1, bs1, nb2, bs2) -> (block order..., bs1, bs2), per ``Blocking.major``
_BLOCK_PERM = {None: (0, 1, 3, 2, 4), -2: (1, 0, 3, 2, 4), -1: (3, 0, 1, 2, 4)}


MAJORS = tuple(_BLOCK_PERM)


def _cut(d: int, block_size: int, shards: int = 1) -> tuple[int, int]:
  """(nb, bs) of one dim of size d: nb = ceil(d / block_size) blocks of ceil(d / nb), the last
  padded; with ``shards`` > 1 dividing d, each of the ``shards`` equal parts of d is cut into
  the fewest equal blocks of at most ``block_size`` (no padding: no block spans two parts),
  unless those blocks would be less than half of min(part, ``block_size``) (a part of 2 x a
  large prime: blocks of 2): then the dim is cut as without shards."""
  if shards > 1 and d % shards == 0:
    c = d // shards
    per = next(k for k in range(max(1, math.ceil(c / block_size)), c + 1) if c % k == 0)
    if 2 * (c // per) >= min(c, block_size):
      return shards * per, c // per
  nb = max(1, math.ceil(d / block_size))
  return nb, math.ceil(d / nb)


def blocking(shape: tuple[int, ...], block_size: int, major: Optional[int] = None,
             shards: int = 1) -> Blocking:
  """The ``Blocking`` of the last two dims: dim d is split into nb = ceil(d / block_size)
  blocks of size ceil(d / nb) (the last padded with zeros when nb does not divide d). With
  ``major`` set and ``shards`` > 1 dividing that dim, the dim is first cut into ``shards``
  equal parts (a mesh axis's shards) and each part into equal blocks of at most
  ``block_size``: every block then lies in one shard (``_cut``)."""
  if major not in _BLOCK_PERM:
    raise ValueError(f"block major={major!r}; choose one of {MAJORS}")
  out = []
  for axis, d in zip((-2, -1), shape[-2:]):
    out += _cut(d, block_size, shards if axis == major else 1)
  return Blocking(*out, major)


def to_blocks(x: jax.Array, blk: Blocking) -> jax.Array:
  """(..., d1, d2) -> (n * nb1 * nb2, bs1, bs2), zero-padded, in ``blk.major``'s order; leading
  dims (stacked layers) are a batch of n independent matrices."""
  nb1, bs1, nb2, bs2, major = blk
  d1, d2 = x.shape[-2:]
  x = x.reshape(-1, d1, d2)
  x = jnp.pad(x, ((0, 0), (0, nb1 * bs1 - d1), (0, nb2 * bs2 - d2)))
  n = x.shape[0]
  return x.reshape(n, nb1, bs1, nb2, bs2).transpose(_BLOCK_PERM[major]).reshape(
      n * nb1 * nb2, bs1, bs2)


def from_blocks(xb: jax.Array, shape, blk: Blocking) -> jax.Array:
  """Inverse of ``to_blocks`` (drops the padding)."""
  nb1, bs1, nb2, bs2, major = blk
  perm, dims = _BLOCK_PERM[major], (xb.shape[0] // (nb1 * nb2), nb1, bs1, nb2, bs2)
  x = xb.reshape([dims[i] for i in perm]).transpose([perm.index(i) for i in range(5)])
  return x.reshape(-1, nb1 * bs1, nb2 * bs2)[:, :shape[-2], :shape[-1]].reshape(shape)


def block_norms(x: jax.Array, blk: Blocking) -> jax.Array:
  """Frobenius norm of every block of ``x`` (..., d1, d2), shape (n * nb1 * nb2, 1, 1) in
  ``to_blocks`` order, without the block layout: a reshape and a sum over each block's rows
  and columns (no transpose of the tensor, and under a mesh only partial sums move between
  devices)."""
  nb1, bs1, nb2, bs2, major = blk
  d1, d2 = x.shape[-2:]
  x = jnp.pad(x.reshape(-1, d1, d2), ((0, 0), (0, nb1 * bs1 - d1), (0, nb2 * bs2 - d2)))
  sq = jnp.sum(jnp.square(x.reshape(-1, nb1, bs1, nb2, bs2)), axis=(2, 4))
  order = [{0: 0, 1: 1, 3: 2}[i] for i in _BLOCK_PERM[major][:3]]
  return jnp.sqrt(sq.transpose(order)).reshape(-1, 1, 1)


def block_grams(gb, precision="highest"):
  """Per-block G G^T and G^T G (float32 results; ``precision``: one of ``PRECISIONS``)."""
  return (jnp.einsum("nij,nkj->nik", gb, gb, precision=precision),
          jnp.einsum("nji,njk->nik", gb, gb, precision=precision))


def blocks_of(g, blk, c=1.0):
  leaves = jax.tree.leaves(g)
  return {k: to_blocks(c * leaves[int(k)].astype(jnp.float32), b) for k, b in blk.items()}


def major_dims(tree, block_major) -> list:
  """Per flattened leaf of ``tree`` the dim (-2, -1 or None) whose blocks lead
  (``block_major``: None / ``layers``, or a callable tree -> pytree of dims; only a tensor's
  last two dims order blocks)."""
  leaves, td = jax.tree.flatten(tree, is_leaf=is_masked)
  if block_major is None or block_major == "layers":
    return [None] * len(leaves)
  out = []
  for x, d in zip(leaves, td.flatten_up_to(block_major(tree))):
    if d is not None and int(d) >= 0:
      d = int(d) - jnp.ndim(x)
    out.append(d if d in (-2, -1) else None)
  return out


def blockings_of(tree, keys, block_size, block_major, block_shards=1) -> dict:
  """{key: ``Blocking``} of the factored tensors ``keys`` (flattened-leaf indices of ``tree``),
  ordered by ``block_major`` (``major_dims``), the major dim cut into ``block_shards``
  shards first."""
  leaves = jax.tree.leaves(tree, is_leaf=is_masked)
  dims = major_dims(tree, block_major)
  return {k: blocking(jnp.shape(leaves[int(k)]), block_size, dims[int(k)], block_shards)
          for k in keys}
