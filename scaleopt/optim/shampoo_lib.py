"""Shampoo (Gupta et al. 2018; Anil et al. 2020) with the bias corrections of Nayak et al.

For every eligible matrix W (2-D, or a stack of matrices along leading axes as in scanned
models; min(d1, d2) >= ``min_dim``, max(d1, d2) <= ``max_dim``, not excluded) cut into blocks G_b of at most ``block_size`` x ``block_size`` (dims are split into
equal blocks, padded with zeros when needed, so every block of a tensor has one shape):

    L_b <- b2 L_b + (1 - b2) G_b G_b^T,   R_b <- b2 R_b + (1 - b2) G_b^T G_b   (every stats_every)
    L_b + lambda I = Q diag(lam) Q^T,  lam <- max(lam, eig_floor_ratio * lambda)  (every root_every)
    P_L = Q diag(lam^{-1/4}) Q^T  (P_R alike; cached between root steps)
    M <- b1 M + (1 - b1) g;   U_b = P_L M_b P_R;   theta <- theta (1 - lr wd) - lr U

All blocks of one factor size, across all tensors, are stacked and their roots computed in one
batched call on root steps (``phases.cond``): by ``jnp.linalg.eigh`` in float32
(``root_method="eigh"``) or by coupled Newton iterations (``"newton"``: batched matmuls at
``newton_precision``). The default ``"auto"`` takes Newton at precision ``"high"`` (TF32 on
NVIDIA GPUs, three bf16 passes on TPU) on accelerators, where it computes a root step about 3x
faster than cuSOLVER's ``eigh`` with the same loss at 124M (docs/optim.md, Shampoo root
solvers), and ``eigh`` on CPU (LAPACK's is faster there) and for the ``inv``/``full`` modes
(their correction needs the eigenvalues). Other tensors (1-D, embeddings, too large)
take AdamW (b1 or ``adam_b1``, b2 or ``adam_b2``, eps; bias-corrected moments).
``graft="adam"`` (the default, as in distributed Shampoo) rescales each block of U to the
Frobenius norm of the Adam direction m_hat / (sqrt(v_hat) + eps) of that block, so Shampoo takes
AdamW's learning rate. ``graft="none"`` is the paper's ungrafted form: its per-block update norm
is set by the factors alone and needs its own learning rate (docs/optim_sophia_shampoo.md).

Bias correction (``mode``; statistics on root steps only, from ``shampoo_collect``):

* ``cf``: M from group A's gradient; S^L_B = (1/m) sum_{j in B} G_j G_j^T (and S^R_B) enter L, R.
* ``inv`` / ``full``: additionally the eigenvalue-variance correction with the eigenbasis Q of
  the new L held fixed (first-order eigenvalue perturbation):

      ell_{j,k} = b2 q_k^T L_{t-1} q_k + (1 - b2) ||(Q^T G_j)_{k,:}||^2 + lambda
      Var_k = Var_j(ell_{j,k}) / m = (1 - b2)^2 Var_j(||(Q^T G_j)_{k,:}||^2) / m
      d_k = max(0, lam_k^{-1/4} - (5/32) lam_k^{-9/4} Var_k)   (optionally d_k <= d_max)
      P_L = Q diag(d) Q^T

  The variance needs the *new* Q, so ``shampoo_collect`` uses the paper's two-pass form: pass 1
  over B accumulates S^L_B, S^R_B; the new L, R are decomposed; pass 2 over B recomputes each
  G_j and projects it on the new bases (Welford). ``inv`` uses all microbatches as one group.

On steps without a root computation an ``ab`` layout feeds M with all microbatches
(``ab_numerator="a"``: group A on every step, as the authors' code).
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from scaleopt.optim import delta, phases
from scaleopt.optim.adam_bc import check_choice
from scaleopt.optim.collect import (BCStats, CollectorSpec, Static, clip_factor, refresh_groups,
                                    register_bc_state, register_estimator, unclipped_numerator,
                                    value_and_grad_fn, welford_add, welford_init)

PyTree = Any
MaskedNode = optax.MaskedNode

MODES = ("std", "cf", "inv", "full")
CROSSFITS = ("ab", "rolling_b")
ROOT_METHODS = ("auto", "eigh", "newton")
GRAFTS = ("none", "adam")
AB_NUMERATORS = ("all_off_refresh", "a")
STACKED = ("auto", "none")
# ``eigh_implementation``: the solver of jax.lax.linalg.eigh; None: the backend's default (on
# GPU cuSOLVER syevd, Jacobi for n <= 32), "jacobi" (GPU: cuSOLVER syevj for every size; not
# on CPU), "qr" (syevd / LAPACK).
EIGH_IMPLEMENTATIONS = (None, "jacobi", "qr")
# Precisions of the per-step matmuls (``matmul_precision``, ``stats_precision``): a
# ``jax.lax.Precision`` level (backend-dependent: on recent NVIDIA GPUs "default" and "high" are
# TF32 passes, on TPU bfloat16 passes) or an exact ``jax.lax.DotAlgorithmPreset``.
PRECISIONS = ("highest", "high", "default", "F32_F32_F32", "TF32_TF32_F32", "BF16_BF16_F32",
              "BF16_BF16_F32_X3", "BF16_BF16_F32_X6")


# ----------------------------------------------------------------------------- blocking

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


def _gram(gb, precision="highest"):
  """Per-block G G^T and G^T G (float32 results; ``precision``: one of ``PRECISIONS``)."""
  return (jnp.einsum("nij,nkj->nik", gb, gb, precision=precision),
          jnp.einsum("nji,njk->nik", gb, gb, precision=precision))


# ----------------------------------------------------------------------------- roots

def _sym(a):
  return 0.5 * (a + jnp.swapaxes(a, -1, -2))


def eigh_damped(f: jax.Array, damping: float, floor: float,
                implementation: Optional[str] = None):
  """(lam, Q) of f + damping I (batched over leading axes), lam floored at ``floor``;
  ``implementation``: one of ``EIGH_IMPLEMENTATIONS``."""
  eye = jnp.eye(f.shape[-1], dtype=jnp.float32)
  impl = None if implementation is None else jax.lax.linalg.EighImplementation(implementation)
  q, lam = jax.lax.linalg.eigh(_sym(f.astype(jnp.float32)) + damping * eye,
                               symmetrize_input=False, implementation=impl)
  return jnp.maximum(lam, floor), q


def root_from_eig(lam, q, var=None, *, correction_scale: float = 1.0, d_max: float = 0.0):
  """Q diag(d) Q^T with d = lam^{-1/4} (minus (5/32) lam^{-9/4} Var when var is given)."""
  d = lam ** -0.25 if var is None else delta.inv_fourth_root_corrected(
      lam, var, scale=correction_scale)
  if d_max > 0:
    d = jnp.minimum(d, d_max)
  hp = jax.lax.Precision.HIGHEST
  return jnp.matmul(q * d[..., None, :], jnp.swapaxes(q, -1, -2), precision=hp)


def _matrix_power(t, p: int, precision):
  """t^p by repeated squaring (2 matmuls for p = 4)."""
  out, sq = None, t
  while p:
    if p & 1:
      out = sq if out is None else jnp.matmul(out, sq, precision=precision)
    p >>= 1
    if p:
      sq = jnp.matmul(sq, sq, precision=precision)
  return out


def newton_inverse_root(f: jax.Array, damping: float, p: int = 4, iters: int = 30,
                        precision: str = "highest"):
  """(f + damping I)^{-1/p} by coupled Newton iterations (Higham 2008, eq. 7.18), batched.

  With A scaled by z = (1 + p) / (2 ||A||_F): M_0 = z A, X_0 = z^{1/p} I, and
  T_i = ((p + 1) I - M_i) / p,  X_{i+1} = X_i T_i,  M_{i+1} = T_i^p M_i;  X -> A^{-1/p}.
  The error e_i = ||M_i - I||_F bounds every eigenvalue's |m - 1|, and decreases at every
  step in exact arithmetic. Each matrix keeps its last X with a smaller error and stops once
  the error does not decrease (round-off: float32 makes the iteration diverge on
  ill-conditioned inputs, as in google-research's distributed Shampoo) or stalls in the
  quadratic phase (e_i < 0.1, where every eigenvalue converges quadratically, and
  e_{i+1} > e_i / 2: the round-off floor of ``precision``); the loop ends when every matrix of
  the batch has stopped or after ``iters`` iterations. T^p is taken by squaring (2 + 2 matmuls per
  iteration for p = 4), every matmul at ``precision`` (one of ``PRECISIONS``).
  """
  return _newton_loop(f, damping, p, iters, precision)[1]


def _newton_loop(f, damping, p, iters, precision):
  """(iterations run, X) of ``newton_inverse_root``."""
  n = f.shape[-1]
  eye = jnp.eye(n, dtype=jnp.float32)
  a = _sym(f.astype(jnp.float32)) + damping * eye
  norm = jnp.sqrt(jnp.sum(a * a, axis=(-2, -1), keepdims=True))
  z = (1.0 + p) / (2.0 * norm)
  m0 = a * z
  x0 = jnp.broadcast_to(eye, a.shape) * z ** (1.0 / p)
  err = lambda m: jnp.sqrt(jnp.sum(jnp.square(m - eye), axis=(-2, -1), keepdims=True))

  def body(c):
    i, x, m, e, done = c
    t = ((p + 1.0) * eye - m) / p
    x_new = jnp.matmul(x, t, precision=precision)
    m_new = jnp.matmul(_matrix_power(t, p, precision), m, precision=precision)
    e_new = err(m_new)
    take = ~done & (e_new < e)  # False for NaN
    stall = (e < 0.1) & (e_new > 0.5 * e)  # quadratic convergence at least halves the error
    return (i + 1, jnp.where(take, x_new, x), jnp.where(take, m_new, m),
            jnp.where(take, e_new, e), done | ~take | stall)

  cond = lambda c: (c[0] < iters) & ~jnp.all(c[4])
  done0 = jnp.zeros(norm.shape, bool)
  i, x, _, _, _ = jax.lax.while_loop(cond, body, (0, x0, m0, err(m0), done0))
  return i, _sym(x)


# ----------------------------------------------------------------------------- sharding

def _mesh():
  """The mesh the step is traced under (``scaleopt.models.sharding.constraints``), or None
  when it has a single device."""
  # read without importing the models (scaleopt.optim never imports flax): if the module is not
  # loaded, no step is traced under its context
  mod = sys.modules.get("scaleopt.models.sharding")
  mesh = mod.current_mesh() if mod is not None else None
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


def _on_owner(x):
  """``x`` ``[n, ...]`` pinned to the block sharding (identity without a multi-device mesh), so
  per-block work runs on the devices that hold the block's factors."""
  mesh = _mesh()
  return x if mesh is None else jax.lax.with_sharding_constraint(x, block_sharding(mesh, x.shape))


def in_host_memory(x) -> bool:
  """Whether ``x`` (an array or a tracer) lives in host memory (``jax.memory.Space.Host``)."""
  typeof = getattr(jax, "typeof", None)
  space = getattr(typeof(x), "memory_space", None) if typeof is not None else None
  return space is not None and space == jax.memory.Space.Host


def _to_device(x):
  """``x`` in device memory: a copy from host memory if it lives there, else ``x`` itself."""
  return jax.device_put(x, jax.memory.Space.Device) if in_host_memory(x) else x


def _to_host(x):
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


def _batched_by_size(mats: dict, fn: Callable) -> dict:
  """Applies ``fn`` to every (n_i, s, s) array, batching all arrays of one size s together
  (one concatenation, one batched call, one split per size).

  On CPU the calls run one matrix at a time (``lax.map``) and one size after another
  (``optimization_barrier``): jaxlib's batched CPU LAPACK kernels split a batch over XLA's
  intra-op thread pool and block on it, and two such kernels in flight at once can take every
  pool thread and deadlock (seen with jax 0.10.2 on 2 cores). Accelerators keep the batched call.

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


# ----------------------------------------------------------------------------- state

class ShampooFactors(NamedTuple):
  """Blocked Kronecker factors of one tensor: (n_blocks, bs1, bs1) and (n_blocks, bs2, bs2)."""
  L: jax.Array
  R: jax.Array
  PL: jax.Array
  PR: jax.Array


class ScaleByShampooState(NamedTuple):
  """count; momentum mu (all tensors); Adam second moment nu (fallback tensors, and all with
  grafting; scalar zeros elsewhere); factors: {str(leaf index): ShampooFactors} of the eligible
  tensors (indices in the flattened parameter tree); spec: the ``CollectorSpec``; hp: b2,
  damping and eig_floor_ratio as arrays (the collector's two-pass eigendecomposition)."""
  count: jax.Array
  mu: PyTree
  nu: PyTree
  factors: dict
  spec: Static
  hp: dict


register_bc_state(ScaleByShampooState)


class ShampooPrecond(NamedTuple):
  """``bc_stats.precond`` for Shampoo-BC ({leaf index: array} dicts, blocked).

  stat_L, stat_R: (1/m) sum_{j in B} G_j G_j^T and G_j^T G_j; eig_L, eig_R: (lam, Q) of the
  new damped factors (two-pass form; None for ``cf``); var_L, var_R: Var_k of the eigenvalue
  projections (None for ``cf``); root: scalar bool, whether this is a root step.
  """
  stat_L: dict
  stat_R: dict
  eig_L: Optional[dict]
  eig_R: Optional[dict]
  var_L: Optional[dict]
  var_R: Optional[dict]
  root: jax.Array


def _is_masked(x):
  return isinstance(x, MaskedNode)


def _check_int(name, v, lo=1):
  if not isinstance(v, int) or isinstance(v, bool) or v < lo:
    raise ValueError(f"{name}={v!r} must be an integer >= {lo}")


# ----------------------------------------------------------------------------- collector

def shampoo_collector_spec(mode: str, crossfit: str, root_every: int, block_size: int,
                           stats_precision: str = "highest",
                           eigh_implementation: Optional[str] = None,
                           block_major: Optional[Callable] = None,
                           block_shards: int = 1,
                           ab_numerator: str = "all_off_refresh") -> CollectorSpec:
  """The estimator pass these settings need (``std``: the plain collector); the B-side
  statistics G_j G_j^T, G_j^T G_j take ``stats_precision``, the two-pass eigendecomposition
  ``eigh_implementation``, the blocks ``block_major``'s order and ``block_shards``' cut."""
  check_choice("mode", mode, MODES)
  check_choice("crossfit", crossfit, CROSSFITS)
  check_choice("ab_numerator", ab_numerator, AB_NUMERATORS)
  if mode == "std":
    return CollectorSpec(layout=None)
  layout = "all" if mode == "inv" else crossfit
  opts = (("two_pass", mode in ("inv", "full")), ("block_size", block_size),
          ("stats_precision", stats_precision), ("eigh_implementation", eigh_implementation),
          ("block_major", block_major), ("block_shards", block_shards),
          ("a_every_step", ab_numerator == "a"))
  return CollectorSpec(layout=layout, estimator="shampoo", refresh_every=root_every,
                       estimator_options=opts, stateful=True)


def _blocks_of(g, blk, c=1.0):
  leaves = jax.tree.leaves(g)
  return {k: to_blocks(c * leaves[int(k)].astype(jnp.float32), b) for k, b in blk.items()}


def _major_dims(tree, block_major) -> list:
  """Per flattened leaf of ``tree`` the dim (-2, -1 or None) whose blocks lead
  (``block_major``: None / ``layers``, or a callable tree -> pytree of dims; only a tensor's
  last two dims order blocks)."""
  leaves, td = jax.tree.flatten(tree, is_leaf=_is_masked)
  if block_major is None or block_major == "layers":
    return [None] * len(leaves)
  out = []
  for x, d in zip(leaves, td.flatten_up_to(block_major(tree))):
    if d is not None and int(d) >= 0:
      d = int(d) - jnp.ndim(x)
    out.append(d if d in (-2, -1) else None)
  return out


def _blockings(tree, keys, block_size, block_major, block_shards=1) -> dict:
  """{key: ``Blocking``} of the factored tensors ``keys`` (flattened-leaf indices of ``tree``),
  ordered by ``block_major`` (``_major_dims``), the major dim cut into ``block_shards``
  shards first."""
  leaves = jax.tree.leaves(tree, is_leaf=_is_masked)
  dims = _major_dims(tree, block_major)
  return {k: blocking(jnp.shape(leaves[int(k)]), block_size, dims[int(k)], block_shards)
          for k in keys}


def _eig_variances(grad_fn, params, mbs_b, keys, blk, eig_l, eig_r, b2, c):
  """Pass 2: Var_k of the projections of c G_j on the new eigenbases (Welford over B)."""
  hp = jax.lax.Precision.HIGHEST
  m_b = jax.tree.leaves(mbs_b)[0].shape[0]

  def proj(gb):  # ||(Q_L^T G)_{k,:}||^2 and ||(G Q_R)_{:,k}||^2 per block
    pl = {k: jnp.sum(jnp.einsum("nik,nij->nkj", eig_l[k][1], gb[k], precision=hp) ** 2, -1)
          for k in keys}
    pr = {k: jnp.sum(jnp.einsum("nij,njk->nik", gb[k], eig_r[k][1], precision=hp) ** 2, -2)
          for k in keys}
    return pl, pr

  w0 = welford_init(jax.tree.map(lambda lam_q: lam_q[0], (eig_l, eig_r),
                                 is_leaf=lambda x: isinstance(x, tuple) and len(x) == 2
                                 and not isinstance(x[0], dict)))
  body = lambda w, mb: (welford_add(w, proj(_blocks_of(grad_fn(params, mb)[2], blk, c))),
                        None)
  w, _ = jax.lax.scan(body, w0, mbs_b)
  den = (1 - b2) ** 2 / (m_b * (m_b - 1))
  return tuple({k: jnp.maximum(v * den, 0.0) for k, v in side.items()} for side in w.m2)


def _factor_pass(grad_fn, params, mbs_b, st, keys, blk, hp, num, clip_of, two_pass,
                 stats_precision, eigh_implementation):
  """Pass 1 over B (factor statistics, B's mean gradient and loss), then for the two-pass
  form the eigendecomposition of the new factors and pass 2. Statistics are of c G_j."""
  m_b = jax.tree.leaves(mbs_b)[0].shape[0]
  zero = lambda: {k: (jnp.zeros(st.factors[k].L.shape, jnp.float32),
                      jnp.zeros(st.factors[k].R.shape, jnp.float32)) for k in keys}

  def pass1(carry, mb):
    s, g_sum, l_sum, a_sum = carry
    loss, aux, g = grad_fn(params, mb)
    gb = _blocks_of(g, blk)
    s = {k: tuple(x + y for x, y in zip(s[k], _gram(gb[k], stats_precision))) for k in keys}
    g_sum = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_sum, g)
    return (s, g_sum, l_sum + loss, jax.tree.map(jnp.add, a_sum, aux)), None

  mb0 = jax.tree.map(lambda x: x[0], mbs_b)
  _, aux_s, g_s = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32),
                               jax.eval_shape(grad_fn, params, mb0))
  (s, g_sum, l_sum, a_sum), _ = jax.lax.scan(pass1, (zero(), g_s, jnp.float32(0.0), aux_s),
                                             mbs_b)
  g_b = jax.tree.map(lambda x: x / m_b, g_sum)
  c = clip_of(g_b)
  sl = {k: (c * c) * s[k][0] / m_b for k in keys}
  sr = {k: (c * c) * s[k][1] / m_b for k in keys}
  extra = (g_b, l_sum / m_b, jax.tree.map(lambda x: x / m_b, a_sum))
  if not two_pass:
    return ShampooPrecond(sl, sr, None, None, None, None, jnp.bool_(True)), extra
  b2, damping = hp["b2"], hp["damping"]
  mats = {**{("L", k): b2 * _to_device(st.factors[k].L) + (1 - b2) * sl[k] for k in keys},
          **{("R", k): b2 * _to_device(st.factors[k].R) + (1 - b2) * sr[k] for k in keys}}
  floor = hp["eig_floor_ratio"] * damping
  eig = _batched_by_size(mats, lambda f: eigh_damped(f, damping, floor, eigh_implementation))
  eig_l, eig_r = ({k: eig[(side, k)] for k in keys} for side in ("L", "R"))
  var_l, var_r = _eig_variances(grad_fn, params, mbs_b, keys, blk, eig_l, eig_r, b2, c)
  return ShampooPrecond(sl, sr, eig_l, eig_r, var_l, var_r, jnp.bool_(True)), extra


