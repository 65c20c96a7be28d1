"""Sophia (Liu et al. 2023) with the bias corrections of Nayak et al. (arXiv 2605.20756).

Sophia keeps a momentum m and an EMA h of a diagonal curvature estimate, refreshed every k
steps, and takes a clipped Newton-like step:

    m_t = b1 m_{t-1} + (1 - b1) g                     (every step; no bias correction)
    h_t = b2 h_{t-1} + (1 - b2) h_step                (refresh steps, count % k == 0)
    p_t = rho * s * h_t + eps,     inv_t = 1 / p_t    (cached until the next refresh)
    u_t = clip(m_t * inv_t, -c, c);   theta <- theta (1 - lr wd) - lr u_t

``h_step`` comes from ``sophia_collect`` (``bc_stats.precond``): Gauss-Newton-Bartlett
(Sophia-G) or Hutchinson (Sophia-H), see ``scaleopt.optim.gnb``.

Denominator scale (``denominator_scale``). ``"matched"`` (default): h_step is an unbiased
estimate of the mean per-position Gauss-Newton diagonal in every mode, s = 1:

    std (square of the full mean):      h_step = N * g_bar^2          (N supervised positions)
    cf / inv / full (mean of squares):  h_step = (1/m) sum_j n_j g_j^2

(n_j: positions of microbatch j; ``count_unit="sequences"`` counts sequences instead), so the
std and BC denominators have the same expected size and rho means the same thing in both.
``"reference"``: h_step = g_bar^2 or (1/m) sum_j g_j^2 and s = ``bs`` (the paper's code: bs =
examples per step, which made its BC denominator ~128x larger than std's; notes section 9.4).

Bias correction (``mode``):

* ``cf``: the momentum sees group A's true-label gradient, the curvature group B's sampled-label
  pass (independent examples, so no coupling between m and inv).
* ``inv``: one group; inv_t = max(0, 1/p_t - Var(p_t) / p_t^3) with
  Var(p_t) = (rho s (1 - b2))^2 Var(h_step) and Var(h_step) = Var_j(x_j) / m from the spread of
  the per-microbatch estimates x_j (n_j g_j^2 or z (.) Hz) (delta method for T(p) = 1/p, only
  the noise of the current refresh; the EMA history is treated as fixed).
* ``full``: both (A/B); the variance comes from B only.

The corrected inverse is cached and reused between refreshes. On steps without a refresh an
``ab`` layout feeds the momentum with all microbatches (no curvature is computed, so nothing
couples), see ``sophia_collect``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from scaleopt.optim import gnb
from scaleopt.optim.collect import BCStats, CollectorSpec, refresh_groups

PyTree = Any
MaskedNode = optax.MaskedNode

MODES = ("std", "cf", "inv", "full")
CROSSFITS = ("ab",)
ESTIMATORS = ("gnb", "hutchinson")
DENOMINATOR_SCALES = ("matched", "reference")
COUNT_UNITS = ("tokens", "sequences")
STATISTICS = ("sq_of_mean", "mean_sq")


class SophiaCurvature(NamedTuple):
  """``bc_stats.precond`` for Sophia.

  Attributes:
    h_step: this refresh's curvature estimate (zeros on steps without a refresh).
    var: Var(h_step) from the per-microbatch spread (None when not collected).
    refresh: scalar bool, whether this step refreshes h.
  """
  h_step: PyTree
  var: Optional[PyTree]
  refresh: jax.Array


class ScaleBySophiaState(NamedTuple):
  """count, momentum mu, curvature EMA h and the cached (corrected) inverse, float32."""
  count: jax.Array
  mu: PyTree
  h: PyTree
  inv: PyTree


def _check(name, value, allowed):
  if value not in allowed:
    raise ValueError(f"{name}={value!r} is not allowed; choose one of {allowed}")


def _resolve(mode: str, correction: Optional[str]) -> str:
  _check("mode", mode, MODES)
  if correction is None:
    correction = "delta" if mode in ("inv", "full") else "none"
  _check("correction", correction, ("none", "delta"))
  if mode in ("inv", "full") and correction == "none":
    raise ValueError(f"mode={mode!r} applies the variance correction; correction must be "
                     "'delta' (or use mode='std'/'cf')")
  if mode in ("std", "cf") and correction != "none":
    raise ValueError(f"mode={mode!r} applies no variance correction; correction must be 'none'")
  return correction


def find_sophia_state(opt_state: PyTree) -> ScaleBySophiaState:
  """The one ``ScaleBySophiaState`` inside an optimizer state."""
  found = [x for x in jax.tree.leaves(opt_state,
                                      is_leaf=lambda x: isinstance(x, ScaleBySophiaState))
           if isinstance(x, ScaleBySophiaState)]
  if len(found) != 1:
    raise ValueError(f"expected exactly one ScaleBySophiaState in the optimizer state, found "
                     f"{len(found)}")
  return found[0]


def sophia_spec(mode: str = "std", crossfit: str = "ab", rolling_b: bool = False,
                estimator: str = "gnb", k: int = 10, statistic: Optional[str] = None,
                count_unit: str = "tokens", denominator_scale: str = "matched",
                correction: Optional[str] = None, **_) -> CollectorSpec:
  """The ``CollectorSpec`` for ``sophia_collect`` (extra keyword arguments are ignored so a
  transform's settings can be passed through).

  ``statistic`` (GNB only): ``"sq_of_mean"`` (h_step from the square of the group's mean
  sampled gradient; default for ``std``, Sophia's original) or ``"mean_sq"`` (mean of
  per-microbatch squares; default otherwise, and required by the variance correction).
  """
  correction = _resolve(mode, correction)
  _check("crossfit", crossfit, CROSSFITS)
  _check("estimator", estimator, ESTIMATORS)
  _check("count_unit", count_unit, COUNT_UNITS)
  _check("denominator_scale", denominator_scale, DENOMINATOR_SCALES)
  if not isinstance(k, int) or isinstance(k, bool) or k < 1:
    raise ValueError(f"k={k!r} (Hessian refresh interval) must be an integer >= 1")
  if statistic is None:
    statistic = "sq_of_mean" if mode == "std" else "mean_sq"
  _check("statistic", statistic, STATISTICS)
  if correction != "none" and estimator == "gnb" and statistic != "mean_sq":
    raise ValueError("the variance correction needs statistic='mean_sq' (per-microbatch "
                     "estimates whose spread gives Var(h_step))")
  layout = "all" if mode in ("std", "inv") else ("rolling_b" if rolling_b else "ab")
  weight = count_unit if denominator_scale == "matched" else "none"
  opts = (("statistic", statistic), ("weight", weight), ("need_var", correction != "none"))
  return CollectorSpec(layout=layout, estimator=estimator, refresh_every=k,
                       needs_logits=estimator == "gnb", needs_key=True,
                       estimator_options=opts)


def _zeros(tree):
  return jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), tree)


def _curvature_pass(loss_fn, logits_fn, params, mbs, key, estimator, statistic, weight,
                    need_var):
  """Scan over the curvature group: h_step and Var(h_step) (float32)."""
  m = jax.tree.leaves(mbs)[0].shape[0]
  keys = jax.random.split(key, m)
  p32 = _zeros(params)
  carry0 = dict(j=jnp.zeros((), jnp.float32), g=p32, x=p32, m2=p32 if need_var else None,
                n=jnp.zeros((), jnp.float32))

  def body(c, inp):
    mb, kj = inp
    if estimator == "gnb":
      g, n_tok, n_seq = gnb.gnb_grad(logits_fn, params, mb, kj)
      w = {"tokens": n_tok, "sequences": n_seq, "none": 1.0}[weight]
      x = jax.tree.map(lambda t: w * t * t, g) if statistic == "mean_sq" else None
      c = dict(c, n=c["n"] + (n_tok if weight == "tokens" else n_seq))
      if statistic == "sq_of_mean":
        c = dict(c, g=jax.tree.map(jnp.add, c["g"], g))
    else:
      x = gnb.hutchinson_diag(loss_fn, params, mb, kj)
    j = c["j"] + 1.0
    if x is not None:
      if need_var:
        delta = jax.tree.map(lambda xi, mu: xi - mu, x, c["x"])
        mu = jax.tree.map(lambda mu, d: mu + d / j, c["x"], delta)
        m2 = jax.tree.map(lambda s, d, xi, mu_: s + d * (xi - mu_), c["m2"], delta, x, mu)
        c = dict(c, x=mu, m2=m2)
      else:
        c = dict(c, x=jax.tree.map(jnp.add, c["x"], x))
    return dict(c, j=j), None

  c, _ = jax.lax.scan(body, carry0, (mbs, keys))
  if estimator == "gnb" and statistic == "sq_of_mean":
    scale = c["n"] if weight != "none" else 1.0
    h = jax.tree.map(lambda s: scale * (s / m) ** 2, c["g"])
  else:
    h = c["x"] if need_var else jax.tree.map(lambda s: s / m, c["x"])
  var = None
  if need_var:
    den = 1.0 / (m * (m - 1)) if m > 1 else 0.0
    var = jax.tree.map(lambda s: jnp.maximum(s * den, 0.0), c["m2"])
  return h, var


def sophia_collect(loss_fn, params: PyTree, microbatches: PyTree, spec: CollectorSpec, *,
                   opt_state: PyTree, key: jax.Array, logits_fn=None,
                   b_microbatches: PyTree = None) -> BCStats:
  """Numerator gradient plus (on refresh steps) Sophia's curvature estimate, in one jitted step.

  Every step: true-label gradients of ``loss_fn`` over the numerator group (``all``: every
  microbatch; ``ab``: group A on refresh steps and all 2m microbatches otherwise;
  ``rolling_b``: ``microbatches``). On refresh steps (count % k == 0, read from ``opt_state``)
  the estimator pass runs over the curvature group (``all``: every microbatch; ``ab``: B;
  ``rolling_b``: ``b_microbatches``) inside ``lax.cond``, so other steps do not pay for it.

  Returns:
    ``BCStats`` whose ``precond`` is a ``SophiaCurvature``.
  """
  opts = dict(spec.estimator_options)
  if spec.estimator == "gnb" and logits_fn is None:
    raise ValueError("the GNB estimator needs logits_fn(params, mb) -> (logits, mask)")
  if key is None:
    raise ValueError("sophia_collect needs a PRNG key (label sampling / Rademacher vectors)")
  st = find_sophia_state(opt_state)
  refresh = (st.count % spec.refresh_every) == 0
  num, mbs_c = refresh_groups(loss_fn, params, microbatches, spec.layout, refresh,
                              b_microbatches)
  need_var = opts["need_var"]
  m_c = jax.tree.leaves(mbs_c)[0].shape[0]
  if need_var and m_c < 2:
    raise ValueError(f"the variance correction needs >= 2 microbatches in the curvature "
                     f"group, got {m_c}")

  def run():
    return _curvature_pass(loss_fn, logits_fn, params, mbs_c, key, spec.estimator,
                           opts["statistic"], opts["weight"], need_var)

  def skip():
    z = _zeros(params)
    return z, (z if need_var else None)

  h, var = jax.lax.cond(refresh, run, skip)
  return num._replace(precond=SophiaCurvature(h_step=h, var=var, refresh=refresh))


def scale_by_sophia(
    b1: float = 0.965,
    b2: float = 0.99,
    eps: float = 1e-12,
    *,
    rho: float = 0.05,
    clip: float = 1.0,
    k: int = 10,
    mode: str = "std",
    correction: Optional[str] = None,
    denominator_scale: str = "matched",
    bs: Optional[float] = None,
    correction_scale: float = 1.0,
    bias_correct_momentum: bool = False,
    hessian_first: bool = True,
    skip_nonfinite: bool = True,
    state_dtype=jnp.float32,
    **_spec_only,
) -> optax.GradientTransformationExtraArgs:
  """Sophia's scaling (see the module docstring); ``update(g, state, params, *, bc_stats)``.

  Args:
    b1, b2, eps: momentum and curvature EMA rates; eps is added to the denominator (> 0).
    rho: curvature scale (Sophia's rho, optax's gamma).
    clip: per-coordinate clip c of m * inv (0 = off).
    k: refresh interval; must equal the spec's (``sophia_spec(k=...)``).
    mode, correction: ``std|cf|inv|full``; correction ``delta`` (inv, full) or ``none``.
    denominator_scale, bs: ``matched`` (s = 1) or ``reference`` (s = bs, required).
    correction_scale: multiplies the subtracted delta-method term.
    bias_correct_momentum: use m / (1 - b1^t) (optax.contrib.sophia) instead of m (paper).
    hessian_first: on refresh steps use the new inverse in the same step (paper's code);
      False uses the previous one and refreshes afterwards (optax.contrib.sophia).
    skip_nonfinite: a tensor with a non-finite update gets a zero update and keeps its state.
    state_dtype: dtype of mu, h, inv.
  """
  correction = _resolve(mode, correction)
  _check("denominator_scale", denominator_scale, DENOMINATOR_SCALES)
  if not eps > 0:
    raise ValueError(f"eps={eps!r} must be > 0 (it bounds the inverse before the first refresh)")
  if denominator_scale == "reference" and (bs is None or bs <= 0):
    raise ValueError("denominator_scale='reference' needs bs > 0 (examples per step)")
  if not isinstance(k, int) or isinstance(k, bool) or k < 1:
    raise ValueError(f"k={k!r} (Hessian refresh interval) must be an integer >= 1")
  s = float(bs) if denominator_scale == "reference" else 1.0
  a = rho * s  # p = a h + eps

  def init_fn(params):
    z = lambda p: jnp.zeros(jnp.shape(p), state_dtype)
    return ScaleBySophiaState(count=jnp.zeros([], jnp.int32), mu=jax.tree.map(z, params),
                              h=jax.tree.map(z, params),
                              inv=jax.tree.map(lambda p: jnp.full(jnp.shape(p), 1.0 / eps,
                                                                  state_dtype), params))

  def update_fn(updates, state, params=None, *, bc_stats: Optional[BCStats] = None, **_):
    del params
    if bc_stats is None or not isinstance(bc_stats.precond, SophiaCurvature):
      raise ValueError("scale_by_sophia needs bc_stats from sophia_collect (bc_stats.precond "
                       "must be a SophiaCurvature)")
    cur = bc_stats.precond
    refresh = cur.refresh
    if correction != "none" and cur.var is None:
      raise ValueError("the variance correction needs Var(h_step); build the spec with the "
                       "same mode (sophia_spec)")
    count_inc = optax.safe_increment(state.count)
    is_masked = lambda x: isinstance(x, MaskedNode)
    g_l, td = jax.tree.flatten(updates, is_leaf=is_masked)
    mu_l, h_l, inv_l = (td.flatten_up_to(t) for t in (state.mu, state.h, state.inv))
    hs_l = td.flatten_up_to(cur.h_step)
    var_l = td.flatten_up_to(cur.var) if cur.var is not None else [None] * len(g_l)
    live = [i for i, g in enumerate(g_l) if not is_masked(g)]

    def refreshed(h_old, hs, var):
      h_new = [b2 * h_old[i] + (1 - b2) * hs[i].astype(state_dtype) for i in range(len(h_old))]
      inv_new = []
      for i, h in enumerate(h_new):
        p = a * h + eps
        inv = 1.0 / p
        if correction != "none":
          var_p = ((a * (1 - b2)) ** 2) * var[i]  # first, so zero variance subtracts exactly 0
          inv = jnp.maximum(inv - correction_scale * var_p / (p * p * p), 0.0)
        inv_new.append(inv.astype(state_dtype))
      return h_new, inv_new

    h_old = [h_l[i] for i in live]
    inv_old = [inv_l[i] for i in live]
    hs = [hs_l[i] for i in live]
    var = [var_l[i] for i in live] if correction != "none" else [None] * len(live)
    h_new, inv_new = jax.lax.cond(refresh, refreshed, lambda h, s_, v: (h_old, inv_old),
                                  h_old, hs, var)
    bc1 = 1.0 - b1 ** count_inc.astype(jnp.float32)
    out_u, out_mu, out_h, out_inv = list(g_l), list(mu_l), list(h_l), list(inv_l)
    for j, i in enumerate(live):
      g = g_l[i].astype(state_dtype)
      mu = b1 * mu_l[i] + (1 - b1) * g
      inv = inv_new[j] if hessian_first else inv_old[j]
      m_use = mu / bc1 if bias_correct_momentum else mu
      u = m_use * inv
      if clip > 0:
        u = jnp.clip(u, -clip, clip)
      h_i, inv_i = h_new[j], inv_new[j]
      if skip_nonfinite:
        ok = jnp.all(jnp.isfinite(u)) & jnp.all(jnp.isfinite(inv_i))
        u = jnp.where(ok, u, 0.0)
        mu = jnp.where(ok, mu, mu_l[i])
        h_i = jnp.where(ok, h_i, h_l[i])
        inv_i = jnp.where(ok, inv_i, inv_l[i])
      out_u[i] = u.astype(g_l[i].dtype)
      out_mu[i], out_h[i], out_inv[i] = mu.astype(state_dtype), h_i, inv_i
    un = lambda l: jax.tree.unflatten(td, l)
    return un(out_u), ScaleBySophiaState(count=count_inc, mu=un(out_mu), h=un(out_h),
                                         inv=un(out_inv))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def sophia(learning_rate: optax.ScalarOrSchedule, b1: float = 0.965, b2: float = 0.99,
           eps: float = 1e-12, weight_decay: float = 0.1, *,
           mask: Optional[Union[PyTree, Callable[[PyTree], PyTree]]] = None,
           **kwargs) -> optax.GradientTransformationExtraArgs:
  """Sophia with decoupled weight decay: theta <- theta (1 - lr wd) - lr clip(m * inv).

  ``kwargs`` go to ``scale_by_sophia`` (``mode`` defaults to ``std``); settings that only the
  collector needs (``estimator``, ``statistic``, ``count_unit``) are accepted and ignored here.
  """
  return optax.chain(scale_by_sophia(b1, b2, eps, **kwargs),
                     optax.add_decayed_weights(weight_decay, mask),
                     optax.scale_by_learning_rate(learning_rate))


def sophia_bc(learning_rate: optax.ScalarOrSchedule, b1: float = 0.965, b2: float = 0.99,
              eps: float = 1e-12, weight_decay: float = 0.1, *, mode: str = "full",
              **kwargs) -> optax.GradientTransformationExtraArgs:
  """``sophia`` with ``mode="full"`` (cross-fit + variance-corrected inverse) by default."""
  return sophia(learning_rate, b1, b2, eps, weight_decay, mode=mode, **kwargs)
