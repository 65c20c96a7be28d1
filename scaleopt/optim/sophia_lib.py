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
examples per step, so its BC denominator is not on the scale of std's and rho differs between
the two; docs/optim_sophia_shampoo.md).

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

from scaleopt.optim import delta, gnb, phases
from scaleopt.optim.collect import (BCStats, CollectorSpec, Static, align, check_numerator,
                                    clip_factor, fold_microbatches, refresh_groups,
                                    register_bc_state, register_estimator, sum0,
                                    value_and_grad_fn, welford_add, welford_init, welford_merge,
                                    welford_of, welford_var_of_mean)
from scaleopt.optim.tree_utils import check_choice, keep_finite, tmap, unzip

PyTree = Any

MODES = ("std", "cf", "inv", "full")
CROSSFITS = ("ab", "rolling_b")
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


# Coordinates a safeguard changed at the last update (``ScaleBySophiaState.rules``):
# refreshed denominators p = rho s h + eps below ``delta.FLOOR`` (the corrected inverse floors
# p there; the uncorrected 1/p takes it as is: Hutchinson's non-positive curvature), corrected
# inverses clamped at 0, and update ratios m * inv clipped at +-clip.
RULES = ("curvature_below_floor", "inverse_clamped", "ratio_clipped")


class ScaleBySophiaState(NamedTuple):
  """count, momentum mu, curvature EMA h and the cached (corrected) inverse, float32;
  skipped: tensors zeroed at the last step (non-finite); spec: the ``CollectorSpec``; rules:
  {name in ``RULES``: int32 count} of the last update (``scaleopt.optim.rule_counts``)."""
  count: jax.Array
  mu: PyTree
  h: PyTree
  inv: PyTree
  skipped: jax.Array
  spec: Static
  hp: dict
  rules: dict


register_bc_state(ScaleBySophiaState)


def _resolve(mode: str, correction: Optional[str]) -> str:
  check_choice("mode", mode, MODES)
  if correction is None:
    correction = "delta" if mode in ("inv", "full") else "none"
  check_choice("correction", correction, ("none", "delta"))
  if (mode in ("inv", "full")) != (correction != "none"):
    raise ValueError(f"mode={mode!r} with correction={correction!r}: modes 'inv'/'full' apply "
                     "the variance correction ('delta') and 'std'/'cf' none")
  return correction


def _check_k(k):
  if not isinstance(k, int) or isinstance(k, bool) or k < 1:
    raise ValueError(f"k={k!r} (Hessian refresh interval) must be an integer >= 1")


AB_NUMERATORS = ("all_off_refresh", "a")


def sophia_collector_spec(mode, crossfit, estimator, k, statistic, count_unit,
                          denominator_scale, correction,
                          ab_numerator="all_off_refresh") -> CollectorSpec:
  """The estimator pass these settings need (stored in the state)."""
  check_choice("crossfit", crossfit, CROSSFITS)
  check_choice("estimator", estimator, ESTIMATORS)
  check_choice("count_unit", count_unit, COUNT_UNITS)
  check_choice("denominator_scale", denominator_scale, DENOMINATOR_SCALES)
  _check_k(k)
  check_choice("statistic", statistic, STATISTICS)
  check_choice("ab_numerator", ab_numerator, AB_NUMERATORS)
  if correction != "none" and estimator == "gnb" and statistic != "mean_sq":
    raise ValueError("the variance correction needs statistic='mean_sq' (per-microbatch "
                     "estimates whose spread gives Var(h_step))")
  layout = "all" if mode in ("std", "inv") else crossfit
  weight = count_unit if denominator_scale == "matched" else "none"
  opts = (("statistic", statistic), ("weight", weight), ("need_var", correction != "none"),
          ("a_every_step", ab_numerator == "a"))
  return CollectorSpec(layout=layout, estimator=estimator, refresh_every=k,
                       needs_logits=estimator == "gnb", needs_key=True, estimator_options=opts)


