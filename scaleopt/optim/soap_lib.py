"""SOAP (Vyas et al. 2024, arXiv 2409.11321): Adam run in the eigenbasis of Shampoo's factors.

For every matrix G (2-D, or a stack of matrices along leading axes; optionally cut into
Shampoo's blocks, ``shampoo_lib.blocking``), with factor L for a side of at most
``max_precond_dim`` (the other side, and both for 1-D tensors and ``exclude``d ones, keep the
identity: one-sided SOAP, and plain Adam when neither side has a factor). At call c = 0, 1, ...:

    c = 0:  L <- sb L + (1 - sb) G G^T,  R alike;  Q_L, Q_R = eigenvectors of L, R
            (eigenvalues descending); no update (m, v stay 0; the first gradient only
            builds the basis, so the projection never uses the gradient it projects)
    c >= 1: m <- b1 m + (1 - b1) G                        (original space)
            G' = Q_L^T G Q_R,  M' = Q_L^T m Q_R           (rotated)
            v <- b2 v + (1 - b2) G' * G'                   (rotated basis, per coordinate)
            U = Q_L [M' / (sqrt(v) + eps)] Q_R^T * sqrt(1 - b2^c) / (1 - b1^c)
            L <- sb L + (1 - sb) G G^T,  R alike           (after U: G is not in its own basis)
            every ``precondition_frequency`` calls (c % f == 0): one power-iteration step
              e = diag(Q^T L Q);  order columns of Q (and v's axis) by e descending;
              Q <- qr(L Q)

``soap`` then applies decoupled weight decay and the learning rate (optax chain). Paper
defaults: b1 = b2 = 0.95, sb = b2, eps 1e-8, f = 10, max_precond_dim 10000, no grafting.
Details from the authors' code (github.com/nikhilvyas/SOAP): the skipped first step, eigh for
the first basis and QR power iteration after, the descending sort that permutes v, v kept
(not rotated) across basis changes, the bias correction sqrt(1 - b2^c) / (1 - b1^c) applied
outside eps. The authors keep m in the rotated basis and rotate it back and forth on every
change of basis; m kept in the original space is the same momentum (Q is orthogonal) with
two matmuls less per step.

SOAP-BC (``mode="cf"``/``"full"``, alias ``soap_bc``): the rotated second moment with the
cross-fit and Jensen correction of AdamW-BC per rotated coordinate, from leave-one-out folds
(``soap_fold_fn``, the collector's fold protocol) or A/B groups (``cf``). See
docs/optim_soap.md.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from scaleopt.optim.collect import (BCStats, CollectorSpec, StateHooks, Static,
                                    check_numerator, register_bc_state)
from scaleopt.optim.shampoo_lib import (PRECISIONS, batched_by_size, blocking, eigh_damped,
                                        from_blocks, major_dims, on_owner, to_blocks)
from scaleopt.optim.tree_utils import check_choice, is_masked

PyTree = Any


class SoapFactors(NamedTuple):
  """Blocked factors and their eigenbases of one tensor, (n_blocks, s, s) each; None for a
  side without a factor."""
  L: Optional[jax.Array]
  R: Optional[jax.Array]
  QL: Optional[jax.Array]
  QR: Optional[jax.Array]


class ScaleBySoapState(NamedTuple):
  """count (calls so far); mu: momentum in the original space; nu: Adam second moment in the
  rotated basis (blocked (n_blocks, bs1, bs2) for tensors with a factor); factors:
  {str(leaf index): SoapFactors}; plan: ``Static`` (matmul precision, ((leaf index, (Blocking,
  use_L, use_R)), ...)); spec: the ``CollectorSpec`` (static); hp: b1, b2, eps as arrays (the
  collector's leave-one-out folds)."""
  count: jax.Array
  mu: PyTree
  nu: PyTree
  factors: dict
  plan: Static
  spec: Static
  hp: dict


def _plan(tree, exclude, max_dim, block_size, block_major, block_shards) -> dict:
  """{str(i): (Blocking, use_L, use_R)} of the flattened leaves that get a factor: rank >= 2
  (a rank-2 tensor whose first dim is a stack size of a rank >= 3 tensor is a stack of
  vectors), not excluded, with a side of at most ``max_dim``."""
  leaves, td = jax.tree.flatten(tree, is_leaf=is_masked)
  excl = ([False] * len(leaves) if exclude is None else
          td.flatten_up_to(exclude(tree) if callable(exclude) else exclude))
  stacks = {x.shape[0] for x in leaves if not is_masked(x) and x.ndim >= 3}
  dims = major_dims(tree, block_major)
  out = {}
  for i, x in enumerate(leaves):
    if is_masked(x) or excl[i] or x.ndim < 2 or (x.ndim == 2 and x.shape[0] in stacks):
      continue
    use = (x.shape[-2] <= max_dim, x.shape[-1] <= max_dim)
    if any(use):
      bs = block_size or max(x.shape[-2:])
      out[str(i)] = (blocking(x.shape, bs, dims[i], block_shards), *use)
  return out


def _rot(x, f: SoapFactors, back: bool, precision):
  """Q_L^T x Q_R (``back``: Q_L x Q_R^T) over blocks (n, bs1, bs2), skipping absent sides."""
  if f.QL is not None:
    x = jnp.einsum("nij,nik->njk" if not back else "nji,nik->njk", f.QL, x,
                   precision=precision)
  if f.QR is not None:
    x = jnp.einsum("nij,njk->nik" if not back else "nij,nkj->nik", x, f.QR,
                   precision=precision)
  return x


def _ema_factors(f: SoapFactors, gb, sb, precision) -> SoapFactors:
  """L <- sb L + (1 - sb) G G^T and R <- sb R + (1 - sb) G^T G for the sides present."""
  ema = lambda a, s: None if a is None else sb * a + (1 - sb) * s
  gg = lambda eq: jnp.einsum(eq, gb, gb, precision=precision)
  return f._replace(L=ema(f.L, None if f.L is None else gg("nij,nkj->nik")),
                    R=ema(f.R, None if f.R is None else gg("nji,njk->nik")))


def _sorted_power_step(fac: dict, nu: dict, precision) -> tuple[dict, dict]:
  """Every side: order Q's columns (and v's axis) by diag(Q^T L Q) descending, then
  Q <- qr(L Q) (batched over blocks and tensors)."""
  mats, nu = {}, dict(nu)
  for k, f in fac.items():
    for side, (a, q, ax) in (("L", (f.L, f.QL, 1)), ("R", (f.R, f.QR, 2))):
      if a is None:
        continue
      aq = jnp.matmul(a, q, precision=precision)
      idx = jnp.argsort(-jnp.sum(q * aq, axis=1), axis=-1)  # (n, s), stable
      mats[(k, side)] = jnp.take_along_axis(aq, idx[:, None, :], axis=2)
      nu[k] = jnp.take_along_axis(nu[k], jnp.expand_dims(idx, 3 - ax), axis=ax)
  qs = batched_by_size(mats, qr_basis)
  return _with_bases(fac, qs), nu


def qr_basis(x_Bxsxs: jax.Array) -> jax.Array:
  """Q of each matrix's QR factorization (``jnp.linalg.qr``), in calls of at most
  ``s // 129`` matrices each (one call for all when s <= 128).

  jaxlib's GPU QR takes cuBLAS's batched kernel, which is written for small matrices, for any
  call of B > 1 matrices with s // B <= 128, and is slow on a model's large bases stacked into
  one call. With at most s // 129 per call
  every call stays on cuSOLVER's kernel for one matrix at a time (under an outer ``vmap`` a
  call holds that many times more)."""
  s = x_Bxsxs.shape[-1]
  if s <= 128:
    return jnp.linalg.qr(x_Bxsxs)[0]
  return jax.lax.map(lambda x: jnp.linalg.qr(x)[0], x_Bxsxs, batch_size=max(1, s // 129))


def _first_bases(fac: dict) -> dict:
  """Eigenvectors of every L, R, eigenvalues descending."""
  mats = {(k, s): a for k, f in fac.items() for s, a in (("L", f.L), ("R", f.R))
          if a is not None}
  qs = batched_by_size(mats, lambda x: jnp.flip(eigh_damped(x, 0.0, 0.0)[1], -1))
  return _with_bases(fac, qs)


def _with_bases(fac, qs):
  return {k: f._replace(QL=qs.get((k, "L"), f.QL), QR=qs.get((k, "R"), f.QR))
          for k, f in fac.items()}


def _init_leaf(x, p):
  """(mu, nu, factors or None) of one leaf with plan entry ``p`` (None: no factor)."""
  if is_masked(x):
    return x, x, None
  mu = jnp.zeros(x.shape, jnp.float32)
  if p is None:
    return mu, jnp.zeros(x.shape, jnp.float32), None
  blk, use_l, use_r = p
  n = math.prod(x.shape[:-2]) * blk.nb1 * blk.nb2
  z = lambda s: on_owner(jnp.zeros((n, s, s), jnp.float32))
  l, r = (z(blk.bs1) if use_l else None), (z(blk.bs2) if use_r else None)
  nu = on_owner(jnp.zeros((n, blk.bs1, blk.bs2), jnp.float32))
  return mu, nu, SoapFactors(l, r, l, r)


def _fwd(x, f, blk, precision):
  """x rotated into its tensor's basis (blocked), or x itself without a factor."""
  return x if f is None else _rot(to_blocks(x, blk), f, False, precision)


def _eps_hat(eps, bc2):
  """SOAP's eps outside the bias correction, as an eps next to sqrt(v_hat):
  m/(sqrt(v) + eps) sqrt(bc2)/bc1 = m_hat/(sqrt(v_hat) + eps/sqrt(bc2))."""
  return eps / jnp.sqrt(bc2)


def _direction(g, m, v, f, blk, c, hp, form):
  """(U, m, v) of one leaf at call c >= 1. ``form``: ("std",) SOAP; ("ab", g_B): v from group
  B's rotated mean; ("loo", first, third, var): the leave-one-out fold statistics."""
  prec = hp["precision"]
  m = hp["b1"] * m + (1 - hp["b1"]) * g
  bc1, bc2 = 1 - hp["b1"] ** c, 1 - hp["b2"] ** c
  x = jnp.square(_fwd(form[1] if form[0] == "ab" else g, f, blk, prec))
  v = hp["b2"] * v + (1 - hp["b2"]) * x
  std = lambda: (_fwd(m, f, blk, prec) / bc1) / (jnp.sqrt(v / bc2) + _eps_hat(hp["eps"], bc2))
  if form[0] == "loo":
    _, first, third, var = form
    u = first
    if hp["correct"]:
      u = first - hp["correction_scale"] * var * third
      u = jnp.where(jnp.sign(u) != jnp.sign(first), 0.0, u)
    if hp["std_warmup_steps"]:  # SOAP's own update on calls 1..K
      u = jnp.where(c <= hp["std_warmup_steps"], std(), u)
  else:
    u = std()
  if f is not None:
    u = from_blocks(_rot(u, f, True, prec), g.shape, blk)
  return u, m, v


def soap_fold_fn(state: ScaleBySoapState, hp: dict, g_full, m) -> Callable:
  """Leave-one-out fold terms in the rotated basis (the AdamW-BC folds of docs/optim.md per
  rotated coordinate; the basis Q is the state's, built from earlier steps). For fold r with
  G'_{-r} = (m G'_full - G'_r) / (m - 1), primes rotated (Q_L^T . Q_R):

      m_hat_r = (b1 Q_L^T mu Q_R + (1 - b1) G'_r) / (1 - b1^t)
      d_r     = sqrt((b2 v + (1 - b2) G'_{-r}^2) / (1 - b2^t)) + eps / sqrt(1 - b2^t)

  returns ({"first": m_hat_r / d_r, "third": m_hat_r / d_r^3}, d_r) in the rotated (blocked)
  shapes; t = max(count, 1) (the call-0 update is discarded). mu and G_full are rotated once
  here, so that each of the m folds rotates only its own G_r."""
  prec, plan = state.plan.value
  plan = dict(plan)
  t = jnp.maximum(state.count, 1).astype(jnp.float32)
  b1, b2 = hp["b1"], hp["b2"]
  bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
  mu_l, td = jax.tree.flatten(state.mu, is_leaf=is_masked)
  nu_l = td.flatten_up_to(state.nu)
  rot = lambda x, i: _fwd(x, state.factors.get(str(i)), plan.get(str(i), (None,))[0], prec)
  live = [not is_masked(x) for x in mu_l]
  mu_r = [rot(x, i) if ok else None for i, (x, ok) in enumerate(zip(mu_l, live))]
  gf_r = [rot(x, i) if ok else None for i, (x, ok) in enumerate(zip(td.flatten_up_to(g_full),
                                                                      live))]

  def fold(g_r):
    out = []
    for i, gr in enumerate(td.flatten_up_to(g_r)):
      if not live[i]:
        z = jnp.zeros((), jnp.float32)
        out.append((z, z, z))
        continue
      gr = rot(gr, i)
      g_mr = (m * gf_r[i] - gr) / (m - 1)
      m_hat = (b1 * mu_r[i] + (1 - b1) * gr) / bc1
      d = jnp.sqrt(jnp.maximum((b2 * nu_l[i] + (1 - b2) * g_mr * g_mr) / bc2, 0.0))
      d = d + _eps_hat(hp["eps"], bc2)
      out.append((m_hat / d, m_hat / (d * d * d), d))
    un = lambda j: td.unflatten([o[j] for o in out])
    return {"first": un(0), "third": un(1)}, un(2)

  return fold


register_bc_state(ScaleBySoapState, StateHooks(fold_fn=soap_fold_fn))


MODES = ("std", "cf", "full")
CROSSFITS = ("loo", "ab")


def _collector_spec(mode, crossfit) -> CollectorSpec:
  """std: no statistics; cf/full with loo: the folds (stateful); ab (cf only): groups A, B."""
  if mode == "std":
    return CollectorSpec(layout=None)
  if crossfit == "ab":
    return CollectorSpec(layout="ab")
  return CollectorSpec(layout="loo", stateful=True)


def _forms(mode, crossfit, stats: Optional[BCStats], td):
  """Per leaf, the ``form`` of ``_direction``, and the gradient that feeds the factors."""
  if mode == "std":
    return [("std",)] * td.num_leaves, None
  if stats is None:
    raise ValueError(f"scale_by_soap(mode={mode!r}) needs bc_stats from scaleopt.optim.collect")
  if crossfit == "ab":
    return [("ab", b) for b in td.flatten_up_to(stats.b.mean)], stats.full
  if stats.loo is None:
    raise ValueError("crossfit='loo' needs bc_stats from the 'loo' layout")
  loo = stats.loo
  loo_terms = [td.flatten_up_to(x) for x in (loo.mean["first"], loo.mean["third"], loo.var)]
  return [("loo", *x) for x in zip(*loo_terms)], None


def _check_options(precision, mode, crossfit, std_warmup_steps, **positive):
  """One-line errors for ``scale_by_soap``'s options (``positive``: integers >= 1)."""
  check_choice("matmul_precision", precision, PRECISIONS)
  check_choice("mode", mode, MODES)
  check_choice("crossfit", crossfit, CROSSFITS)
  if mode == "full" and crossfit == "ab":
    raise ValueError("mode='full' with crossfit='ab' needs the variance of rotated group means, "
                     "which the collector does not provide; use crossfit='loo' or mode='cf'")
  for name, v in positive.items():
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
      raise ValueError(f"{name}={v!r} must be an integer >= 1")
  w = std_warmup_steps
  if not isinstance(w, int) or isinstance(w, bool) or w < 0:
    raise ValueError(f"std_warmup_steps={w!r} must be an integer >= 0")
  if w and (mode == "std" or crossfit != "loo"):
    raise ValueError(f"std_warmup_steps={w} applies to the leave-one-out forms (mode 'cf' or "
                     f"'full' with crossfit 'loo'); this one is mode={mode!r}, "
                     f"crossfit={crossfit!r}")


def scale_by_soap(
    b1: float = 0.95,
    b2: float = 0.95,
    eps: float = 1e-8,
    *,
    shampoo_beta: Optional[float] = None,
    precondition_frequency: int = 10,
    max_precond_dim: int = 10000,
    block_size: Optional[int] = None,
    exclude: Optional[Union[PyTree, Callable[[PyTree], PyTree]]] = None,
    block_major: Union[None, str, Callable[[PyTree], PyTree]] = None,
    block_shards: int = 1,
    matmul_precision: str = "highest",
    mode: str = "std",
    crossfit: str = "loo",
    correction_scale: float = 1.0,
    std_warmup_steps: int = 0,
) -> optax.GradientTransformationExtraArgs:
  """SOAP's scaling (module docstring); learning rate and weight decay come after it (``soap``).

  ``update(g, state, params, *, bc_stats=None)``: ``mode="std"`` is SOAP and needs no
  ``bc_stats``; ``cf``/``full`` read them from ``scaleopt.optim.collect`` (docs/optim_soap.md,
  SOAP-BC).

  Args:
    b1, b2, eps: Adam's rates and epsilon in the rotated basis.
    shampoo_beta: the factors' EMA rate sb (None: b2, the paper's choice).
    precondition_frequency: calls between eigenbasis updates (QR power iteration).
    max_precond_dim: a side longer than this keeps the identity (one-sided SOAP).
    block_size: None (the paper's form: one factor per side of the whole matrix) or cut both
      dims into Shampoo's blocks of at most this size (``shampoo_lib.blocking``), one basis
      per block: cheaper decompositions for large matrices.
    exclude: pytree of bools or callable params -> pytree; True keeps a tensor on plain Adam
      (SOAP's update with no factor).
    block_major, block_shards: the block order and per-shard cut of ``scale_by_shampoo``:
      under FSDP blocks lie on the device that holds their rows.
    matmul_precision: precision of the rotations and factor statistics (``PRECISIONS``);
      "highest" is float32 as in the authors' code.
    mode: ``std`` (SOAP), ``cf`` (cross-fit: the rotated second moment from other
      microbatches than the numerator) or ``full`` (cross-fit and the Jensen correction per
      rotated coordinate; leave-one-out only).
    crossfit: ``loo`` (leave-one-out folds; m, v from the full batch) or ``ab`` (m from group
      A, v from group B's rotated mean; ``cf`` only).
    correction_scale: multiplies the subtracted Var_r(d_r) m_hat_r / d_r^3 term (``full``).
    std_warmup_steps: K > 0 takes SOAP's own update (the full batch's) on the first K updates
      (calls 1..K; call 0 only builds the basis) of a ``cf``/``full`` LOO form, while v
      accumulates; the folds' statistics are still collected on those steps, and SOAP's
      update is computed on every step (one more rotation of the momentum per step).
  """
  _check_options(matmul_precision, mode, crossfit, std_warmup_steps,
                 precondition_frequency=precondition_frequency,
                 max_precond_dim=max_precond_dim, block_shards=block_shards,
                 block_size=1 if block_size is None else block_size)
  sb = b2 if shampoo_beta is None else shampoo_beta
  hp = dict(b1=b1, b2=b2, eps=eps, precision=matmul_precision, correct=mode == "full",
            correction_scale=correction_scale, std_warmup_steps=std_warmup_steps)
  spec = _collector_spec(mode, crossfit)
  hp_arrays = lambda: {k: jnp.asarray(hp[k], jnp.float32) for k in ("b1", "b2", "eps")}
  plan_of = functools.partial(_plan, exclude=exclude, max_dim=max_precond_dim,
                              block_size=block_size, block_major=block_major,
                              block_shards=block_shards)
  static = lambda plan: Static((matmul_precision, tuple(sorted(plan.items()))))

  def init_fn(params):
    plan = plan_of(params)
    leaves, td = jax.tree.flatten(params, is_leaf=is_masked)
    out = [_init_leaf(x, plan.get(str(i))) for i, x in enumerate(leaves)]
    fac = {str(i): o[2] for i, o in enumerate(out) if o[2] is not None}
    return ScaleBySoapState(jnp.zeros([], jnp.int32), td.unflatten([o[0] for o in out]),
                            td.unflatten([o[1] for o in out]), fac, static(plan),
                            Static(spec), hp_arrays())

  def update_fn(updates, state, params=None, *, bc_stats: Optional[BCStats] = None, **_):
    del params
    if mode != "std":
      check_numerator(updates, bc_stats, f"scale_by_soap(mode={mode!r})")
    plan = plan_of(updates)
    g_l, td = jax.tree.flatten(updates, is_leaf=is_masked)
    forms, stat_g = _forms(mode, crossfit, bc_stats, td)
    stat_l = g_l if stat_g is None else td.flatten_up_to(stat_g)
    m_l, v_l = td.flatten_up_to(state.mu), td.flatten_up_to(state.nu)
    c = state.count
    u_l, m_new, v_new = list(g_l), list(m_l), {}
    for i, g in enumerate(g_l):
      if is_masked(g):
        continue
      k = str(i)
      f, blk = state.factors.get(k), plan.get(k, (None,))[0]
      u, m, v = _direction(g.astype(jnp.float32), m_l[i], v_l[i], f, blk,
                           c.astype(jnp.float32), hp, forms[i])
      first = c == 0  # the first call only builds the basis
      u_l[i] = jnp.where(first, 0.0, u).astype(g.dtype)
      m_new[i], v_new[k] = jnp.where(first, m_l[i], m), jnp.where(first, v_l[i], v)
    fac = {k: _ema_factors(f, to_blocks(stat_l[int(k)].astype(jnp.float32), plan[k][0]), sb,
                           matmul_precision) for k, f in state.factors.items()}
    fac, nu_fac = _refresh(c, fac, {k: v_new[k] for k in fac}, precondition_frequency,
                           matmul_precision)
    v_new.update(nu_fac)
    v_l = [v_l[i] if is_masked(g) else v_new[str(i)] for i, g in enumerate(g_l)]
    return (td.unflatten(u_l),
            state._replace(count=optax.safe_increment(c), mu=td.unflatten(m_new),
                           nu=td.unflatten(v_l), factors=fac, hp=hp_arrays()))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _refresh(c, fac, nu, every, precision):
  """On due calls: the first bases (c = 0) or a sorted power step; factors kept on their
  owners.

  A device branch (``lax.cond``), not one of ``phases``' host-picked programs: SOAP compiles
  one program with device branches, never one program per outcome (docs/optim_soap.md,
  "On GPUs", says why)."""
  def refresh(fac, nu):
    return jax.lax.cond(c == 0, lambda: (_first_bases(fac), nu),
                        lambda: _sorted_power_step(fac, nu, precision))

  fac, nu = jax.lax.cond(c % every == 0, refresh, lambda fac, nu: (fac, nu), fac, nu)
  own = lambda a: None if a is None else on_owner(a)
  return {k: SoapFactors(*map(own, f)) for k, f in fac.items()}, nu


def soap(learning_rate: optax.ScalarOrSchedule = 3e-3, b1: float = 0.95, b2: float = 0.95,
         eps: float = 1e-8, weight_decay: float = 0.01, *,
         mask: Optional[Union[PyTree, Callable[[PyTree], PyTree]]] = None,
         **kwargs) -> optax.GradientTransformationExtraArgs:
  """SOAP with decoupled weight decay, theta <- theta (1 - lr wd) - lr U (the paper's
  defaults: lr 3e-3, betas (0.95, 0.95), wd 0.01); ``kwargs``: ``scale_by_soap``'s."""
  return optax.chain(scale_by_soap(b1, b2, eps, **kwargs),
                     optax.add_decayed_weights(weight_decay, mask),
                     optax.scale_by_learning_rate(learning_rate))


def soap_bc(learning_rate: optax.ScalarOrSchedule = 3e-3, b1: float = 0.95, b2: float = 0.95,
            eps: float = 1e-8, weight_decay: float = 0.01, *, mode: str = "full",
            **kwargs) -> optax.GradientTransformationExtraArgs:
  """``soap`` with ``mode="full"`` (leave-one-out cross-fit and the Jensen correction in the
  rotated basis) by default."""
  return soap(learning_rate, b1, b2, eps, weight_decay, mode=mode, **kwargs)