def shampoo_collect(loss_fn, params: PyTree, microbatches: PyTree, spec: CollectorSpec, found,
                    *, key=None, logits_fn=None, b_microbatches: PyTree = None,
                    max_norm=None) -> BCStats:
  """Numerator gradient plus, on root steps (count % root_every == 0, ``phases.cond``),
  the B-side factor statistics and (``inv``/``full``) the two-pass eigenvalue variances.

  On root steps of the ``ab`` layout ``full`` and ``loss`` cover A and B (pass 1 over B
  computes B's gradients anyway). A consistent clip uses c from ``full``'s norm and scales
  the numerator by c, the factor statistics by c^2 and their variances by c^4.
  """
  del key, logits_fn
  f = next(f for f in found if isinstance(f.state, ScaleByShampooState))
  st, hp, opts = f.state, f.hp, dict(spec.estimator_options)
  root = phases.due(st.count, spec.refresh_every)
  grad_fn = value_and_grad_fn(loss_fn)
  (num, loss, aux), mbs_b = refresh_groups(grad_fn, params, microbatches, spec.layout, root,
                                           b_microbatches, vmap=spec.vmap,
                                           a_every_step=opts.get("a_every_step", False))
  m_b = jax.tree.leaves(mbs_b)[0].shape[0]
  if opts["two_pass"] and m_b < 2:
    raise ValueError(f"the eigenvalue-variance correction needs >= 2 microbatches in group B, "
                     f"got {m_b}")
  keys = sorted(st.factors)
  blk = _blockings(params, keys, opts["block_size"], opts["block_major"], opts["block_shards"])
  for k in keys:
    shape, b = jax.tree.leaves(params)[int(k)].shape, blk[k]
    if st.factors[k].L.shape != (math.prod(shape[:-2]) * b.nb1 * b.nb2, b.bs1, b.bs1):
      raise ValueError("shampoo_collect: the optimizer state's blocks do not match the "
                       "parameters; build the state with tx.init(params)")
  both = spec.layout == "ab"
  avg = lambda x, y: jax.tree.map(lambda p, q: 0.5 * (p + q), x, y)
  full_of = lambda g_b: avg(num, g_b) if both else num
  clip_of = lambda g_b: (clip_factor(full_of(g_b), max_norm) if max_norm is not None
                         else jnp.float32(1.0))
  run = lambda: _factor_pass(grad_fn, params, mbs_b, st, keys, blk, hp, num, clip_of,
                             opts["two_pass"], opts["stats_precision"],
                             opts["eigh_implementation"])
  skip = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(run))
  pre, (g_b, loss_b, aux_b) = phases.cond(root, run, skip)
  pre = pre._replace(root=root)
  use_b = root & both
  full = jax.tree.map(lambda p, q: jnp.where(use_b, p, q), full_of(g_b), num)
  loss = jnp.where(use_b, 0.5 * (loss + loss_b), loss)
  aux = jax.tree.map(lambda p, q: jnp.where(use_b, 0.5 * (p + q), p), aux, aux_b)
  c = clip_factor(full, max_norm) if max_norm is not None else jnp.float32(1.0)
  scale = lambda t: jax.tree.map(lambda x: c * x, t)
  return BCStats(scale(num), scale(full), None, None, None, loss, aux, c, pre)


