"""The factors' updates: statistics EMAs, roots on root steps, host offload of L and R."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import optax

from scaleopt.optim import phases
from scaleopt.optim.collect import BCStats
from scaleopt.optim.shampoo_lib.blocking import block_grams, to_blocks
from scaleopt.optim.shampoo_lib.options import resolve_root_method
from scaleopt.optim.shampoo_lib.placement import (batched_by_size, on_owner, to_device, to_host,
                                                  in_host_memory)
from scaleopt.optim.shampoo_lib.roots import (eig_counts, eigh_damped, newton_root_unconverged,
                                              root_from_eig)
from scaleopt.optim.shampoo_lib.state import RULES, no_rules


def _roots(f, keys, pre, *, root_method, damping, floor, newton_iters, newton_precision,
           correction_scale, d_max, eigh_implementation):
  """(factors with new P_L, P_R, counts of ``RULES``) for every factor (batched over blocks
  and tensors of one size); with ``pre.eig_L`` (two-pass form) the collector's corrected
  eigenvalues. A factor whose new roots are not all finite keeps its previous ones."""
  eig_kw = dict(floor=floor, correction_scale=correction_scale, d_max=d_max)

  def from_eig(lam, q, var=None):  # (root, per-matrix counts: unconverged, floor, 0, d_max)
    c = eig_counts(lam, var, **eig_kw)
    root = root_from_eig(lam, q, var, correction_scale=correction_scale, d_max=d_max)
    return root, jnp.concatenate([jnp.zeros_like(c[..., :1]), c], axis=-1)

  if pre is not None and pre.eig_L is not None:
    out = {(s, k): from_eig(*eig[k], var[k]) for s, eig, var in
           (("L", pre.eig_L, pre.var_L), ("R", pre.eig_R, pre.var_R)) for k in keys}
  else:
    mats = {**{("L", k): f[k].L for k in keys}, **{("R", k): f[k].R for k in keys}}
    if resolve_root_method(root_method, d_max=d_max,
                           eigh_implementation=eigh_implementation) == "eigh":
      fn = lambda x: from_eig(*eigh_damped(x, damping, floor, eigh_implementation))
    else:
      def fn(x):
        root, bad = newton_root_unconverged(x, damping, 4, newton_iters, newton_precision)
        return root, jnp.pad(bad.astype(jnp.int32)[..., None], ((0, 0), (0, 3)))
    out = batched_by_size(mats, fn)
  finite = {sk: jnp.all(jnp.isfinite(r)) for sk, (r, _) in out.items()}
  counts = sum(jnp.sum(c, axis=0, dtype=jnp.int32) for _, c in out.values())
  replaced = sum(jnp.where(ok, 0, out[sk][0].shape[0]) for sk, ok in finite.items())
  rules = dict(zip(RULES, [counts[0], jnp.asarray(replaced, jnp.int32), *counts[1:]]))
  new = lambda s, k, old: on_owner(jnp.where(finite[(s, k)], out[(s, k)][0], old))
  fac = {k: f[k]._replace(PL=new("L", k, f[k].PL), PR=new("R", k, f[k].PR)) for k in keys}
  return fac, rules


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
    return {k: v._replace(L=to_device(v.L), R=to_device(v.R)) for k, v in f.items()}

  def store(new, old, f, step_ok):
    if not offload or not new:
      return new
    ok = jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for v in new.values() for x in (v.L, v.R)]))
    ok = ok & step_ok

    def keep(n, o, where):
      x = on_owner(jnp.where(ok, n, o))
      return to_host(x) if in_host_memory(where) else x

    return {k: v._replace(L=keep(v.L, old[k].L, f[k].L), R=keep(v.R, old[k].R, f[k].R))
            for k, v in new.items()}

  return load, store


def update_factors(f, g_l, blk, keys, count, pre, step_ok, *, mode, stats_every, root_every,
                    b2, stats_precision, offload, root_kw):
  """(factors after this step, counts of ``RULES``): std takes the statistics of the step's
  gradient every ``stats_every`` steps and the roots every ``root_every`` steps (from the new
  statistics when both fall on one step, on the same device copy); BC modes take B's
  statistics and the roots on the collector's root steps. With ``offload`` L, R come to the
  device once per step that uses them. Steps without roots count nothing."""
  if not keys:
    return f, no_rules()
  load, store = _statistics_io(offload)
  roots = lambda d: _roots(d, keys, pre, **root_kw)
  unchanged = lambda d: (d, no_rules())
  if mode != "std":
    def refresh(f):
      old = load(f)
      new, rules = roots(_ema_factors(old, keys, pre.stat_L, pre.stat_R, b2))
      return store(new, old, f, step_ok), rules
    return phases.cond(pre.root, refresh, unchanged, f)
  is_root = phases.due(count, root_every)

  def statistics(f):
    gram = {k: block_grams(on_owner(to_blocks(g_l[int(k)], blk[k])), stats_precision) for k in keys}
    old = load(f)
    new = _ema_factors(old, keys, {k: v[0] for k, v in gram.items()},
                       {k: v[1] for k, v in gram.items()}, b2)
    new, rules = phases.cond(is_root, roots, unchanged, new)
    return store(new, old, f, step_ok), rules

  def roots_only(f):  # L, R read, not changed: they stay where they are kept
    def run(f):
      new, rules = roots(load(f))
      return {k: new[k]._replace(L=f[k].L, R=f[k].R) for k in keys}, rules
    return phases.cond(is_root, run, unchanged, f)

  if stats_every == 1:
    return statistics(f)
  return phases.cond(phases.due(count, stats_every), statistics, roots_only, f)


def step_is_finite(bc_stats: Optional[BCStats]) -> jax.Array:
  """False when ``bc_stats`` reports a non-finite loss or gradient: a step the trainer skips."""
  if bc_stats is None:
    return jnp.bool_(True)
  ok = jnp.isfinite(bc_stats.loss)
  return ok if bc_stats.full is None else ok & jnp.isfinite(optax.global_norm(bc_stats.full))
