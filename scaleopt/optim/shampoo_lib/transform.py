"""``scale_by_shampoo`` and its aliases ``shampoo``, ``shampoo_bc``."""

from __future__ import annotations

import functools
import math
from typing import Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax

from scaleopt.optim.collect import BCStats, Static, check_numerator, unclipped_numerator
from scaleopt.optim.shampoo_lib.blocking import (block_norms, blocking, blockings_of,
                                                 from_blocks, major_dims, to_blocks)
from scaleopt.optim.shampoo_lib.factors import step_is_finite, update_factors
from scaleopt.optim.shampoo_lib.options import validate_options
from scaleopt.optim.shampoo_lib.placement import in_host_memory, on_owner, to_host
from scaleopt.optim.shampoo_lib.state import (PyTree, ScaleByShampooState, ShampooFactors,
                                              ShampooPrecond, no_rules)
from scaleopt.optim.shampoo_lib.statistics import shampoo_collector_spec
from scaleopt.optim.tree_utils import is_masked


def _init(params, exclude, eligible, block_size, graft, mu_dtype, offload, block_major,
          block_shards):
  leaves, td = jax.tree.flatten(params, is_leaf=is_masked)
  dims = major_dims(params, block_major)
  ex = exclude(params) if callable(exclude) else exclude
  excl = [False] * len(leaves) if exclude is None else [bool(e) for e in td.flatten_up_to(ex)]
  stack_sizes = {p.shape[0] for p in leaves if not is_masked(p) and jnp.ndim(p) >= 3}
  factors, nu = {}, []
  for i, (p, e) in enumerate(zip(leaves, excl)):
    if is_masked(p):
      nu.append(p)
      continue
    ok = eligible(p, e, stack_sizes)
    if ok:
      nb1, bs1, nb2, bs2, _ = blocking(p.shape, block_size, dims[i], block_shards)
      n = math.prod(p.shape[:-2]) * nb1 * nb2
      eye = lambda s: jnp.broadcast_to(jnp.eye(s, dtype=jnp.float32), (n, s, s))
      stat = lambda s: jnp.zeros((n, s, s), jnp.float32)
      store = to_host if offload else (lambda x: x)
      factors[str(i)] = ShampooFactors(L=store(stat(bs1)), R=store(stat(bs2)),
                                       PL=eye(bs1), PR=eye(bs2))
    need_nu = (not ok) or graft == "adam"
    nu.append(jnp.zeros(jnp.shape(p), jnp.float32) if need_nu else jnp.zeros((), jnp.float32))
  mu = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), mu_dtype), params)
  return mu, jax.tree.unflatten(td, nu), factors


def _direction(g, mu, nu, f, blk, graft, adam, update_clip_fro, precision):
  """(u, nu) of one tensor: P_L M P_R (matmuls at ``precision``; grafted to the Adam norm per
  block) or Adam."""
  bc1, ab2, bc2, eps = adam
  if f is None or graft == "adam":
    nu = ab2 * nu + (1 - ab2) * g * g
    adam_dir = (mu / bc1) / (jnp.sqrt(nu / bc2) + eps)
  if f is None:
    return adam_dir, nu
  ub = jnp.matmul(jnp.matmul(f.PL, on_owner(to_blocks(mu, blk)), precision=precision), f.PR,
                  precision=precision)
  if graft == "adam":
    n_u = jnp.sqrt(jnp.sum(ub * ub, axis=(1, 2), keepdims=True))
    ub = ub * (block_norms(adam_dir, blk) / jnp.maximum(n_u, 1e-30))
  u = from_blocks(ub, g.shape, blk)
  if update_clip_fro > 0:
    u = u * jnp.minimum(1.0, update_clip_fro / jnp.maximum(jnp.sqrt(jnp.sum(u * u)), 1e-30))
  return u, nu


def _eligible(x, excl, stack_sizes, *, stacked, min_dim, max_dim) -> bool:
  nd = jnp.ndim(x)
  if excl or nd < 2 or (nd > 2 and stacked == "none"):
    return False
  if nd == 2 and stacked == "auto" and x.shape[0] in stack_sizes:
    return False  # a stack of vectors (e.g. per-layer norm scales)
  return min(x.shape[-2:]) >= min_dim and max(x.shape[-2:]) <= max_dim