register_estimator("shampoo", shampoo_collect)


# ----------------------------------------------------------------------------- transform

def _init(params, exclude, eligible, block_size, graft, mu_dtype, offload, block_major,
          block_shards):
  leaves, td = jax.tree.flatten(params, is_leaf=_is_masked)
  dims = _major_dims(params, block_major)
  ex = exclude(params) if callable(exclude) else exclude
  excl = [False] * len(leaves) if exclude is None else [bool(e) for e in td.flatten_up_to(ex)]
  stack_sizes = {p.shape[0] for p in leaves if not _is_masked(p) and jnp.ndim(p) >= 3}
  factors, nu = {}, []
  for i, (p, e) in enumerate(zip(leaves, excl)):
    if _is_masked(p):
      nu.append(p)
      continue
    ok = eligible(p, e, stack_sizes)
    if ok:
      nb1, bs1, nb2, bs2, _ = blocking(p.shape, block_size, dims[i], block_shards)
      n = math.prod(p.shape[:-2]) * nb1 * nb2
      eye = lambda s: jnp.broadcast_to(jnp.eye(s, dtype=jnp.float32), (n, s, s))
      stat = lambda s: jnp.zeros((n, s, s), jnp.float32)
      store = _to_host if offload else (lambda x: x)
      factors[str(i)] = ShampooFactors(L=store(stat(bs1)), R=store(stat(bs2)),
                                       PL=eye(bs1), PR=eye(bs2))
    need_nu = (not ok) or graft == "adam"
    nu.append(jnp.zeros(jnp.shape(p), jnp.float32) if need_nu else jnp.zeros((), jnp.float32))
  mu = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), mu_dtype), params)
  return mu, jax.tree.unflatten(td, nu), factors