def curvature_pass(loss_fn, logits_fn, params, mbs, key, estimator, statistic, weight,
                   need_var, vmap=False, axis=None):
  """Pass over the curvature group: h_step and Var(h_step) (float32); ``vmap``: the
  per-microbatch estimates by one ``jax.vmap``, split over ``axis`` where one is given
  (``collect.fold_microbatches``)."""
  m = jax.tree.leaves(mbs)[0].shape[0]
  keys = jax.random.split(key, m)
  z = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), params)
  carry0 = dict(g=z, w=welford_init(z), n=jnp.zeros((), jnp.float32))

  def fn(inp):
    mb, kj = inp
    if estimator == "gnb":
      g, n_tok, n_seq = gnb.gnb_grad(logits_fn, params, mb, kj)
      w = {"tokens": n_tok, "sequences": n_seq, "none": 1.0}[weight]
      return g, jax.tree.map(lambda t: w * t * t, g), n_tok if weight == "tokens" else n_seq
    return None, gnb.hutchinson_diag(loss_fn, params, mb, kj), None

  def step(c, y):
    g, x, n = y
    if estimator == "gnb":
      c = dict(c, n=c["n"] + n, g=jax.tree.map(jnp.add, c["g"], g))
    return dict(c, w=welford_add(c["w"], x))

  def reduce(c, ys):  # ``step`` over stacked estimates as sums (microbatches split over devices)
    g, x, n = ys
    if estimator == "gnb":
      c = dict(c, n=c["n"] + jnp.sum(n), g=jax.tree.map(jnp.add, c["g"], sum0(g)))
    return dict(c, w=welford_merge(c["w"], welford_of(x)))

  c, _ = fold_microbatches(fn, step, carry0, (mbs, keys), vmap=vmap, reduce=reduce, axis=axis)
  if estimator == "gnb" and statistic == "sq_of_mean":
    scale = c["n"] if weight != "none" else 1.0
    h = jax.tree.map(lambda s: scale * (s / m) ** 2, c["g"])
  else:
    h = c["w"].mean
  return h, (welford_var_of_mean(c["w"], m) if need_var else None)


def sophia_collect(loss_fn, params: PyTree, microbatches: PyTree, spec: CollectorSpec, found,
                   *, key: jax.Array, logits_fn=None, b_microbatches: PyTree = None,
                   max_norm=None, microbatch_axis=None) -> BCStats:
  """Numerator gradient plus (on refresh steps) Sophia's curvature estimate, in one jitted step.

  Every step: true-label gradients of ``loss_fn`` over the numerator group (``all``: every
  microbatch; ``ab``: group A on refresh steps and all 2m microbatches otherwise;
  ``rolling_b``: ``microbatches``). On refresh steps (count % k == 0, read from the state)
  the estimator runs over the curvature group (``all``: every microbatch; ``ab``: B;
  ``rolling_b``: ``b_microbatches``) under ``phases.cond``. ``loss``/``full`` cover the numerator
  group. A consistent clip scales the numerator by c = min(1, max_norm / ||g_num||); the
  curvature is not a gradient statistic and is not scaled.
  """
  opts = dict(spec.estimator_options)
  if spec.estimator == "gnb" and logits_fn is None:
    raise ValueError("the GNB estimator needs logits_fn(params, mb) -> (logits, mask)")
  if key is None:
    raise ValueError("Sophia's estimator needs a PRNG key (collect(..., key=...))")
  states = [f.state for f in found if isinstance(f.state, ScaleBySophiaState)]
  refresh = phases.due(states[0].count, spec.refresh_every)
  (num, loss, aux), mbs_c = refresh_groups(value_and_grad_fn(loss_fn), params, microbatches,
                                           spec.layout, refresh, b_microbatches,
                                           vmap=spec.vmap, axis=microbatch_axis,
                                           a_every_step=opts.get("a_every_step", False))
  need_var = opts["need_var"]
  m_c = jax.tree.leaves(mbs_c)[0].shape[0]
  if need_var and m_c < 2:
    raise ValueError(f"the variance correction needs >= 2 microbatches in the curvature "
                     f"group, got {m_c}")

  def run():
    return curvature_pass(loss_fn, logits_fn, params, mbs_c, key, spec.estimator,
                          opts["statistic"], opts["weight"], need_var, spec.vmap,
                          microbatch_axis)

  def skip():
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(run))

  h, var = phases.cond(refresh, run, skip)
  c = clip_factor(num, max_norm) if max_norm is not None else jnp.float32(1.0)
  num = jax.tree.map(lambda x: c * x, num)
  return BCStats(num, num, None, None, None, loss, aux, c,
                 SophiaCurvature(h_step=h, var=var, refresh=refresh))


register_estimator("gnb", sophia_collect)
register_estimator("hutchinson", sophia_collect)