def _all_directions(orig_l, g_l, unclipped_l, mu_l, nu_l, fac, blk, t, hp):
  """Momentum, Adam second moment and direction of every tensor (flattened lists): matrices
  with factors use b1 and P_L M P_R, fallback tensors adam_b1 and Adam. The momentum takes
  ``g_l``, the Adam second moment ``unclipped_l`` (the gradient before a numerator-only
  clip)."""
  out_u, out_mu, out_nu = list(g_l), list(mu_l), list(nu_l)
  for i, g in enumerate(g_l):
    if is_masked(g):
      continue
    f = fac.get(str(i))
    b1_i = hp["b1"] if f is not None else hp["ab1"]
    out_mu[i] = b1_i * mu_l[i] + (1 - b1_i) * g
    adam = (1.0 - b1_i ** t, hp["ab2"], 1.0 - hp["ab2"] ** t, hp["eps"])
    u, out_nu[i] = _direction(unclipped_l[i], out_mu[i], nu_l[i], f, blk.get(str(i)),
                              hp["graft"], adam, hp["update_clip_fro"], hp["matmul_precision"])
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
  """Shampoo's scaling with an AdamW fallback; see the package docstring.

  ``update(g, state, params, *, bc_stats=None)``: ``std`` works on the gradient alone (factor
  statistics G G^T of the step's mean gradient); ``cf``/``inv``/``full`` need ``bc_stats``
  from ``scaleopt.optim.collect`` (which reads root_every, block_size, b2, damping and
  eig_floor_ratio from this transform's state).

  Args:
    b1: momentum M of preconditioned tensors (and of fallback tensors unless ``adam_b1``).
    b2: factor EMA rate (and Adam's b2 unless ``adam_b2`` is given).
    eps: Adam's epsilon (fallback and grafting).
    block_size, max_dim, min_dim: blocking and eligibility (see the package docstring); a
      smaller block makes the roots and P_L M P_R cheaper (docs/optim.md, Shampoo defaults).
    stats_every, root_every: statistics and root frequencies (BC modes take statistics on root
      steps only, from group B).
    damping, eig_floor_ratio: lambda and the eigenvalue floor eig_floor_ratio * lambda.
    root_method: ``eigh`` (float32), ``newton`` (coupled Newton, at most ``newton_iters``
      iterations; std/cf) or ``auto`` (``resolve_root_method``: Newton on GPU/TPU for std/cf,
      else eigh).
    newton_precision: precision of the coupled Newton matmuls, one of ``PRECISIONS``
      (default ``"high"``: TF32 on NVIDIA GPUs; ``"highest"``: float32, for accurate roots of
      ill-conditioned factors; docs/optim.md, Newton roots: TF32 or float32).
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
  validate_options(root_method=root_method, graft=graft, stacked=stacked, block_size=block_size,
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
    return ScaleByShampooState(jnp.zeros([], jnp.int32), mu, nu, factors, Static(spec), hp(),
                               no_rules())

  def update_fn(updates, state, params=None, *, bc_stats: Optional[BCStats] = None, **_):
    del params
    precond = None
    if mode != "std":
      if bc_stats is None or not isinstance(bc_stats.precond, ShampooPrecond):
        raise ValueError(f"scale_by_shampoo(mode={mode!r}) needs bc_stats from "
                         "scaleopt.optim.collect")
      check_numerator(updates, bc_stats, f"scale_by_shampoo(mode={mode!r})")
      precond = bc_stats.precond
    count, count_inc = state.count, optax.safe_increment(state.count)
    orig_l, td = jax.tree.flatten(updates, is_leaf=is_masked)
    g_l = [g if is_masked(g) else g.astype(jnp.float32) for g in orig_l]
    # the statistics' gradient: before a numerator-only clip
    unclipped_l = td.flatten_up_to(unclipped_numerator(bc_stats, td.unflatten(g_l)))
    mu_l, nu_l = td.flatten_up_to(state.mu), td.flatten_up_to(state.nu)
    keys = sorted(state.factors)
    blk = blockings_of(updates, keys, block_size, block_major, block_shards)
    fac, rules = update_factors(
        state.factors, unclipped_l, blk, keys, count, precond, step_is_finite(bc_stats),
        mode=mode, stats_every=stats_every, root_every=root_every, b2=b2,
        stats_precision=stats_precision, offload=offload_statistics, root_kw=root_kw)
    out_u, out_mu, out_nu = _all_directions(
        orig_l, g_l, unclipped_l, mu_l, nu_l, fac, blk, count_inc.astype(jnp.float32),
        dict(b1=b1, ab1=ab1, ab2=ab2, eps=eps, graft=graft, update_clip_fro=update_clip_fro,
             matmul_precision=matmul_precision))
    un = lambda l: jax.tree.unflatten(td, l)
    own = lambda x: x if in_host_memory(x) else on_owner(x)
    fac = {k: ShampooFactors(*map(own, f)) for k, f in fac.items()}
    out_mu = [m if is_masked(m) else m.astype(mu_dt) for m in out_mu]
    return un(out_u), ScaleByShampooState(count_inc, un(out_mu), un(out_nu), fac, state.spec,
                                          hp(), rules)

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