def _roots(f, keys, pre, *, root_method, damping, floor, newton_iters, newton_precision,
           correction_scale, d_max, eigh_implementation):
  """New P_L, P_R for every factor (batched over blocks and tensors of one size); with
  ``pre.eig_L`` (two-pass form) the collector's corrected eigenvalues."""
  if pre is not None and pre.eig_L is not None:
    root = lambda eig, var: root_from_eig(*eig, var, correction_scale=correction_scale,
                                          d_max=d_max)
    pl = {k: root(pre.eig_L[k], pre.var_L[k]) for k in keys}
    pr = {k: root(pre.eig_R[k], pre.var_R[k]) for k in keys}
  else:
    mats = {**{("L", k): f[k].L for k in keys}, **{("R", k): f[k].R for k in keys}}
    if resolve_root_method(root_method, d_max=d_max,
                           eigh_implementation=eigh_implementation) == "eigh":
      fn = lambda x: root_from_eig(*eigh_damped(x, damping, floor, eigh_implementation),
                                   d_max=d_max)
    else:
      fn = lambda x: newton_inverse_root(x, damping, 4, newton_iters, newton_precision)
    out = _batched_by_size(mats, fn)
    pl, pr = ({k: out[(s, k)] for k in keys} for s in ("L", "R"))
  ok = lambda new, old: _on_owner(jnp.where(jnp.all(jnp.isfinite(new)), new, old))  # failed: keep
  return {k: f[k]._replace(PL=ok(pl[k], f[k].PL), PR=ok(pr[k], f[k].PR)) for k in keys}


