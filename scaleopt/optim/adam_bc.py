"""AdamW with the bias corrections of Nayak et al. (arXiv 2605.20756) as Optax transforms.

Plain Adam uses one minibatch for both the numerator and the preconditioner,

    u = m_hat / (sqrt(v_hat) + eps),   m <- b1 m + (1-b1) g,   v <- b2 v + (1-b2) g * g,

which carries two finite-sample biases. *Coupling*: g and v come from the same examples, so
E[g / sqrt(v)] != E[g] E[1/sqrt(v)]. *Inversion (Jensen)*: even with independent v, the
convex map T(x) = 1 / (sqrt(x) + eps) gives E[T(v)] > T(E v). The fixes:

* cross-fitting (``mode="cf"``): the numerator comes from microbatch group A, the
  preconditioner statistic from an independent group B (two-fold, symmetrized or
  leave-one-out, ``crossfit=``);
* variance-corrected inversion (``mode="inv"``): T_tilde(x) = T(x) - (1/2) T''(x) Var(x),
  with Var estimated from the spread of per-microbatch statistics, clamped at 0;
* ``mode="full"``: both.

With U = v_hat_t = a + b x (a = b2 v_{t-1} / (1 - b2^t), b = (1 - b2) / (1 - b2^t), x the
statistic entering v this step), D = sqrt(U) + eps and Var(x) from the collector:

    post_ema:  inv = max(0, 1/D - Var(D) / D^3),   Var(D) = b^2 Var(x) / (4 U)   (delta method)
    pre_ema:   inv = max(0, 1/D - b^2 Var(x) [1 / (4 U D^3) + 1 / (8 U^{3/2} D^2)])

(the pre-EMA coefficient is 1/8; the reference code's 3/8 is reproduced by
``reference_pre_ema=True``). The statistic x follows the paper's rule for persistent moments:
by default (``v_source="sq_of_mean"``) x = g_bar_B^2, the square of a group mean, with
Var(x) = 4 g_bar^2 Var(g_bar) + 2 Var(g_bar)^2 (exact for Gaussian g_bar); the reference A/B
code's mean of per-microbatch squares is ``v_source="mean_sq"``. All formulas and choices are
documented in docs/optim.md.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from scaleopt.optim.collect import BCStats, CollectorSpec

PyTree = Any
MaskedNode = optax.MaskedNode

MODES = ("std", "cf", "inv", "full")
CROSSFITS = ("ab", "symmetric", "loo")
CORRECTIONS = ("none", "post_ema", "pre_ema")
V_SOURCES = ("sq_of_mean", "mean_sq")


class ScaleByAdamBCState(NamedTuple):
  """State of ``scale_by_adam_bc``: step count and float32 first/second moments."""
  count: jax.Array
  mu: PyTree
  nu: PyTree


def _check(name: str, value, allowed):
  if value not in allowed:
    raise ValueError(f"{name}={value!r} is not allowed; choose one of {allowed}")


def _resolve(mode: str, crossfit: str, correction: Optional[str], v_source: str) -> str:
  _check("mode", mode, MODES)
  _check("crossfit", crossfit, CROSSFITS)
  _check("v_source", v_source, V_SOURCES)
  if correction is None:
    correction = "post_ema" if mode in ("inv", "full") else "none"
  _check("correction", correction, CORRECTIONS)
  if mode in ("inv", "full") and correction == "none":
    raise ValueError(f"mode={mode!r} applies a variance correction; correction must be "
                     f"'post_ema' or 'pre_ema', not 'none' (use mode='std' or 'cf' for none)")
  if mode in ("std", "cf") and correction != "none":
    raise ValueError(f"mode={mode!r} applies no variance correction but correction="
                     f"{correction!r}; use mode='inv' or 'full', or correction='none'")
  if crossfit == "loo" and v_source != "sq_of_mean" and mode in ("cf", "full"):
    raise ValueError("crossfit='loo' uses the square of the leave-one-out mean; "
                     "v_source must be 'sq_of_mean'")
  return correction


def adam_bc_spec(mode: str = "std", crossfit: str = "ab", correction: Optional[str] = None,
                 v_source: str = "sq_of_mean", rolling_b: bool = False, b1: float = 0.9,
                 b2: float = 0.999, eps: float = 1e-8) -> CollectorSpec:
  """The microbatch statistics ``scale_by_adam_bc`` with these settings needs.

  Returns a ``CollectorSpec`` for ``scaleopt.optim.collect``.
  """
  correction = _resolve(mode, crossfit, correction, v_source)
  var_of = None
  if correction != "none":
    var_of = "grad" if v_source == "sq_of_mean" else "sq"
  need_sq = v_source == "mean_sq"
  if mode in ("std", "inv"):
    return CollectorSpec(layout="all", var_of=var_of, need_sq=need_sq)
  if crossfit == "ab":
    return CollectorSpec(layout="rolling_b" if rolling_b else "ab", var_of=var_of,
                         need_sq=need_sq)
  if crossfit == "symmetric":
    return CollectorSpec(layout="symmetric", var_of=var_of, need_sq=need_sq)
  return CollectorSpec(layout="loo", fold_fn_factory=lambda opt_state: loo_fold_fn(
      find_adam_bc_state(opt_state), b1=b1, b2=b2, eps=eps))


def find_adam_bc_state(opt_state: PyTree) -> ScaleByAdamBCState:
  """The one ``ScaleByAdamBCState`` inside an optimizer state (chain, partition, ...)."""
  stop = lambda x: isinstance(x, (ScaleByAdamBCState, FullBatchState))
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=stop)
           if isinstance(x, ScaleByAdamBCState)]
  if len(found) != 1:
    raise ValueError(f"expected exactly one ScaleByAdamBCState in the optimizer state, found "
                     f"{len(found)}; pass opt_state of the chain that holds scale_by_adam_bc")
  return found[0]


def loo_fold_fn(state: ScaleByAdamBCState, b1: float, b2: float, eps: float) -> Callable:
  """Per-fold terms of the leave-one-out update (notes section 3.3).

  For fold r with g_{-r} = (m g_full - g_r) / (m - 1):

      m_hat_r = (b1 m_{t-1} + (1-b1) g_r) / (1 - b1^t)
      d_r     = sqrt(max(0, (b2 v_{t-1} + (1-b2) g_{-r}^2) / (1 - b2^t))) + eps

  returns ({"first": m_hat_r / d_r, "third": m_hat_r / d_r^3}, d_r). Parameters masked out
  of the Adam-BC partition (optax.MaskedNode in the state) get scalar zeros.
  """
  t = state.count.astype(jnp.float32) + 1.0
  bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t

  def fold(g_r, g_full, m):
    mu_l, td = jax.tree.flatten(state.mu, is_leaf=lambda x: isinstance(x, MaskedNode))
    nu_l = td.flatten_up_to(state.nu)
    gr_l, gf_l = td.flatten_up_to(g_r), td.flatten_up_to(g_full)
    first, third, ds = [], [], []
    for mu, nu, gr, gf in zip(mu_l, nu_l, gr_l, gf_l):
      if isinstance(mu, MaskedNode):
        z = jnp.zeros((), jnp.float32)
        first.append(z); third.append(z); ds.append(z)
        continue
      g_mr = (m * gf - gr) / (m - 1)
      m_hat = (b1 * mu + (1 - b1) * gr) / bc1
      v_hat = jnp.maximum((b2 * nu + (1 - b2) * g_mr * g_mr) / bc2, 0.0)
      d = jnp.sqrt(v_hat) + eps
      first.append(m_hat / d)
      third.append(m_hat / (d * d * d))
      ds.append(d)
    un = lambda l: jax.tree.unflatten(td, l)
    return {"first": un(first), "third": un(third)}, un(ds)

  return fold


def _inverse(v_hat, var_x, b, eps, correction, scale, reference_pre_ema):
  """Corrected 1 / (sqrt(v_hat) + eps); var_x = Var of the statistic entering v this step."""
  d = jnp.sqrt(v_hat) + eps
  inv = 1.0 / d
  if correction == "none":
    return inv
  u = jnp.maximum(v_hat, 1e-12)
  bv = (b * b) * var_x  # first, so that zero variance gives exactly zero correction
  if correction == "post_ema":
    corr = bv / (4.0 * u) / (d * d * d)
  else:
    k2 = 3.0 / 8.0 if reference_pre_ema else 1.0 / 8.0
    corr = bv * (1.0 / (4.0 * u * d * d * d) + k2 / (u * jnp.sqrt(u) * d * d))
  return jnp.maximum(inv - scale * corr, 0.0)


def _var_sq_of_mean(g_bar, var_g):
  """Var(g_bar^2) = 4 g_bar^2 Var(g_bar) + 2 Var(g_bar)^2 (Gaussian g_bar)."""
  return 4.0 * g_bar * g_bar * var_g + 2.0 * var_g * var_g


def scale_by_adam_bc(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    mode: str = "std",
    crossfit: str = "ab",
    correction: Optional[str] = None,
    v_source: str = "sq_of_mean",
    correction_scale: float = 1.0,
    reference_pre_ema: bool = False,
    crossfit_alpha: float = 1.0,
    update_clip: float = 0.0,
    support_clip_tau: float = 0.0,
    std_warmup_steps: int = 0,
    skip_nonfinite: bool = True,
    state_dtype: str = "float32",
) -> optax.GradientTransformationExtraArgs:
  """Adam's scaling with cross-fitting and variance-corrected inversion.

  ``update(updates, state, params=None, *, bc_stats=None)``: ``updates`` is the numerator
  gradient (``bc_stats.numerator``, possibly clipped by transforms chained in front);
  ``bc_stats`` is what ``scaleopt.optim.collect`` returned with ``adam_bc_spec(...)``.

  Modes (``crossfit`` picks the cross-fit form for ``cf``/``full``):

  * ``std``: Adam. Works without ``bc_stats`` and then equals ``optax.scale_by_adam``.
  * ``cf`` + ``ab``: m <- g_A, v <- x_B (x_B = g_bar_B^2 or mean_j g_Bj^2), u = m_hat / D.
  * ``inv``: all microbatches in one group, u = m_hat * inv(v_hat, Var(x)).
  * ``full`` + ``ab``: cross-fit and corrected inverse with Var from group B.
  * ``symmetric``: persistent m, v from the full batch; candidate moments per half,
    u = (m_hat_A inv_B + m_hat_B inv_A) / 2 (``full``: each inv corrected).
  * ``loo``: persistent m, v from the full batch; u = mean_r m_hat_r / d_r
    (``full``: minus correction_scale * Var_r(d_r) * mean_r m_hat_r / d_r^3, and coordinates
    whose sign the correction flips are zeroed).

  Args:
    b1, b2, eps: Adam's decay rates and epsilon (outside the square root).
    mode, crossfit, correction, v_source: see above and the module docstring.
    correction_scale: multiplies the subtracted delta-method term (1.0 = delta method).
    reference_pre_ema: use the reference code's 3/8 pre-EMA coefficient instead of 1/8.
    crossfit_alpha: partial cross-fit, x = (1-alpha) g_A^2 + alpha x_B (A/B form only).
    update_clip: if > 0, clip every coordinate of u to [-c, c] (trust region).
    support_clip_tau: if > 0, u_k <- u_k min(1, sqrt(tau (x_k + 1e-12) / (g_Ak^2 + 1e-12))).
    std_warmup_steps: run plain Adam on the full batch for the first K steps.
    skip_nonfinite: a tensor whose update is not finite gets a zero update and keeps its
      moments.
    state_dtype: dtype name of m and v (float32 by default, also for bf16 parameters).

  Numeric arguments may be arrays (``optax.inject_hyperparams`` turns them into state).
  """
  correction = _resolve(mode, crossfit, correction, v_source)
  state_dtype = jnp.dtype(state_dtype)
  maybe_warm = not (isinstance(std_warmup_steps, int) and std_warmup_steps == 0)
  if correction == "pre_ema" and mode == "full" and crossfit == "loo":
    raise ValueError("crossfit='loo' implements the post-EMA (fold-variance) correction only; "
                     "use correction='post_ema'")

  def init_fn(params):
    z = lambda p: jnp.zeros(jnp.shape(p), state_dtype)
    mu = jax.tree.map(z, params)
    return ScaleByAdamBCState(count=jnp.zeros([], jnp.int32), mu=mu,
                              nu=jax.tree.map(z, params))

  def update_fn(updates, state, params=None, *, bc_stats: Optional[BCStats] = None, **_):
    del params
    if mode != "std" and bc_stats is None:
      raise ValueError(f"scale_by_adam_bc(mode={mode!r}) needs bc_stats from "
                       "scaleopt.optim.collect; only mode='std' works without them")
    count_inc = optax.safe_increment(state.count)
    t = count_inc
    bc1 = 1 - b1 ** t
    bc2 = 1 - b2 ** t
    b = (1 - b2) / bc2  # weight of this step's statistic in v_hat

    is_masked = lambda x: isinstance(x, MaskedNode)
    g_l, td = jax.tree.flatten(updates, is_leaf=is_masked)
    mu_l, nu_l = td.flatten_up_to(state.mu), td.flatten_up_to(state.nu)
    st = bc_stats if mode != "std" or maybe_warm else None

    def flat(get):
      """Leaves of get(bc_stats) aligned with `updates` (Nones where not collected)."""
      try:
        tree = get(st) if st is not None else None
      except AttributeError:  # a group that the layout does not have
        tree = None
      return td.flatten_up_to(tree) if tree is not None else [None] * len(g_l)

    full_l = flat(lambda s: s.full)
    a_l, a_sq_l, a_var_l = (flat(lambda s: s.a.mean), flat(lambda s: s.a.sq),
                            flat(lambda s: s.a.var))
    b_mean_l, b_sq_l, b_var_l = (flat(lambda s: s.b.mean), flat(lambda s: s.b.sq),
                                 flat(lambda s: s.b.var))
    loo = st.loo if st is not None else None
    if mode in ("cf", "full") and crossfit == "loo":
      if loo is None:
        raise ValueError("crossfit='loo' needs bc_stats from a 'loo' collector layout")
      first_l, third_l, dvar_l = (flat(lambda s: s.loo.mean["first"]),
                                  flat(lambda s: s.loo.mean["third"]), flat(lambda s: s.loo.var))
    warm = (state.count < std_warmup_steps) if maybe_warm else None

    new_u, new_mu, new_nu = [], [], []
    for i, (g, mu, nu) in enumerate(zip(g_l, mu_l, nu_l)):
      if is_masked(g):
        new_u.append(g); new_mu.append(mu); new_nu.append(nu)
        continue
      out_dtype = g.dtype
      g = g.astype(state_dtype)

      def adam_std(g_num):
        m_ = (1 - b1) * g_num + b1 * mu
        v_ = (1 - b2) * (g_num ** 2) + b2 * nu
        m_hat = m_ / bc1.astype(m_.dtype)
        v_hat = v_ / bc2.astype(v_.dtype)
        return m_hat / (jnp.sqrt(v_hat + 0.0) + eps), m_, v_

      def statistic(g_bar, var_g, sq, var_sq):
        """x entering v this step and Var(x)."""
        if v_source == "sq_of_mean":
          return g_bar * g_bar, (None if var_g is None else _var_sq_of_mean(g_bar, var_g))
        if sq is None:
          raise ValueError("v_source='mean_sq' needs the mean of per-microbatch squares in "
                           "bc_stats (collector spec need_sq=True)")
        return sq, var_sq

      if mode == "std":
        u, m_new, v_new = adam_std(g)
      elif mode == "inv" or crossfit == "ab":
        if mode == "inv":
          x, var_x = statistic(g, b_var_l[i], b_sq_l[i], b_var_l[i])
        else:
          x, var_x = statistic(b_mean_l[i], b_var_l[i], b_sq_l[i], b_var_l[i])
          # partial cross-fit; alpha = 1 leaves x and Var(x) bit-identical
          x = (1 - crossfit_alpha) * (g * g) + crossfit_alpha * x
          var_x = None if var_x is None else (crossfit_alpha * crossfit_alpha) * var_x
        if correction != "none" and var_x is None:
          raise ValueError("a variance correction needs bc_stats with group variances "
                           "(collector spec from adam_bc_spec with the same settings)")
        m_new = (1 - b1) * g + b1 * mu
        v_new = (1 - b2) * x + b2 * nu
        m_hat = m_new / bc1.astype(m_new.dtype)
        v_hat = jnp.maximum(v_new / bc2.astype(v_new.dtype), 0.0)
        inv = _inverse(v_hat, var_x if correction != "none" else None, b, eps, correction,
                       correction_scale, reference_pre_ema)
        u = m_hat * inv
        if mode != "inv" and not (isinstance(support_clip_tau, (int, float))
                                  and support_clip_tau == 0):
          ratio = support_clip_tau * (x + 1e-12) / (g * g + 1e-12)
          u = jnp.where(support_clip_tau > 0, u * jnp.minimum(1.0, jnp.sqrt(ratio)), u)
      elif crossfit == "symmetric":
        # persistent moments from the full batch (numerator `updates` = g_full)
        m_new = (1 - b1) * g + b1 * mu
        v_new = (1 - b2) * (g * g) + b2 * nu
        def side(g_bar, var_g, sq, var_sq):
          x, var_x = statistic(g_bar, var_g, sq, var_sq)
          m_hat = ((1 - b1) * g_bar + b1 * mu) / bc1
          v_hat = jnp.maximum(((1 - b2) * x + b2 * nu) / bc2, 0.0)
          inv = _inverse(v_hat, var_x, b, eps, correction, correction_scale, reference_pre_ema)
          return m_hat, inv
        m_a, inv_a = side(a_l[i], a_var_l[i], a_sq_l[i], a_var_l[i])
        m_b, inv_b = side(b_mean_l[i], b_var_l[i], b_sq_l[i], b_var_l[i])
        u = 0.5 * (m_a * inv_b + m_b * inv_a)
      else:  # loo
        m_new = (1 - b1) * g + b1 * mu
        v_new = (1 - b2) * (g * g) + b2 * nu
        u_first = first_l[i]
        if correction != "none":
          u = u_first - correction_scale * dvar_l[i] * third_l[i]
          u = jnp.where(jnp.sign(u) != jnp.sign(u_first), 0.0, u)
        else:
          u = u_first
      if not (isinstance(update_clip, (int, float)) and update_clip == 0):
        u = jnp.where(update_clip > 0, jnp.clip(u, -update_clip, update_clip), u)
      if warm is not None:
        u_w, m_w, v_w = adam_std(full_l[i] if full_l[i] is not None else g)
        u = jnp.where(warm, u_w, u)
        m_new = jnp.where(warm, m_w, m_new)
        v_new = jnp.where(warm, v_w, v_new)
      if skip_nonfinite and mode != "std":
        ok = jnp.all(jnp.isfinite(u))
        u = jnp.where(ok, u, 0.0)
        m_new = jnp.where(ok, m_new, mu)
        v_new = jnp.where(ok, v_new, nu)
      new_u.append(u.astype(out_dtype))
      new_mu.append(m_new.astype(state_dtype))
      new_nu.append(v_new.astype(state_dtype))

    un = lambda l: jax.tree.unflatten(td, l)
    return un(new_u), ScaleByAdamBCState(count=count_inc, mu=un(new_mu), nu=un(new_nu))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def adamw_bc(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    *,
    mode: str = "std",
    crossfit: str = "ab",
    correction: Optional[str] = None,
    mask: Optional[Union[PyTree, Callable[[PyTree], PyTree]]] = None,
    sparse_filter: Optional[Callable[[PyTree], PyTree]] = None,
    sparse_learning_rate: Optional[optax.ScalarOrSchedule] = None,
    v_source: str = "sq_of_mean",
    correction_scale: float = 1.0,
    reference_pre_ema: bool = False,
    crossfit_alpha: float = 1.0,
    update_clip: float = 0.0,
    support_clip_tau: float = 0.0,
    std_warmup_steps: int = 0,
    skip_nonfinite: bool = True,
    state_dtype: str = "float32",
) -> optax.GradientTransformationExtraArgs:
  """AdamW with bias correction: ``scale_by_adam_bc`` + decoupled weight decay + learning rate.

      theta <- theta - lr (u + wd theta)      (= theta (1 - lr wd) - lr u)

  With ``mode="std"`` and ``correction="none"`` this is ``optax.adamw`` (same operations).

  Args:
    learning_rate: a float or an Optax schedule.
    b1, b2, eps, weight_decay: AdamW's hyperparameters (paper pretraining defaults).
    mode, crossfit, correction: see ``scale_by_adam_bc``.
    mask: weight-decay mask (a pytree of bools or a callable params -> pytree), as in
      ``optax.adamw``.
    sparse_filter: callable params -> pytree of bools marking sparse-support tensors (token
      embeddings, tied heads). Those are trained with plain AdamW on the full-batch gradient
      (``bc_stats.full``) and ``sparse_learning_rate`` (default ``learning_rate``), through
      ``optax.partition``, as in the paper's hybrid LOO run.
    v_source, correction_scale, reference_pre_ema, crossfit_alpha, update_clip,
    support_clip_tau, std_warmup_steps, skip_nonfinite, state_dtype: see
      ``scale_by_adam_bc`` (explicit so that ``optax.inject_hyperparams`` sees them).
  """
  dense = optax.chain(
      scale_by_adam_bc(b1, b2, eps, mode=mode, crossfit=crossfit, correction=correction,
                       v_source=v_source, correction_scale=correction_scale,
                       reference_pre_ema=reference_pre_ema, crossfit_alpha=crossfit_alpha,
                       update_clip=update_clip, support_clip_tau=support_clip_tau,
                       std_warmup_steps=std_warmup_steps, skip_nonfinite=skip_nonfinite,
                       state_dtype=state_dtype),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate),
  )
  if sparse_filter is None:
    return dense
  sparse = optax.chain(
      _full_batch(scale_by_adam_bc(b1, b2, eps, mode="std", state_dtype=state_dtype)),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(
          learning_rate if sparse_learning_rate is None else sparse_learning_rate),
  )

  def labels(params):
    return jax.tree.map(lambda s: "sparse" if s else "dense", sparse_filter(params))

  return optax.partition({"dense": dense, "sparse": sparse}, labels)


class FullBatchState(NamedTuple):
  """State of the sparse (full-batch AdamW) branch of ``adamw_bc``."""
  inner: PyTree


def _full_batch(inner: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """Feeds ``bc_stats.full`` (when given) to ``inner`` instead of the numerator gradient."""

  def init_fn(params):
    return FullBatchState(inner.init(params))

  def update_fn(updates, state, params=None, *, bc_stats: Optional[BCStats] = None, **_):
    if bc_stats is not None:
      is_masked = lambda x: isinstance(x, MaskedNode)
      u_l, td = jax.tree.flatten(updates, is_leaf=is_masked)
      f_l = td.flatten_up_to(bc_stats.full)
      updates = jax.tree.unflatten(
          td, [u if is_masked(u) else f.astype(u.dtype) for u, f in zip(u_l, f_l)])
    updates, new = inner.update(updates, state.inner, params)
    return updates, FullBatchState(new)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
