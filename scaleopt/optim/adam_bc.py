"""AdamW with the bias corrections of Nayak et al. (arXiv 2605.20756) as Optax transforms.

Plain Adam uses one minibatch for both the numerator and the preconditioner,

    u = m_hat / (sqrt(v_hat) + eps),   m <- b1 m + (1-b1) g,   v <- b2 v + (1-b2) g * g,

which carries two finite-sample biases. *Coupling*: g and v come from the same examples, so
E[g / sqrt(v)] != E[g] E[1/sqrt(v)]. *Inversion (Jensen)*: even with independent v, the
convex map T(x) = 1 / (sqrt(x) + eps) gives E[T(v)] > T(E v). The fixes:

* cross-fitting (``mode="cf"``): the numerator comes from microbatch group A, the
  preconditioner statistic from an independent group B (``crossfit="ab"``, ``"symmetric"``
  or leave-one-out ``"loo"``);
* variance-corrected inversion (``mode="inv"``): T_tilde(x) = T(x) - (1/2) T''(x) Var(x),
  with Var estimated from the spread of per-microbatch statistics, clamped at 0;
* ``mode="full"``: both (the default, with the leave-one-out layout that trains best).

With U = v_hat_t = a + b x (a = b2 v_{t-1} / (1 - b2^t), b = (1 - b2) / (1 - b2^t), x the
statistic entering v this step), D = sqrt(U) + eps:

    post_ema:  inv = max(0, 1/D - Var(D) / D^3),   Var(D) = b^2 Var(x) / (4 U)   (delta method)
    pre_ema:   inv = max(0, 1/D - b^2 Var(x) [1 / (4 U D^3) + 1 / (8 U^{3/2} D^2)])
    reference_post_ema: inv = max(0, 1/D - Var(p_bar) / D^3) with the reference code's
               per-microbatch denominators p_j = sqrt((b2 v_{t-1} + (1-b2) g_j^2) / (1-b2^t))

By default x = g_bar_B^2 (``v_source="sq_of_mean"``) with the unbiased (Gaussian microbatch
gradients, V_hat = M2 / (m (m-1)) estimated from the same m microbatches)

    Var_hat(x) = 4 g_bar^2 V_hat - 2 V_hat^2 (m - 1) / (m + 1),

E[Var_hat(x)] = 4 mu^2 V + 2 V^2 = Var(g_bar^2) (E V_hat^2 = V^2 (m+1)/(m-1)). The transform
clamps it at 0: a negative estimate would turn the correction into an increase of the inverse
that grows without bound as U -> 0 (it divides by U D^3), so a correction only ever subtracts. The reference
A/B code's mean of per-microbatch squares is ``v_source="mean_sq"`` (Var(x) = Welford of
g_j^2 / m, unbiased). Derivations: docs/optim.md.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

# the formulas stay importable from here (adaptive_alpha, b1_mix, corrected_inverse,
# var_sq_of_mean, RULES), as do the tree helpers (tmap, unzip, check_choice, keep_finite)
from scaleopt.optim.adam_bc_forms import (RULES, AdamBCHyper, adaptive_alpha, b1_mix,
                                          bias_correction, corrected_inverse, directions,
                                          rule_dict, std_leaf, support_clip, var_sq_of_mean)
from scaleopt.optim.collect import (BCStats, CollectorSpec, StateHooks, Static, align,
                                    check_numerator, register_bc_state, unclipped_numerator)
from scaleopt.optim.tree_utils import check_choice, is_masked, keep_finite, tmap, unzip

PyTree = Any
MaskedNode = optax.MaskedNode

MODES = ("std", "cf", "inv", "full")
CROSSFITS = ("ab", "rolling_b", "symmetric", "loo")
CORRECTIONS = ("none", "post_ema", "pre_ema", "reference_post_ema")
V_SOURCES = ("sq_of_mean", "mean_sq")
LOO_VARIANCES = ("across_folds", "per_fold")


class ScaleByAdamBCState(NamedTuple):
  """count; float32 moments mu, nu; skipped: tensors whose non-finite update was zeroed at the
  last step; spec: the ``CollectorSpec`` (static); hp: b1, b2, eps as arrays (collector);
  rules: {name in ``RULES``: int32 count} of the coordinates a safeguard changed at the
  last step (LOO sign flips zeroed, corrected inverses clamped at 0, corrections that enlarged
  a step, negative variance estimates clamped at 0)."""
  count: jax.Array
  mu: PyTree
  nu: PyTree
  skipped: jax.Array
  spec: Static
  hp: dict
  rules: jax.Array


def _resolve(mode: str, crossfit: str, correction: Optional[str], v_source: str) -> str:
  check_choice("mode", mode, MODES)
  check_choice("crossfit", crossfit, CROSSFITS)
  check_choice("v_source", v_source, V_SOURCES)
  if correction is None:
    correction = "post_ema" if mode in ("inv", "full") else "none"
  check_choice("correction", correction, CORRECTIONS)
  if (mode in ("inv", "full")) != (correction != "none"):
    raise ValueError(f"mode={mode!r} with correction={correction!r}: modes 'inv'/'full' apply a "
                     "variance correction and 'std'/'cf' none")
  if crossfit == "loo" and mode in ("cf", "full") and (v_source != "sq_of_mean" or correction
                                                        not in ("none", "post_ema")):
    raise ValueError("crossfit='loo' squares the leave-one-out mean and corrects with the fold "
                     "variance: use v_source='sq_of_mean' and correction='post_ema'")
  return correction


def adam_bc_collector_spec(mode, crossfit, correction, v_source) -> CollectorSpec:
  """What the collector must compute for these settings (stored in the state)."""
  if mode == "std":
    return CollectorSpec(layout=None)
  var_of = {"none": None, "reference_post_ema": "post_ema"}.get(
      correction, "grad" if v_source == "sq_of_mean" else "sq")
  layout = "all" if mode == "inv" else {"ab": "ab"}.get(crossfit, crossfit)
  if layout == "loo":
    return CollectorSpec(layout="loo", stateful=True)
  return CollectorSpec(layout=layout, var_of=var_of, need_sq=v_source == "mean_sq",
                       stateful=var_of == "post_ema")


# ----------------------------------------------------------------------------- collector hooks

def _debias(state: ScaleByAdamBCState, hp: dict):
  """(1 - b1^t, 1 - b2^t) of the update the state is about to take (t = count + 1)."""
  t = state.count.astype(jnp.float32) + 1.0
  return 1.0 - hp["b1"] ** t, 1.0 - hp["b2"] ** t


def loo_fold_fn(state: ScaleByAdamBCState, hp: dict, g_full, m) -> Callable:
  """Per-fold terms of the leave-one-out update (docs/optim.md derives them).

  For fold r with g_{-r} = (m g_full - g_r) / (m - 1):

      m_hat_r = (b1 m_{t-1} + (1-b1) g_r) / (1 - b1^t)
      d_r     = sqrt(max(0, (b2 v_{t-1} + (1-b2) g_{-r}^2) / (1 - b2^t))) + eps

  returns ({"first": m_hat_r / d_r, "third": m_hat_r / d_r^3}, d_r); leaves masked out of
  this state (another partition branch) get scalar zeros.
  """
  b1, b2, eps = hp["b1"], hp["b2"], hp["eps"]
  m_denom, v_denom = _debias(state, hp)

  def leaf(mu, nu, g_r, g_f):
    if is_masked(mu):
      z = jnp.zeros((), jnp.float32)
      return z, z, z
    g_minus_r = (m * g_f - g_r) / (m - 1)
    m_hat = (b1 * mu + (1 - b1) * g_r) / m_denom
    d = jnp.sqrt(jnp.maximum((b2 * nu + (1 - b2) * g_minus_r * g_minus_r) / v_denom, 0.0)) + eps
    return m_hat / d, m_hat / (d * d * d), d

  def fold(g_r):
    out = jax.tree.map(leaf, state.mu, state.nu, g_r, g_full, is_leaf=is_masked)
    first, third, d = unzip(out, g_r, 3)
    return {"first": first, "third": third}, d

  return fold


def post_ema_var_fn(state: ScaleByAdamBCState, hp: dict) -> Callable:
  """The reference code's per-microbatch denominator p_j = sqrt(max(0, (b2 v_{t-1} +
  (1-b2) g_j^2) / (1 - b2^t))), whose Welford variance is its post-EMA Var."""
  b2 = hp["b2"]
  _, v_denom = _debias(state, hp)
  leaf = lambda nu, g: (jnp.zeros((), jnp.float32) if is_masked(nu) else
                        jnp.sqrt(jnp.maximum((b2 * nu + (1 - b2) * g * g) / v_denom, 0.0)))
  return lambda g: jax.tree.map(leaf, state.nu, g, is_leaf=is_masked)


register_bc_state(ScaleByAdamBCState, StateHooks(fold_fn=loo_fold_fn, var_fn=post_ema_var_fn))


# ----------------------------------------------------------------------------- transform

def scale_by_adam_bc(
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    *,
    mode: str = "full",
    crossfit: str = "loo",
    correction: Optional[str] = None,
    v_source: str = "sq_of_mean",
    correction_scale: float = 1.0,
    reference_pre_ema: bool = False,
    crossfit_alpha: float = 1.0,
    crossfit_alpha_adaptive: bool = False,
    loo_variance: str = "across_folds",
    update_clip: float = 0.0,
    support_clip_tau: float = 0.0,
    std_warmup_steps: int = 0,
    skip_nonfinite: bool = True,
    state_dtype: str = "float32",
    mu_dtype: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
  """Adam's scaling with cross-fitting and variance-corrected inversion.

  ``update(updates, state, params=None, *, bc_stats=None)``: ``updates`` is
  ``bc_stats.numerator``; ``bc_stats`` comes from ``scaleopt.optim.collect(loss_fn, params,
  microbatches, opt_state)``, which reads what to collect from this transform's state.

  Forms (``crossfit`` picks the cross-fit layout for ``cf``/``full``):

  * ``std``: Adam; works without ``bc_stats`` and equals ``optax.scale_by_adam``.
  * ``ab`` / ``rolling_b``: m <- g_A, v <- x_B, u = m_hat inv(v_hat) (``full``: Var from B).
  * ``inv``: all microbatches in one group, u = m_hat inv(v_hat, Var(x)).
  * ``symmetric``: persistent m, v from g_full; candidate moments per half,
    u = (m_hat_A inv_B + m_hat_B inv_A) / 2 (same examples as std).
  * ``loo``: persistent m, v from g_full; u = mean_r m_hat_r / d_r (``full``: minus
    correction_scale Var_r(d_r) mean_r m_hat_r / d_r^3, sign flips zeroed).

  Args:
    b1, b2, eps: Adam's decay rates and epsilon (outside the square root).
    mode, crossfit, correction, v_source: see above and the module docstring.
    correction_scale: multiplies the subtracted delta-method term (1.0 = the delta method
      for the A/B, inv and symmetric forms; for ``loo`` see ``loo_variance``).
    loo_variance: the V of the leave-one-out Jensen term. ``across_folds`` (default, the
      authors' code and the paper's headline run): the sample variance over folds
      Var_r(d_r) = (1/(m-1)) sum_r (d_r - mean d)^2. The folds share m - 2 of their m - 1
      microbatches, so this spread is about 1/(m-1) of the sampling variance of one fold's d_r
      (g_{-r} - g_{-s} = (g_s - g_r)/(m-1)): the term is a tuned fraction of the delta method,
      not the delta method. ``per_fold``: (m - 1) Var_r(d_r), the delta method's variance of
      one fold's denominator (first order: (m-1)^2 Var_r(g_{-r}) = s^2, the sample variance
      of the g_j, and Var(g_{-r}) = s^2 / (m-1), carried through d by the same derivative).
    reference_pre_ema: use the reference code's 3/8 pre-EMA coefficient instead of 1/8.
    crossfit_alpha: partial cross-fit, x = (1-alpha) g_A^2 + alpha x_B (``ab`` forms). The
      ``post_ema``/``pre_ema`` corrections use alpha^2 Var(x_B), the variance of the part of x
      that B contributes (delta method on the statistic that enters v); ``reference_post_ema``
      uses Var(p_bar) of B's denominators unscaled, as the authors' code does.
    crossfit_alpha_adaptive: alpha = crossfit_alpha clip(cos(g_A^2, x_B), 0, 1) per tensor.
    update_clip: if > 0, clip every coordinate of u to [-c, c] (trust region).
    support_clip_tau: if > 0, u_k <- u_k min(1, sqrt(tau (x_k + 1e-12) / (g_Ak^2 + 1e-12))).
    std_warmup_steps: plain Adam on the full batch for the first K steps.
    skip_nonfinite: a tensor with a non-finite update gets a zero update and keeps its
      moments; the count is in ``state.skipped`` (the train step treats it as a skipped step).
    state_dtype: dtype of m and v (float32 by default, also for bf16 parameters).
    mu_dtype: dtype of m alone (as ``optax.adamw``'s ``mu_dtype``; None = ``state_dtype``),
      e.g. ``bfloat16`` to halve the first moment's memory. As in optax, b1 m + (1 - b1) g
      runs in float32 from the stored m, and m is rounded to ``mu_dtype`` when stored.

  Numeric arguments may be arrays (``optax.inject_hyperparams`` turns them into state).
  """
  correction = _resolve(mode, crossfit, correction, v_source)
  if crossfit_alpha_adaptive and crossfit not in ("ab", "rolling_b"):
    raise ValueError("crossfit_alpha_adaptive applies to crossfit='ab' or 'rolling_b'")
  spec = adam_bc_collector_spec(mode, crossfit, correction, v_source)
  state_dtype = jnp.dtype(state_dtype)
  mu_dtype = state_dtype if mu_dtype is None else jnp.dtype(mu_dtype)
  check_choice("loo_variance", loo_variance, LOO_VARIANCES)
  hyper = AdamBCHyper(b1, b2, eps, correction, v_source, correction_scale, reference_pre_ema,
                      crossfit_alpha, crossfit_alpha_adaptive, loo_variance)
  hp = lambda: {k: jnp.asarray(v, jnp.float32) for k, v in (("b1", b1), ("b2", b2), ("eps", eps))}
  is_zero = lambda v: isinstance(v, (int, float)) and v == 0

  def init_fn(params):
    z = lambda dt: lambda p: jnp.zeros(jnp.shape(p), dt)
    return ScaleByAdamBCState(jnp.zeros([], jnp.int32), jax.tree.map(z(mu_dtype), params),
                              jax.tree.map(z(state_dtype), params), jnp.zeros([], jnp.int32),
                              Static(spec), hp(), rule_dict(jnp.zeros(len(RULES), jnp.int32)))

  def update_fn(updates, state, params=None, *, bc_stats: Optional[BCStats] = None, **_):
    del params
    if mode != "std" and bc_stats is None:
      raise ValueError(f"scale_by_adam_bc(mode={mode!r}) needs bc_stats from "
                       "scaleopt.optim.collect; only mode='std' works without them")
    if mode != "std":
      check_numerator(updates, bc_stats, f"scale_by_adam_bc(mode={mode!r})")
    count_inc = optax.safe_increment(state.count)
    bc = bias_correction(b1, b2, count_inc)
    g = tmap(lambda x: x.astype(jnp.float32), updates)
    unclipped = unclipped_numerator(bc_stats, g)
    u, m_new, v_new, rules = directions(hyper, mode, crossfit, bc, g, unclipped, state, bc_stats)
    if mode in ("cf", "full") and crossfit in ("ab", "rolling_b") and not is_zero(support_clip_tau):
      u = support_clip(u, g, bc_stats, v_source, support_clip_tau)
    if not is_zero(update_clip):  # arrays under inject_hyperparams: 0 still means off
      u = tmap(lambda x: jnp.where(update_clip > 0, jnp.clip(x, -update_clip, update_clip), x), u)
    if not is_zero(std_warmup_steps):
      full = align(bc_stats.full, g) if bc_stats is not None else g
      adam = unzip(tmap(lambda *a: std_leaf(hyper, bc, *a), full, full, state.mu, state.nu), g, 3)
      warm = state.count < std_warmup_steps
      u, m_new, v_new = (tmap(lambda a, b_: jnp.where(warm, a, b_), x, y)
                         for x, y in zip(adam, (u, m_new, v_new)))
      rules = jnp.where(warm, 0, rules)
    skipped = jnp.zeros([], jnp.int32)
    if skip_nonfinite and mode != "std":
      u, (m_new, v_new), skipped = keep_finite(u, ((m_new, state.mu), (v_new, state.nu)))
    out = tmap(lambda x, ref: x.astype(ref.dtype), u, updates)
    cast = lambda tr, dt: tmap(lambda x: x.astype(dt), tr)
    return out, ScaleByAdamBCState(count_inc, cast(m_new, mu_dtype), cast(v_new, state_dtype),
                                   skipped, state.spec, hp(), rule_dict(rules))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def adamw_bc(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    *,
    mode: str = "full",
    crossfit: str = "loo",
    correction: Optional[str] = None,
    mask: Optional[Union[PyTree, Callable[[PyTree], PyTree]]] = None,
    sparse_filter: Optional[Callable[[PyTree], PyTree]] = None,
    sparse_learning_rate: Optional[optax.ScalarOrSchedule] = None,
    v_source: str = "sq_of_mean",
    correction_scale: float = 1.0,
    reference_pre_ema: bool = False,
    crossfit_alpha: float = 1.0,
    crossfit_alpha_adaptive: bool = False,
    loo_variance: str = "across_folds",
    update_clip: float = 0.0,
    support_clip_tau: float = 0.0,
    std_warmup_steps: int = 0,
    skip_nonfinite: bool = True,
    state_dtype: str = "float32",
    mu_dtype: Optional[str] = None,
) -> optax.GradientTransformationExtraArgs:
  """AdamW with bias correction: ``scale_by_adam_bc`` + decoupled weight decay + learning rate.

      theta <- theta - lr (u + wd theta)      (= theta (1 - lr wd) - lr u)

  Defaults: leave-one-out cross-fit with the Jensen correction (``mode="full"``,
  ``crossfit="loo"``), the form that trains best (docs/results.md). With ``mode="std"`` this is
  ``optax.adamw`` (same operations).

  Args:
    learning_rate: a float or an Optax schedule.
    b1, b2, eps, weight_decay: AdamW's hyperparameters (paper pretraining defaults).
    mask: weight-decay mask (a pytree of bools or a callable params -> pytree), as in
      ``optax.adamw``.
    sparse_filter: callable params -> pytree of bools marking sparse-support tensors (token
      embeddings, tied heads). Those are trained with plain AdamW on the step's own full-batch
      gradient (``bc_stats.full``) and ``sparse_learning_rate`` (default ``learning_rate``),
      through ``optax.partition``, as in the paper's hybrid LOO run.
    Others: see ``scale_by_adam_bc``.
  """
  dense = optax.chain(
      scale_by_adam_bc(b1, b2, eps, mode=mode, crossfit=crossfit, correction=correction,
                       v_source=v_source, correction_scale=correction_scale,
                       reference_pre_ema=reference_pre_ema, crossfit_alpha=crossfit_alpha,
                       crossfit_alpha_adaptive=crossfit_alpha_adaptive,
                       loo_variance=loo_variance,
                       update_clip=update_clip, support_clip_tau=support_clip_tau,
                       std_warmup_steps=std_warmup_steps, skip_nonfinite=skip_nonfinite,
                       state_dtype=state_dtype, mu_dtype=mu_dtype),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )
  if sparse_filter is None:
    return dense
  sparse = optax.chain(
      full_batch(scale_by_adam_bc(b1, b2, eps, mode="std", state_dtype=state_dtype,
                                  mu_dtype=mu_dtype)),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(
          learning_rate if sparse_learning_rate is None else sparse_learning_rate),
  )

  def labels(params):
    return jax.tree.map(lambda s: "sparse" if s else "dense", sparse_filter(params))

  return optax.partition({"dense": dense, "sparse": sparse}, labels)


def full_batch(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """Feeds ``bc_stats.full`` (when given) to ``inner`` instead of the numerator gradient:
  scaled by the numerator-only clip factor c (``bc_stats.numerator_clip``) as the first moment's
  input, unscaled as ``inner``'s ``bc_stats.numerator`` (its second-moment statistics)."""

  inner = optax.with_extra_args_support(inner)

  def update_fn(updates, state, params=None, *, bc_stats: Optional[BCStats] = None, **_):
    if bc_stats is None:
      return inner.update(updates, state, params)
    c = bc_stats.numerator_clip
    updates = tmap(lambda u, f: (c * f).astype(u.dtype), updates, align(bc_stats.full, updates))
    return inner.update(updates, state, params, bc_stats=bc_stats._replace(
        numerator=bc_stats.full))

  return optax.GradientTransformationExtraArgs(inner.init, update_fn)