def _ema_factors(f, keys, sl, sr, b2):
  return {k: f[k]._replace(L=b2 * f[k].L + (1 - b2) * sl[k], R=b2 * f[k].R + (1 - b2) * sr[k])
          for k in keys}


def _statistics_io(offload: bool):
  """(load, store) of the factors' statistics L, R. ``load(f)``: L, R in device memory.
  ``store(new, old, f, step_ok)``: with ``offload``, the new L, R (the old ones, loaded, when
  any new one is not finite or ``step_ok`` is false: the trainer's skip guard cannot roll back
  host-resident state) back where ``f``'s were (host memory, unless the caller placed the
  state on the device); without, the new factors as they are."""
  def load(f):
    return {k: v._replace(L=_to_device(v.L), R=_to_device(v.R)) for k, v in f.items()}

  def store(new, old, f, step_ok):
    if not offload or not new:
      return new
    ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for v in new.values() for x in (v.L, v.R)]))
    ok = ok & step_ok

    def keep(n, o, where):
      x = _on_owner(jnp.where(ok, n, o))
      return _to_host(x) if in_host_memory(where) else x

    return {k: v._replace(L=keep(v.L, old[k].L, f[k].L), R=keep(v.R, old[k].R, f[k].R))
            for k, v in new.items()}

  return load, store


def _update_factors(f, g_l, blk, keys, count, pre, step_ok, *, mode, stats_every, root_every,
                    b2, stats_precision, offload, root_kw):
  """The factors after this step: std takes the statistics of the step's gradient every
  ``stats_every`` steps and the roots every ``root_every`` steps (from the new statistics when
  both fall on one step, on the same device copy); BC modes take B's statistics and the roots
  on the collector's root steps. With ``offload`` L, R come to the device once per step that
  uses them."""
  if not keys:
    return f
  load, store = _statistics_io(offload)
  roots = lambda d: _roots(d, keys, pre, **root_kw)
  if mode != "std":
    def refresh(f):
      old = load(f)
      new = roots(_ema_factors(old, keys, pre.stat_L, pre.stat_R, b2))
      return store(new, old, f, step_ok)
    return phases.cond(pre.root, refresh, lambda f: f, f)
  is_root = phases.due(count, root_every)

  def statistics(f):
    gram = {k: _gram(_on_owner(to_blocks(g_l[int(k)], blk[k])), stats_precision) for k in keys}
    old = load(f)
    new = _ema_factors(old, keys, {k: v[0] for k, v in gram.items()},
                       {k: v[1] for k, v in gram.items()}, b2)
    return store(phases.cond(is_root, roots, lambda d: d, new), old, f, step_ok)

  def roots_only(f):  # L, R read, not changed: they stay where they are kept
    def run(f):
      new = roots(load(f))
      return {k: new[k]._replace(L=f[k].L, R=f[k].R) for k in keys}
    return phases.cond(is_root, run, lambda f: f, f)

  if stats_every == 1:
    return statistics(f)
  return phases.cond(phases.due(count, stats_every), statistics, roots_only, f)