def _refresh(h, h_step, h_var, a, b2, eps, scale):
  """New h, (corrected) inverse and the counts of ``RULES[:2]``: h <- b2 h + (1-b2) h_step,
  inv = 1/p - Var(p)/p^3 with Var(p) from ``h_var`` = Var(h_step) (None: no correction)."""
  h_new = b2 * h + (1 - b2) * h_step
  p = a * h_new + eps
  low = jnp.sum(p < delta.FLOOR, dtype=jnp.int32)
  if h_var is None:
    return h_new, 1.0 / p, jnp.stack([low, jnp.int32(0)])
  var_p = ((a * (1 - b2)) ** 2) * h_var  # first, so zero variance subtracts exactly 0
  inv = delta.inv_corrected(p, var_p, scale=scale)
  return h_new, inv, jnp.stack([low, jnp.sum(inv <= 0, dtype=jnp.int32)])


def _rules(refresh_counts, u, clip) -> dict:
  clipped = sum((jnp.sum(jnp.abs(x) > clip, dtype=jnp.int32) for x in jax.tree.leaves(u)),
                jnp.int32(0)) if clip > 0 else jnp.int32(0)
  return dict(zip(RULES, [refresh_counts[0], refresh_counts[1], clipped]))


def scale_by_sophia(
    b1: float = 0.965,
    b2: float = 0.99,
    eps: float = 1e-12,
    *,
    rho: float = 0.05,
    clip: float = 1.0,
    k: int = 10,
    mode: str = "std",
    crossfit: str = "ab",
    estimator: str = "gnb",
    statistic: Optional[str] = None,
    count_unit: str = "tokens",
    correction: Optional[str] = None,
    denominator_scale: str = "matched",
    bs: Optional[float] = None,
    correction_scale: float = 1.0,
    bias_correct_momentum: bool = False,
    ab_numerator: str = "all_off_refresh",
    hessian_first: bool = True,
    skip_nonfinite: bool = True,
    state_dtype=jnp.float32,
    mu_dtype=None,
) -> optax.GradientTransformationExtraArgs:
  """Sophia's scaling (see the module docstring); ``update(g, state, params, *, bc_stats)``.

  Args:
    b1, b2, eps: momentum and curvature EMA rates; eps is added to the denominator (> 0).
    rho: curvature scale (Sophia's rho, optax's gamma).
    clip: per-coordinate clip c of m * inv (0 = off).
    k: refresh interval of the curvature (the collector reads it from the state).
    mode, correction: ``std|cf|inv|full``; correction ``delta`` (inv, full) or ``none``.
    crossfit: ``ab`` (halves of 2m microbatches) or ``rolling_b`` (B = next step's A).
    estimator: ``gnb`` (Sophia-G) or ``hutchinson`` (Sophia-H).
    statistic: GNB only: ``sq_of_mean`` (square of the group's mean sampled gradient; default
      for ``std``) or ``mean_sq`` (mean of per-microbatch squares; default otherwise, and
      required by the variance correction).
    count_unit: positions (``tokens``) or ``sequences`` weight per-microbatch GNB squares.
    denominator_scale, bs: ``matched`` (s = 1) or ``reference`` (s = bs, required).
    correction_scale: multiplies the subtracted delta-method term.
    bias_correct_momentum: use m / (1 - b1^t) (optax.contrib.sophia) instead of m (paper).
    ab_numerator: the momentum's input in the ``ab`` layout: ``all_off_refresh`` (default:
      group A on refresh steps, all 2m microbatches on the others, where no curvature is
      computed) or ``a`` (group A on every step, the authors' code: the same noise level on
      every step).
    hessian_first: on refresh steps use the new inverse in the same step (paper's code);
      False uses the previous one and refreshes afterwards (optax.contrib.sophia).
    skip_nonfinite: a tensor with a non-finite update gets a zero update and keeps its state
      (counted in ``state.skipped``).
    state_dtype: dtype of mu, h, inv.
    mu_dtype: dtype of mu alone (None = ``state_dtype``; as ``optax.adamw``'s ``mu_dtype``):
      the momentum update b1 m + (1 - b1) g runs in float32 from the stored m (as optax's) and
      m is rounded to ``mu_dtype`` when stored.
  """
  correction = _resolve(mode, correction)
  statistic = statistic or ("sq_of_mean" if mode == "std" else "mean_sq")
  spec = sophia_collector_spec(mode, crossfit, estimator, k, statistic, count_unit,
                               denominator_scale, correction, ab_numerator)
  if not eps > 0:
    raise ValueError(f"eps={eps!r} must be > 0 (it bounds the inverse before the first refresh)")
  if denominator_scale == "reference" and (bs is None or bs <= 0):
    raise ValueError("denominator_scale='reference' needs bs > 0 (examples per step)")
  a = rho * (float(bs) if denominator_scale == "reference" else 1.0)  # p = a h + eps
  mu_dt = jnp.dtype(state_dtype if mu_dtype is None else mu_dtype)
  m_dt = jnp.promote_types(mu_dt, jnp.float32) if mu_dtype is not None else mu_dt  # arithmetic

  def init_fn(params):
    z = lambda p: jnp.zeros(jnp.shape(p), state_dtype)
    return ScaleBySophiaState(
        jnp.zeros([], jnp.int32),
        jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), mu_dt), params), jax.tree.map(z, params),
        jax.tree.map(lambda p: jnp.full(jnp.shape(p), 1.0 / eps, state_dtype), params),
        jnp.zeros([], jnp.int32), Static(spec), {}, _rules(jnp.zeros(2, jnp.int32), {}, 0))

  def update_fn(updates, state, params=None, *, bc_stats: Optional[BCStats] = None, **_):
    del params
    if bc_stats is None or not isinstance(bc_stats.precond, SophiaCurvature):
      raise ValueError("scale_by_sophia needs bc_stats from scaleopt.optim.collect (with this "
                       "transform's state)")
    if mode != "std":
      check_numerator(updates, bc_stats, f"scale_by_sophia(mode={mode!r})")
    curvature = bc_stats.precond
    count_inc = optax.safe_increment(state.count)
    h_step = align(curvature.h_step, updates)
    use_var = correction != "none"
    h_var = align(curvature.var, updates) if use_var else h_step  # h_step: unused placeholder

    def refreshed(h, h_step, h_var):
      out = tmap(lambda h_, step_, var_: _refresh(h_, step_, var_ if use_var else None, a, b2,
                                                  eps, correction_scale), h, h_step, h_var)
      h_new, inv_new, counts = unzip(out, h, 3)
      counts = sum(jax.tree.leaves(counts), jnp.zeros(2, jnp.int32))
      return (*(tmap(lambda x: x.astype(state_dtype), t) for t in (h_new, inv_new)), counts)

    def kept(h, h_step, h_var):
      return h, state.inv, jnp.zeros(2, jnp.int32)

    h_new, inv_new, refresh_counts = phases.cond(curvature.refresh, refreshed, kept, state.h,
                                                 h_step, h_var)
    bc1 = 1.0 - b1 ** count_inc.astype(jnp.float32)
    mu = tmap(lambda m, g: b1 * m + (1 - b1) * g.astype(m_dt), state.mu, updates)
    inv_use = inv_new if hessian_first else state.inv
    u = tmap(lambda m, i: (m / bc1 if bias_correct_momentum else m) * i, mu, inv_use)
    rules = _rules(refresh_counts, u, clip)
    if clip > 0:
      u = tmap(lambda x: jnp.clip(x, -clip, clip), u)
    skipped = jnp.zeros([], jnp.int32)
    if skip_nonfinite:
      u, (mu, h_new, inv_new), skipped = keep_finite(
          u, ((mu, state.mu), (h_new, state.h), (inv_new, state.inv)), also=inv_new)
    out = tmap(lambda x, g: x.astype(g.dtype), u, updates)
    mu = tmap(lambda m: m.astype(mu_dt), mu)
    return out, ScaleBySophiaState(count_inc, mu, h_new, inv_new, skipped, state.spec, {},
                                   rules)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def sophia(learning_rate: optax.ScalarOrSchedule, b1: float = 0.965, b2: float = 0.99,
           eps: float = 1e-12, weight_decay: float = 0.1, *,
           mask: Optional[Union[PyTree, Callable[[PyTree], PyTree]]] = None,
           **kwargs) -> optax.GradientTransformationExtraArgs:
  """Sophia with decoupled weight decay: theta <- theta (1 - lr wd) - lr clip(m * inv).

  ``kwargs`` are ``scale_by_sophia``'s (unknown names raise ``TypeError``).
  """
  return optax.chain(scale_by_sophia(b1, b2, eps, **kwargs),
                     optax.add_decayed_weights(weight_decay, mask),
                     optax.scale_by_learning_rate(learning_rate))


def sophia_bc(learning_rate: optax.ScalarOrSchedule, b1: float = 0.965, b2: float = 0.99,
              eps: float = 1e-12, weight_decay: float = 0.1, *, mode: str = "full",
              **kwargs) -> optax.GradientTransformationExtraArgs:
  """``sophia`` with ``mode="full"`` (cross-fit + variance-corrected inverse) by default."""
  return sophia(learning_rate, b1, b2, eps, weight_decay, mode=mode, **kwargs)
