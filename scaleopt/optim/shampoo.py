"""Shampoo (Gupta et al. 2018; Anil et al. 2020) with the bias corrections of Nayak et al.

For every eligible matrix W (2-D, or a stack of matrices along leading axes as in scanned
models; min(d1, d2) >= ``min_dim``, max(d1, d2) <= ``max_dim``, not excluded) cut into blocks G_b of at most ``block_size`` x ``block_size`` (dims are split into
equal blocks, padded with zeros when needed, so every block of a tensor has one shape):

    L_b <- b2 L_b + (1 - b2) G_b G_b^T,   R_b <- b2 R_b + (1 - b2) G_b^T G_b   (every stats_every)
    L_b + lambda I = Q diag(lam) Q^T,  lam <- max(lam, eig_floor_ratio * lambda)  (every root_every)
    P_L = Q diag(lam^{-1/4}) Q^T  (P_R alike; cached between root steps)
    M <- b1 M + (1 - b1) g;   U_b = P_L M_b P_R;   theta <- theta (1 - lr wd) - lr U

All blocks of one factor size, across all tensors, are stacked and decomposed by one batched
``jnp.linalg.eigh`` in float32 (or by coupled Newton iterations, ``root_method="newton"``,
batched matmuls) inside ``lax.cond`` on root steps. Other tensors (1-D, embeddings, too large)
take AdamW (same b1, b2, eps; bias-corrected moments). ``graft="adam"`` rescales each block of
U to the Frobenius norm of the Adam direction m_hat / (sqrt(v_hat) + eps) of that block.

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

On steps without a root computation an ``ab`` layout feeds M with all microbatches.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from scaleopt.optim.collect import BCStats, CollectorSpec, refresh_groups, value_and_grad_fn

PyTree = Any
MaskedNode = optax.MaskedNode

MODES = ("std", "cf", "inv", "full")
CROSSFITS = ("ab",)
ROOT_METHODS = ("eigh", "newton")
GRAFTS = ("none", "adam")
STACKED = ("auto", "none")


# ----------------------------------------------------------------------------- blocking

def blocking(shape: tuple[int, ...], block_size: int) -> tuple[int, int, int, int]:
  """(nb1, bs1, nb2, bs2) of the last two dims: dim d is split into nb = ceil(d / block_size)
  blocks of size ceil(d / nb) (the last padded with zeros when nb does not divide d)."""
  out = []
  for d in shape[-2:]:
    nb = max(1, math.ceil(d / block_size))
    out += [nb, math.ceil(d / nb)]
  return tuple(out)


def to_blocks(x: jax.Array, blk) -> jax.Array:
  """(..., d1, d2) -> (n * nb1 * nb2, bs1, bs2), zero-padded; leading dims (stacked layers)
  are a batch of n independent matrices."""
  nb1, bs1, nb2, bs2 = blk
  d1, d2 = x.shape[-2:]
  x = x.reshape(-1, d1, d2)
  x = jnp.pad(x, ((0, 0), (0, nb1 * bs1 - d1), (0, nb2 * bs2 - d2)))
  n = x.shape[0]
  return x.reshape(n, nb1, bs1, nb2, bs2).transpose(0, 1, 3, 2, 4).reshape(
      n * nb1 * nb2, bs1, bs2)


def from_blocks(xb: jax.Array, shape, blk) -> jax.Array:
  """Inverse of ``to_blocks`` (drops the padding)."""
  nb1, bs1, nb2, bs2 = blk
  x = xb.reshape(-1, nb1, nb2, bs1, bs2).transpose(0, 1, 3, 2, 4).reshape(
      -1, nb1 * bs1, nb2 * bs2)
  return x[:, :shape[-2], :shape[-1]].reshape(shape)


def _gram(gb):
  """Per-block G G^T and G^T G (float32, highest precision)."""
  hp = jax.lax.Precision.HIGHEST
  return (jnp.einsum("nij,nkj->nik", gb, gb, precision=hp),
          jnp.einsum("nji,njk->nik", gb, gb, precision=hp))


# ----------------------------------------------------------------------------- roots

def _sym(a):
  return 0.5 * (a + jnp.swapaxes(a, -1, -2))


def eigh_damped(f: jax.Array, damping: float, floor: float):
  """(lam, Q) of f + damping I (batched over leading axes), lam floored at ``floor``."""
  eye = jnp.eye(f.shape[-1], dtype=jnp.float32)
  lam, q = jnp.linalg.eigh(_sym(f.astype(jnp.float32)) + damping * eye)
  return jnp.maximum(lam, floor), q


def root_from_eig(lam, q, var=None, *, correction_scale: float = 1.0, d_max: float = 0.0):
  """Q diag(d) Q^T with d = lam^{-1/4} (minus (5/32) lam^{-9/4} Var when var is given)."""
  d = lam ** -0.25
  if var is not None:
    d = jnp.maximum(d - correction_scale * (5.0 / 32.0) * var * lam ** -2.25, 0.0)
  if d_max > 0:
    d = jnp.minimum(d, d_max)
  hp = jax.lax.Precision.HIGHEST
  return jnp.matmul(q * d[..., None, :], jnp.swapaxes(q, -1, -2), precision=hp)


def newton_inverse_root(f: jax.Array, damping: float, p: int = 4, iters: int = 30):
  """(f + damping I)^{-1/p} by coupled Newton iterations (Higham 2008, eq. 7.18), batched.

  With A scaled by z = (1 + p) / (2 ||A||_F): M_0 = z A, X_0 = z^{1/p} I, and
  T_i = ((p + 1) I - M_i) / p,  X_{i+1} = X_i T_i,  M_{i+1} = T_i^p M_i;  X -> A^{-1/p}.
  Each matrix stops at its smallest error max|M_i - I| seen so far once the error grows
  (float32 round-off makes the iteration diverge on ill-conditioned inputs, as in
  google-research's distributed Shampoo).
  """
  hp = jax.lax.Precision.HIGHEST
  n = f.shape[-1]
  eye = jnp.eye(n, dtype=jnp.float32)
  a = _sym(f.astype(jnp.float32)) + damping * eye
  norm = jnp.sqrt(jnp.sum(a * a, axis=(-2, -1), keepdims=True))
  z = (1.0 + p) / (2.0 * norm)
  m0 = a * z
  x0 = jnp.broadcast_to(eye, a.shape) * z ** (1.0 / p)
  err = lambda m: jnp.max(jnp.abs(m - eye), axis=(-2, -1), keepdims=True)

  def body(_, c):
    x, m, e, done = c
    t = ((p + 1.0) * eye - m) / p
    tp = t
    for _ in range(p - 1):
      tp = jnp.matmul(tp, t, precision=hp)
    x_new, m_new = jnp.matmul(x, t, precision=hp), jnp.matmul(tp, m, precision=hp)
    e_new = err(m_new)
    done = done | ~(e_new < e * 1.2) | ~jnp.isfinite(e_new)
    keep = done
    return (jnp.where(keep, x, x_new), jnp.where(keep, m, m_new), jnp.where(keep, e, e_new),
            done)

  done0 = jnp.zeros(norm.shape, bool)
  x, _, _, _ = jax.lax.fori_loop(0, iters, body, (x0, m0, err(m0), done0))
  return _sym(x)


def _batched_by_size(mats: dict, fn: Callable) -> dict:
  """Applies ``fn`` to every (n_i, s, s) array, batching all arrays of one size s together
  (one concatenation, one batched call, one split per size).

  On CPU the calls run one matrix at a time (``lax.map``) and one size after another
  (``optimization_barrier``): jaxlib's batched CPU LAPACK kernels split a batch over XLA's
  intra-op thread pool and block on it, and two such kernels in flight at once can take every
  pool thread and deadlock (seen with jax 0.10.2 on 2 cores). Accelerators keep the batched call.
  """
  serial = jax.default_backend() == "cpu"
  by_size: dict[int, list] = {}
  for key, a in mats.items():
    by_size.setdefault(a.shape[-1], []).append(key)
  out = {}
  prev = None
  for s, keys in by_size.items():
    arrs = [mats[k] for k in keys]
    sizes = [a.shape[0] for a in arrs]
    x = jnp.concatenate(arrs, axis=0) if len(arrs) > 1 else arrs[0]
    if serial:
      if prev is not None:
        x, _ = jax.lax.optimization_barrier((x, prev))
      res = jax.lax.map(lambda a: jax.tree.map(lambda r: r[0], fn(a[None])), x)
      prev = res
    else:
      res = fn(x)
    offs = [0]
    for n in sizes:
      offs.append(offs[-1] + n)
    for i, k in enumerate(keys):
      out[k] = jax.tree.map(lambda r: r[offs[i]:offs[i + 1]], res)
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
  tensors (indices in the flattened parameter tree)."""
  count: jax.Array
  mu: PyTree
  nu: PyTree
  factors: dict


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


def find_shampoo_state(opt_state: PyTree) -> ScaleByShampooState:
  """The one ``ScaleByShampooState`` inside an optimizer state."""
  found = [x for x in jax.tree.leaves(opt_state,
                                      is_leaf=lambda x: isinstance(x, ScaleByShampooState))
           if isinstance(x, ScaleByShampooState)]
  if len(found) != 1:
    raise ValueError(f"expected exactly one ScaleByShampooState in the optimizer state, found "
                     f"{len(found)}")
  return found[0]


def _is_masked(x):
  return isinstance(x, MaskedNode)


def _check(name, value, allowed):
  if value not in allowed:
    raise ValueError(f"{name}={value!r} is not allowed; choose one of {allowed}")


def _check_int(name, v, lo=1):
  if not isinstance(v, int) or isinstance(v, bool) or v < lo:
    raise ValueError(f"{name}={v!r} must be an integer >= {lo}")


# ----------------------------------------------------------------------------- collector

def shampoo_spec(mode: str = "std", crossfit: str = "ab", rolling_b: bool = False,
                 root_every: int = 10, block_size: int = 1024, damping: float = 1e-6,
                 eig_floor_ratio: float = 1e-3, b2: float = 0.95, **_) -> CollectorSpec:
  """The ``CollectorSpec`` for ``shampoo_collect`` (``std`` needs only the plain collector)."""
  _check("mode", mode, MODES)
  _check("crossfit", crossfit, CROSSFITS)
  _check_int("root_every", root_every)
  _check_int("block_size", block_size)
  if mode == "std":
    return CollectorSpec(layout="all")
  layout = "all" if mode == "inv" else ("rolling_b" if rolling_b else "ab")
  opts = (("two_pass", mode in ("inv", "full")), ("block_size", block_size),
          ("damping", float(damping)), ("eig_floor_ratio", float(eig_floor_ratio)),
          ("b2", float(b2)))
  return CollectorSpec(layout=layout, estimator="shampoo", refresh_every=root_every,
                       estimator_options=opts)


def shampoo_collect(loss_fn, params: PyTree, microbatches: PyTree, spec: CollectorSpec, *,
                    opt_state: PyTree, b_microbatches: PyTree = None) -> BCStats:
  """Numerator gradient plus, on root steps (count % root_every == 0, inside ``lax.cond``),
  the B-side factor statistics and (``inv``/``full``) the two-pass eigenvalue variances.

  Returns:
    ``BCStats`` whose ``precond`` is a ``ShampooPrecond``.
  """
  opts = dict(spec.estimator_options)
  st = find_shampoo_state(opt_state)
  root = (st.count % spec.refresh_every) == 0
  num, mbs_b = refresh_groups(loss_fn, params, microbatches, spec.layout, root, b_microbatches)
  two_pass = opts["two_pass"]
  m_b = jax.tree.leaves(mbs_b)[0].shape[0]
  if two_pass and m_b < 2:
    raise ValueError(f"the eigenvalue-variance correction needs >= 2 microbatches in group B, "
                     f"got {m_b}")
  keys = sorted(st.factors)
  bs = opts["block_size"]
  grad_fn = value_and_grad_fn(loss_fn)
  b2, damping = opts["b2"], opts["damping"]
  floor = opts["eig_floor_ratio"] * damping

  for k in keys:
    blk = blocking(jax.tree.leaves(params)[int(k)].shape, bs)
    n_mat = math.prod(jax.tree.leaves(params)[int(k)].shape[:-2])
    if st.factors[k].L.shape != (n_mat * blk[0] * blk[2], blk[1], blk[1]):
      raise ValueError("shampoo_collect: the spec's block_size does not match the optimizer "
                       "state; build spec and transform with the same settings")

  def blocks_of(g):
    leaves = jax.tree.leaves(g)
    return {k: to_blocks(leaves[int(k)].astype(jnp.float32),
                         blocking(leaves[int(k)].shape, bs)) for k in keys}

  def run():
    zl = {k: jnp.zeros_like(st.factors[k].L) for k in keys}
    zr = {k: jnp.zeros_like(st.factors[k].R) for k in keys}

    def pass1(c, mb):
      gb = blocks_of(grad_fn(params, mb)[2])
      sl, sr = c
      grams = {k: _gram(gb[k]) for k in keys}
      return ({k: sl[k] + grams[k][0] for k in keys},
              {k: sr[k] + grams[k][1] for k in keys}), None

    (sl, sr), _ = jax.lax.scan(pass1, (zl, zr), mbs_b)
    sl = {k: v / m_b for k, v in sl.items()}
    sr = {k: v / m_b for k, v in sr.items()}
    if not two_pass:
      return ShampooPrecond(sl, sr, None, None, None, None, root)
    new_l = {k: b2 * st.factors[k].L + (1 - b2) * sl[k] for k in keys}
    new_r = {k: b2 * st.factors[k].R + (1 - b2) * sr[k] for k in keys}
    eig = _batched_by_size({**{("L", k): v for k, v in new_l.items()},
                            **{("R", k): v for k, v in new_r.items()}},
                           lambda f: eigh_damped(f, damping, floor))
    eig_l = {k: eig[("L", k)] for k in keys}
    eig_r = {k: eig[("R", k)] for k in keys}
    hp = jax.lax.Precision.HIGHEST

    def proj(gb):
      # ||(Q_L^T G)_{k,:}||^2 and ||(G Q_R)_{:,k}||^2 per block
      pl = {k: jnp.sum(jnp.einsum("nik,nij->nkj", eig_l[k][1], gb[k], precision=hp) ** 2, -1)
            for k in keys}
      pr = {k: jnp.sum(jnp.einsum("nij,njk->nik", gb[k], eig_r[k][1], precision=hp) ** 2, -2)
            for k in keys}
      return pl, pr

    z = proj({k: jnp.zeros((st.factors[k].L.shape[0], st.factors[k].L.shape[1],
                            st.factors[k].R.shape[1]), jnp.float32) for k in keys})
    carry0 = (jnp.zeros((), jnp.float32), z, z)

    def pass2(c, mb):
      n, mean, m2 = c
      x = proj(blocks_of(grad_fn(params, mb)[2]))
      n = n + 1.0
      delta = jax.tree.map(lambda a, b: a - b, x, mean)
      mean = jax.tree.map(lambda a, d: a + d / n, mean, delta)
      m2 = jax.tree.map(lambda s, d, a, mu: s + d * (a - mu), m2, delta, x, mean)
      return (n, mean, m2), None

    (_, _, m2), _ = jax.lax.scan(pass2, carry0, mbs_b)
    den = (1 - b2) ** 2 / (m_b * (m_b - 1))
    var_l = {k: jnp.maximum(m2[0][k] * den, 0.0) for k in keys}
    var_r = {k: jnp.maximum(m2[1][k] * den, 0.0) for k in keys}
    return ShampooPrecond(sl, sr, eig_l, eig_r, var_l, var_r, root)

  def skip():
    return jax.tree.map(jnp.zeros_like, jax.eval_shape(run))

  pre = jax.lax.cond(root, run, skip)
  return num._replace(precond=pre)


# ----------------------------------------------------------------------------- transform

def scale_by_shampoo(
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    *,
    block_size: int = 1024,
    max_dim: int = 8192,
    min_dim: int = 2,
    stats_every: int = 1,
    root_every: int = 10,
    damping: float = 1e-6,
    eig_floor_ratio: float = 1e-3,
    root_method: str = "eigh",
    newton_iters: int = 30,
    graft: str = "none",
    adam_b2: Optional[float] = None,
    update_clip_fro: float = 0.0,
    d_max: float = 0.0,
    exclude: Optional[Union[PyTree, Callable[[PyTree], PyTree]]] = None,
    stacked: str = "auto",
    mode: str = "std",
    correction_scale: float = 1.0,
    **_spec_only,
) -> optax.GradientTransformationExtraArgs:
  """Shampoo's scaling with an AdamW fallback; see the module docstring.

  ``update(g, state, params, *, bc_stats=None)``: ``std`` works on the gradient alone (factor
  statistics from the numerator, G G^T of the step's mean gradient); ``cf``/``inv``/``full``
  need ``bc_stats`` from ``shampoo_collect``.

  Args:
    b1: momentum (M, and Adam's first moment on fallback tensors).
    b2: factor EMA rate (and Adam's b2 unless ``adam_b2`` is given).
    eps: Adam's epsilon (fallback and grafting).
    block_size, max_dim, min_dim: blocking and eligibility (see module docstring).
    stats_every, root_every: statistics and root frequencies (BC modes take statistics on root
      steps only, from group B).
    damping, eig_floor_ratio: lambda and the eigenvalue floor eig_floor_ratio * lambda.
    root_method: ``eigh`` (float32) or ``newton`` (coupled Newton, ``newton_iters``; std/cf).
    graft: ``none`` or ``adam`` (per-block Frobenius norm of the Adam direction).
    update_clip_fro: if > 0, scale each preconditioned tensor's U to Frobenius norm <= c.
    d_max: if > 0, clip corrected roots at d_max.
    exclude: pytree of bools or callable params -> pytree; True keeps a matrix on AdamW.
    stacked: how tensors with a leading layer axis (scanned models) are read. ``auto``: a
      tensor of rank >= 3 is a stack of matrices (its last two dims), and a rank-2 tensor
      whose first dim equals the leading dim of a rank >= 3 tensor of the tree is a stack of
      vectors (AdamW); ``none``: only rank-2 tensors are matrices.
    mode: ``std|cf|inv|full``.
    correction_scale: multiplies the (5/32) lam^{-9/4} Var term.
  """
  _check("mode", mode, MODES)
  _check("root_method", root_method, ROOT_METHODS)
  _check("graft", graft, GRAFTS)
  _check("stacked", stacked, STACKED)
  for n, v in (("block_size", block_size), ("stats_every", stats_every),
               ("root_every", root_every), ("max_dim", max_dim), ("newton_iters", newton_iters)):
    _check_int(n, v)
  if mode in ("inv", "full") and root_method != "eigh":
    raise ValueError(f"mode={mode!r} corrects eigenvalues; root_method must be 'eigh'")
  if not damping > 0:
    raise ValueError(f"damping={damping!r} must be > 0")
  ab2 = b2 if adam_b2 is None else adam_b2
  floor = eig_floor_ratio * damping

  def eligible(x, excl, stack_sizes) -> bool:
    nd = jnp.ndim(x)
    if excl or nd < 2 or (nd > 2 and stacked == "none"):
      return False
    if nd == 2 and stacked == "auto" and x.shape[0] in stack_sizes:
      return False  # a stack of vectors (e.g. per-layer norm scales)
    return min(x.shape[-2:]) >= min_dim and max(x.shape[-2:]) <= max_dim

  def init_fn(params):
    leaves, td = jax.tree.flatten(params, is_leaf=_is_masked)
    if exclude is None:
      excl = [False] * len(leaves)
    else:
      ex = exclude(params) if callable(exclude) else exclude
      excl = [bool(e) for e in td.flatten_up_to(ex)]
    factors, nu = {}, []
    stack_sizes = {p.shape[0] for p in leaves if not _is_masked(p) and jnp.ndim(p) >= 3}
    for i, (p, e) in enumerate(zip(leaves, excl)):
      if _is_masked(p):
        nu.append(p)
        continue
      ok = eligible(p, e, stack_sizes)
      if ok:
        nb1, bs1, nb2, bs2 = blocking(p.shape, block_size)
        n = math.prod(p.shape[:-2]) * nb1 * nb2
        eye = lambda s: jnp.broadcast_to(jnp.eye(s, dtype=jnp.float32), (n, s, s))
        factors[str(i)] = ShampooFactors(L=jnp.zeros((n, bs1, bs1), jnp.float32),
                                    R=jnp.zeros((n, bs2, bs2), jnp.float32),
                                    PL=eye(bs1), PR=eye(bs2))
      need_nu = (not ok) or graft == "adam"
      nu.append(jnp.zeros(jnp.shape(p), jnp.float32) if need_nu else jnp.zeros((), jnp.float32))
    mu = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    return ScaleByShampooState(count=jnp.zeros([], jnp.int32), mu=mu,
                               nu=jax.tree.unflatten(td, nu), factors=factors)

  def roots(fl: dict, fr: dict, eig_l=None, eig_r=None, var_l=None, var_r=None):
    """New P_L, P_R for every factor (batched over blocks and tensors of one size)."""
    if eig_l is not None:
      pl = {k: root_from_eig(*eig_l[k], var_l[k], correction_scale=correction_scale,
                             d_max=d_max) for k in fl}
      pr = {k: root_from_eig(*eig_r[k], var_r[k], correction_scale=correction_scale,
                             d_max=d_max) for k in fr}
      return pl, pr
    mats = {**{("L", k): v for k, v in fl.items()}, **{("R", k): v for k, v in fr.items()}}
    if root_method == "eigh":
      fn = lambda f: root_from_eig(*eigh_damped(f, damping, floor), d_max=d_max)
    else:
      fn = lambda f: newton_inverse_root(f, damping, 4, newton_iters)
    out = _batched_by_size(mats, fn)
    return ({k: out[("L", k)] for k in fl}, {k: out[("R", k)] for k in fr})

  def update_fn(updates, state, params=None, *, bc_stats: Optional[BCStats] = None, **_):
    del params
    pre = None
    if mode != "std":
      if bc_stats is None or not isinstance(bc_stats.precond, ShampooPrecond):
        raise ValueError(f"scale_by_shampoo(mode={mode!r}) needs bc_stats from shampoo_collect")
      pre = bc_stats.precond
    count = state.count
    count_inc = optax.safe_increment(count)
    g_l, td = jax.tree.flatten(updates, is_leaf=_is_masked)
    mu_l, nu_l = td.flatten_up_to(state.mu), td.flatten_up_to(state.nu)
    keys = sorted(state.factors)
    blk = {k: blocking(g_l[int(k)].shape, block_size) for k in keys}
    f32 = lambda x: x.astype(jnp.float32)
    new_mu = [mu if _is_masked(g) else b1 * mu + (1 - b1) * f32(g) for g, mu in zip(g_l, mu_l)]

    # factor statistics
    fac = state.factors
    if mode == "std":
      gb = {k: to_blocks(f32(g_l[int(k)]), blk[k]) for k in keys}

      def stats(f):
        out = {}
        for k in keys:
          l, r = _gram(gb[k])
          out[k] = f[k]._replace(L=b2 * f[k].L + (1 - b2) * l, R=b2 * f[k].R + (1 - b2) * r)
        return out

      fac = jax.lax.cond(count % stats_every == 0, stats, lambda f: f, fac)
      is_root = count % root_every == 0
    else:
      is_root = pre.root

    # inverse roots (root steps only; BC modes first fold in B's statistics)
    def do_roots(f):
      if mode != "std":
        f = {k: f[k]._replace(L=b2 * f[k].L + (1 - b2) * pre.stat_L[k],
                              R=b2 * f[k].R + (1 - b2) * pre.stat_R[k]) for k in keys}
      if mode in ("inv", "full"):
        pl, pr = roots({k: f[k].L for k in keys}, {k: f[k].R for k in keys},
                       pre.eig_L, pre.eig_R, pre.var_L, pre.var_R)
      else:
        pl, pr = roots({k: f[k].L for k in keys}, {k: f[k].R for k in keys})
      # a root that failed (non-finite) keeps the previous one
      ok = lambda new, old: jnp.where(jnp.all(jnp.isfinite(new)), new, old)
      return {k: f[k]._replace(PL=ok(pl[k], f[k].PL), PR=ok(pr[k], f[k].PR)) for k in keys}

    if keys:
      fac = jax.lax.cond(is_root, do_roots, lambda f: f, fac)

    # directions
    t = count_inc.astype(jnp.float32)
    bc1, bc2 = 1.0 - b1 ** t, 1.0 - ab2 ** t
    hp = jax.lax.Precision.HIGHEST
    out_u, out_nu = list(g_l), list(nu_l)
    for i, g in enumerate(g_l):
      if _is_masked(g):
        continue
      mu = new_mu[i]
      k = str(i)
      need_adam = k not in fac or graft == "adam"
      if need_adam:
        nu = ab2 * nu_l[i] + (1 - ab2) * f32(g) ** 2
        out_nu[i] = nu
        adam_dir = (mu / bc1) / (jnp.sqrt(nu / bc2) + eps)
      if k not in fac:
        out_u[i] = adam_dir.astype(g.dtype)
        continue
      f = fac[k]
      mb = to_blocks(mu, blk[k])
      ub = jnp.matmul(jnp.matmul(f.PL, mb, precision=hp), f.PR, precision=hp)
      if graft == "adam":
        ab = to_blocks(adam_dir, blk[k])
        n_u = jnp.sqrt(jnp.sum(ub * ub, axis=(1, 2), keepdims=True))
        n_a = jnp.sqrt(jnp.sum(ab * ab, axis=(1, 2), keepdims=True))
        ub = ub * (n_a / jnp.maximum(n_u, 1e-30))
      u = from_blocks(ub, g.shape, blk[k])
      if update_clip_fro > 0:
        nrm = jnp.sqrt(jnp.sum(u * u))
        u = u * jnp.minimum(1.0, update_clip_fro / jnp.maximum(nrm, 1e-30))
      out_u[i] = u.astype(g.dtype)
    un = lambda l: jax.tree.unflatten(td, l)
    return un(out_u), ScaleByShampooState(count=count_inc, mu=un(new_mu), nu=un(out_nu),
                                          factors=fac)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def shampoo(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.95,
            eps: float = 1e-8, weight_decay: float = 0.1, *,
            mask: Optional[Union[PyTree, Callable[[PyTree], PyTree]]] = None,
            **kwargs) -> optax.GradientTransformationExtraArgs:
  """Shampoo with decoupled weight decay: theta <- theta (1 - lr wd) - lr U."""
  return optax.chain(scale_by_shampoo(b1, b2, eps, **kwargs),
                     optax.add_decayed_weights(weight_decay, mask),
                     optax.scale_by_learning_rate(learning_rate))


def shampoo_bc(learning_rate: optax.ScalarOrSchedule, b1: float = 0.9, b2: float = 0.95,
               eps: float = 1e-8, weight_decay: float = 0.1, *, mode: str = "full",
               **kwargs) -> optax.GradientTransformationExtraArgs:
  """``shampoo`` with ``mode="full"`` (cross-fit + eigenvalue-variance correction) by default."""
  return shampoo(learning_rate, b1, b2, eps, weight_decay, mode=mode, **kwargs)