def _step_ok(bc_stats: Optional[BCStats]) -> jax.Array:
  """False when ``bc_stats`` reports a non-finite loss or gradient: a step the trainer skips."""
  if bc_stats is None:
    return jnp.bool_(True)
  ok = jnp.isfinite(bc_stats.loss)
  return ok if bc_stats.full is None else ok & jnp.isfinite(optax.global_norm(bc_stats.full))


def _direction(g, mu, nu, f, blk, graft, adam, update_clip_fro, precision):
  """(u, nu) of one tensor: P_L M P_R (matmuls at ``precision``; grafted to the Adam norm per
  block) or Adam."""
  bc1, ab2, bc2, eps = adam
  if f is None or graft == "adam":
    nu = ab2 * nu + (1 - ab2) * g * g
    adam_dir = (mu / bc1) / (jnp.sqrt(nu / bc2) + eps)
  if f is None:
    return adam_dir, nu
  ub = jnp.matmul(jnp.matmul(f.PL, _on_owner(to_blocks(mu, blk)), precision=precision), f.PR,
                  precision=precision)
  if graft == "adam":
    n_u = jnp.sqrt(jnp.sum(ub * ub, axis=(1, 2), keepdims=True))
    ub = ub * (block_norms(adam_dir, blk) / jnp.maximum(n_u, 1e-30))
  u = from_blocks(ub, g.shape, blk)
  if update_clip_fro > 0:
    u = u * jnp.minimum(1.0, update_clip_fro / jnp.maximum(jnp.sqrt(jnp.sum(u * u)), 1e-30))
  return u, nu


def _validate(*, root_method, graft, stacked, block_size, stats_every, root_every, max_dim,
              newton_iters, mode, damping, matmul_precision, stats_precision,
              eigh_implementation, newton_precision, block_major, block_shards,
              offload_statistics):
  check_choice("root_method", root_method, ROOT_METHODS)
  check_choice("matmul_precision", matmul_precision, PRECISIONS)
  check_choice("newton_precision", newton_precision, PRECISIONS)
  check_choice("stats_precision", stats_precision, PRECISIONS)
  check_choice("eigh_implementation", eigh_implementation, EIGH_IMPLEMENTATIONS)
  if eigh_implementation == "jacobi" and jax.default_backend() == "cpu":
    raise ValueError("eigh_implementation='jacobi' needs a GPU (no Jacobi eigh on CPU)")
  check_choice("graft", graft, GRAFTS)
  check_choice("stacked", stacked, STACKED)
  for n, v in (("block_size", block_size), ("stats_every", stats_every),
               ("root_every", root_every), ("max_dim", max_dim), ("newton_iters", newton_iters)):
    _check_int(n, v)
  if mode in ("inv", "full") and root_method == "newton":
    raise ValueError(f"mode={mode!r} corrects eigenvalues; root_method must be 'eigh'")
  if isinstance(damping, (int, float)) and not damping > 0:
    raise ValueError(f"damping={damping!r} must be > 0")
  if not (block_major is None or block_major == "layers" or callable(block_major)):
    raise ValueError(f"block_major={block_major!r} must be None, 'layers' or a callable "
                     "params -> pytree of dims")
  if not isinstance(block_shards, int) or isinstance(block_shards, bool) or block_shards < 1:
    raise ValueError(f"block_shards={block_shards!r} must be an integer >= 1 (in a training "
                     "config, 'fsdp': mesh.fsdp)")
  if block_shards > 1 and block_major == "layers":
    raise ValueError(f"block_shards={block_shards} cuts each tensor's block_major dim into "
                     "shards; block_major='layers' has none (remove one of the two)")
  if not isinstance(offload_statistics, bool):
    raise ValueError(f"offload_statistics={offload_statistics!r} must be true or false")
  if offload_statistics and not hasattr(getattr(jax, "memory", None), "Space"):
    raise ValueError(f"offload_statistics=True needs jax.memory.Space (jax {jax.__version__} "
                     "has none)")


def resolve_root_method(root_method: str, mode: str = "std", backend: Optional[str] = None,
                        d_max: float = 0.0, eigh_implementation: Optional[str] = None) -> str:
  """``auto`` -> ``eigh`` for the eigenvalue-correcting modes (inv, full), with ``d_max`` or
  ``eigh_implementation`` set (options of the eigh path) and on CPU, else ``newton``; other
  values unchanged. ``backend``: default ``jax.default_backend()``, read when the first step
  is traced (not when the transform is built: a multi-process run initializes JAX's
  distributed runtime after building its optimizer)."""
  if root_method != "auto":
    return root_method
  if mode in ("inv", "full") or d_max > 0 or eigh_implementation is not None:
    return "eigh"
  return "eigh" if (backend or jax.default_backend()) == "cpu" else "newton"


def _eligible(x, excl, stack_sizes, *, stacked, min_dim, max_dim) -> bool:
  nd = jnp.ndim(x)
  if excl or nd < 2 or (nd > 2 and stacked == "none"):
    return False
  if nd == 2 and stacked == "auto" and x.shape[0] in stack_sizes:
    return False  # a stack of vectors (e.g. per-layer norm scales)
  return min(x.shape[-2:]) >= min_dim and max(x.shape[-2:]) <= max_dim


def _all_directions(orig_l, g_l, raw_l, mu_l, nu_l, fac, blk, t, hp):
  """Momentum, Adam second moment and direction of every tensor (flattened lists): matrices
  with factors use b1 and P_L M P_R, fallback tensors adam_b1 and Adam. The momentum takes
  ``g_l``, the Adam second moment ``raw_l`` (the gradient before a numerator-only clip)."""
  out_u, out_mu, out_nu = list(g_l), list(mu_l), list(nu_l)
  for i, g in enumerate(g_l):
    if _is_masked(g):
      continue
    f = fac.get(str(i))
    b1_i = hp["b1"] if f is not None else hp["ab1"]
    out_mu[i] = b1_i * mu_l[i] + (1 - b1_i) * g
    adam = (1.0 - b1_i ** t, hp["ab2"], 1.0 - hp["ab2"] ** t, hp["eps"])
    u, out_nu[i] = _direction(raw_l[i], out_mu[i], nu_l[i], f, blk.get(str(i)), hp["graft"],
                              adam,
                              hp["update_clip_fro"], hp["matmul_precision"])
    out_u[i] = u.astype(orig_l[i].dtype)
  return out_u, out_mu, out_nu


def scale_by_shampoo(
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    *,
    block_size: int = 512,
    max_dim: int = 8192,
    min_dim: int = 2,
    stats_every: int = 1,
    root_every: int = 10,
    damping: float = 1e-6,
    eig_floor_ratio: float = 1e-3,
    root_method: str = "auto",
    newton_iters: int = 30,
    newton_precision: str = "high",
    graft: str = "adam",
    adam_b1: Optional[float] = None,
    adam_b2: Optional[float] = None,
    update_clip_fro: float = 0.0,
    d_max: float = 0.0,
    exclude: Optional[Union[PyTree, Callable[[PyTree], PyTree]]] = None,
    stacked: str = "auto",
    block_major: Union[None, str, Callable[[PyTree], PyTree]] = None,
    block_shards: int = 1,
    mode: str = "std",
    crossfit: str = "ab",
    correction_scale: float = 1.0,
    ab_numerator: str = "all_off_refresh",
    mu_dtype: Optional[str] = None,
    matmul_precision: str = "high",
    stats_precision: str = "high",
    eigh_implementation: Optional[str] = None,
    offload_statistics: bool = False,
) -> optax.GradientTransformationExtraArgs:
  """Shampoo's scaling with an AdamW fallback; see the module docstring.

  ``update(g, state, params, *, bc_stats=None)``: ``std`` works on the gradient alone (factor
  statistics G G^T of the step's mean gradient); ``cf``/``inv``/``full`` need ``bc_stats``
  from ``scaleopt.optim.collect`` (which reads root_every, block_size, b2, damping and
  eig_floor_ratio from this transform's state).

  Args:
    b1: momentum M of preconditioned tensors (and of fallback tensors unless ``adam_b1``).
    b2: factor EMA rate (and Adam's b2 unless ``adam_b2`` is given).
    eps: Adam's epsilon (fallback and grafting).
    block_size, max_dim, min_dim: blocking and eligibility (see module docstring); blocks of
      512 (the default) cost less per step than 1024 (cheaper roots and P_L M P_R;
      docs/optim.md, Shampoo defaults).
    stats_every, root_every: statistics and root frequencies (BC modes take statistics on root
      steps only, from group B).
    damping, eig_floor_ratio: lambda and the eigenvalue floor eig_floor_ratio * lambda.
    root_method: ``eigh`` (float32), ``newton`` (coupled Newton, at most ``newton_iters``
      iterations; std/cf) or ``auto`` (``resolve_root_method``: Newton on GPU/TPU for std/cf,
      else eigh).
    newton_precision: precision of the coupled Newton matmuls, one of ``PRECISIONS``
      (docs/optim.md, Shampoo root solvers).
    graft: ``adam`` (default; per-block Frobenius norm of the Adam direction) or ``none``.
    adam_b1, adam_b2: the fallback AdamW's rates (the reference code's separate betas).
    update_clip_fro: if > 0, scale each preconditioned tensor's U to Frobenius norm <= c.
    d_max: if > 0, clip corrected roots at d_max.
    exclude: pytree of bools or callable params -> pytree; True keeps a matrix on AdamW.
    stacked: ``auto``: a tensor of rank >= 3 is a stack of matrices (its last two dims), and
      a rank-2 tensor whose first dim equals the leading dim of a rank >= 3 tensor is a stack
      of vectors (AdamW); ``none``: only rank-2 tensors are matrices.
    block_major: the order of each matrix's blocks in its factors (``Blocking.major``): None
      or ``"layers"`` (stacked layers lead), or a callable params -> pytree giving per tensor
      the dim (-2 or -1; None: layers lead) whose blocks lead. The trainer passes the model's
      FSDP dims (``scaleopt.models.fsdp_dims``): a mesh that splits that dim then splits the
      blocks alike, and no gradient or direction moves between devices to be blocked. The
      order is part of the stored factors: resume a run with the order it was saved with.
    block_shards: cut each tensor's ``block_major`` dim into this many equal shards before
      blocking it, each shard into the fewest equal blocks of at most ``block_size``
      (``blocking``). With the mesh's FSDP size every block lies in the rows (columns) one
      device holds, also where a shard is smaller than a block (gpt2-small's d = 768 on 4
      devices: blocks of 192 instead of 384), so blocking moves no data wherever the factors
      are split over the ``fsdp`` axis (``block_axes``); the blocks, and so the
      preconditioner, then depend on that size (1, the default: they do not). Only a tensor
      with a ``block_major`` dim is cut so (None: none is); a dim the shards do not divide is
      blocked as usual.
    mode: ``std|cf|inv|full``; crossfit: ``ab`` or ``rolling_b``.
    correction_scale: multiplies the (5/32) lam^{-9/4} Var term.
    ab_numerator: M's input in the ``ab`` layout: ``all_off_refresh`` (default: group A on
      root steps, all 2m microbatches on the others) or ``a`` (group A on every step, the
      authors' code: the same noise level on every step).
    mu_dtype: dtype of the stored momentum M (None: float32; as ``optax.adamw``'s
      ``mu_dtype``): b1 M + (1 - b1) G runs in float32 from the stored M (as optax's), and M
      is rounded to ``mu_dtype`` when stored.
    matmul_precision: precision of the two matmuls of P_L M P_R per block, one of
      ``PRECISIONS`` ("highest": true float32; "TF32_TF32_F32" / "BF16_BF16_F32": one tensor-core
      pass with inputs rounded to 10 / 7 mantissa bits, about 3 / 2 significant digits per
      product, float32 accumulation; docs/optim.md, Shampoo matmul precision).
    stats_precision: precision of the statistics G G^T, G^T G (every stats_every steps, and
      the collector's B-side statistics). Eigendecompositions, eigenvector roots and the
      eigenvalue variances always run in float32 at the highest precision.
    eigh_implementation: the eigendecomposition's solver, one of ``EIGH_IMPLEMENTATIONS``
      (None: the backend's default; "jacobi" needs a GPU).
    offload_statistics: keep the statistics L, R in pinned host memory between the steps that
      use them (``jax.memory.Space.Host``); they come to the device only inside the branches
      that update them (every ``stats_every`` steps) or decompose them (root steps), so the
      device holds P_L, P_R, the momentum and the grafting moments alone. Each use moves L and
      R across the host link both ways: worth it with ``stats_every`` > 1 (typically
      ``stats_every = root_every``). A step whose new statistics are not finite keeps the old
      ones. The trainer places such leaves in host memory by reading where ``init`` puts them
      (docs/optim_sophia_shampoo.md, Host offload).
  """
  _validate(root_method=root_method, graft=graft, stacked=stacked, block_size=block_size,
            stats_every=stats_every, root_every=root_every, max_dim=max_dim,
            newton_iters=newton_iters, newton_precision=newton_precision, mode=mode,
            damping=damping, matmul_precision=matmul_precision, stats_precision=stats_precision,
            eigh_implementation=eigh_implementation, block_major=block_major,
            block_shards=block_shards, offload_statistics=offload_statistics)
  spec = shampoo_collector_spec(mode, crossfit, root_every, block_size, stats_precision,
                                eigh_implementation, block_major, block_shards, ab_numerator)
  ab1 = b1 if adam_b1 is None else adam_b1
  ab2 = b2 if adam_b2 is None else adam_b2
  hp = lambda: {k: jnp.asarray(v, jnp.float32) for k, v in
                (("b2", b2), ("damping", damping), ("eig_floor_ratio", eig_floor_ratio))}
  root_kw = dict(root_method=root_method, damping=damping, floor=eig_floor_ratio * damping,
                 eigh_implementation=eigh_implementation,
                 newton_iters=newton_iters, newton_precision=newton_precision,
                 correction_scale=correction_scale, d_max=d_max)

  mu_dt = jnp.dtype(jnp.float32 if mu_dtype is None else mu_dtype)
  eligible = functools.partial(_eligible, stacked=stacked, min_dim=min_dim, max_dim=max_dim)

  def init_fn(params):
    mu, nu, factors = _init(params, exclude, eligible, block_size, graft, mu_dt,
                            offload_statistics, block_major, block_shards)
    return ScaleByShampooState(jnp.zeros([], jnp.int32), mu, nu, factors, Static(spec), hp())

  def update_fn(updates, state, params=None, *, bc_stats: Optional[BCStats] = None, **_):
    del params
    pre = None
    if mode != "std":
      if bc_stats is None or not isinstance(bc_stats.precond, ShampooPrecond):
        raise ValueError(f"scale_by_shampoo(mode={mode!r}) needs bc_stats from "
                         "scaleopt.optim.collect")
      pre = bc_stats.precond
    count, count_inc = state.count, optax.safe_increment(state.count)
    orig_l, td = jax.tree.flatten(updates, is_leaf=_is_masked)
    g_l = [g if _is_masked(g) else g.astype(jnp.float32) for g in orig_l]
    # the statistics' gradient: before a numerator-only clip
    raw_l = td.flatten_up_to(unclipped_numerator(bc_stats, td.unflatten(g_l)))
    mu_l, nu_l = td.flatten_up_to(state.mu), td.flatten_up_to(state.nu)
    keys = sorted(state.factors)
    blk = _blockings(updates, keys, block_size, block_major, block_shards)
    fac = _update_factors(state.factors, raw_l, blk, keys, count, pre, _step_ok(bc_stats),
                          mode=mode, stats_every=stats_every, root_every=root_every, b2=b2,
                          stats_precision=stats_precision, offload=offload_statistics,
                          root_kw=root_kw)
    out_u, out_mu, out_nu = _all_directions(
        orig_l, g_l, raw_l, mu_l, nu_l, fac, blk, count_inc.astype(jnp.float32),
        dict(b1=b1, ab1=ab1, ab2=ab2, eps=eps, graft=graft, update_clip_fro=update_clip_fro,
             matmul_precision=matmul_precision))
    un = lambda l: jax.tree.unflatten(td, l)
    own = lambda x: x if in_host_memory(x) else _on_owner(x)
    fac = {k: ShampooFactors(*map(own, f)) for k, f in fac.items()}
    out_mu = [m if _is_masked(m) else m.astype(mu_dt) for m in out_mu]
    return un(out_u), ScaleByShampooState(count_inc, un(out_mu), un(out_nu), fac, state.spec,
                                          hp())

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def shampoo(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.95,
            eps: float = 1e-8, weight_decay: float = 0.1, *,
            mask: Optional[Union[PyTree, Callable[[PyTree], PyTree]]] = None,
            **kwargs) -> optax.GradientTransformationExtraArgs:
  """Shampoo with decoupled weight decay: theta <- theta (1 - lr wd) - lr U.

  Grafted to Adam's per-block norm by default (AdamW's learning rate applies); ``kwargs`` are
  ``scale_by_shampoo``'s (unknown names raise ``TypeError``).
  """
  return optax.chain(scale_by_shampoo(b1, b2, eps, **kwargs),
                     optax.add_decayed_weights(weight_decay, mask),
                     optax.scale_by_learning_rate(learning_rate))


def shampoo_bc(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.95,
               eps: float = 1e-8, weight_decay: float = 0.1, *, mode: str = "full",
               **kwargs) -> optax.GradientTransformationExtraArgs:
  """``shampoo`` with ``mode="full"`` (cross-fit + eigenvalue-variance correction) by default."""
  return shampoo(learning_rate, b1, b2, eps, weight_decay, mode=mode, **kwargs)
