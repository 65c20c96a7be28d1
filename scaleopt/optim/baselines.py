"""Baseline optimizers through optax's own implementations: Lion, Adafactor, schedule-free AdamW.

No update rule is re-implemented here; each factory maps the config's shared keys onto the
optax alias (``build`` registers them as ``lion``, ``adafactor``, ``schedule_free_adamw``):

* ``lion``: ``optax.lion`` (Chen et al. 2023), u = sign(b1 m + (1 - b1) g),
  m <- b2 m + (1 - b2) g, theta <- theta (1 - lr wd) - lr u. Betas (0.9, 0.99) unless set;
  ``extra.mu_dtype``. Lion's update has unit RMS, so its learning rate is smaller than AdamW's
  and its weight decay larger by the same factor (same lr * wd).
* ``adafactor``: ``optax.adafactor`` (Shazeer & Stern 2018) with its defaults (factored second
  moment for dims >= 128, decay_rate 0.8, update clipping 1.0, relative step size
  ``multiply_by_parameter_scale``, no momentum unless ``b1`` is set, eps 1e-30 unless set).
  ``weight_decay`` is decoupled and scaled by the schedule, theta <- theta (1 - lr(t) wd),
  as for AdamW (optax's own ``weight_decay_rate`` is an absolute per-step rate; the factory
  passes it the schedule ``wd * lr(t)``). ``b2`` has no meaning here (``extra.decay_rate``).
* ``schedule_free_adamw``: ``optax.contrib.schedule_free`` around optax's momentum-free AdamW
  chain, exactly as ``optax.contrib.schedule_free_adamw`` builds it, with decoupled weight
  decay under the model's ``wd_mask`` (optax's alias decays every tensor). Betas (0.9, 0.999)
  unless set. The schedule must have no decay (``schedule.kind: constant``, warmup allowed):
  schedule-free replaces it by averaging. The trained parameters are the gradient point y;
  the averaged point x that the method evaluates is ``eval_params(opt_state, params)``
  (x = (y - (1 - b1) z) / b1), which the trainer uses for its eval loss.
"""

from __future__ import annotations

from typing import Any

import jax
import optax
from optax import contrib

PyTree = Any


def lion(cfg, lr, *, wd_mask, sparse_filter) -> optax.GradientTransformation:
  """``optax.lion`` with the config's b1, b2 (default 0.9, 0.99), weight decay and mask."""
  del sparse_filter
  b = {"b1": 0.9, "b2": 0.99, **cfg.betas()}
  if "eps" in b:
    raise ValueError(f"optimizer.eps={b['eps']!r} is not used by name='lion' (remove it)")
  return optax.lion(lr, b["b1"], b["b2"], weight_decay=cfg.weight_decay, mask=wd_mask,
                    **cfg.extra)


def adafactor(cfg, lr, *, wd_mask, sparse_filter) -> optax.GradientTransformation:
  """``optax.adafactor`` with momentum ``b1`` (None: off), ``eps`` and decoupled weight decay
  lr(t) * weight_decay under ``wd_mask``; ``extra``: adafactor's own keywords."""
  del sparse_filter
  b = cfg.betas()
  if "b2" in b:
    raise ValueError(f"optimizer.b2={b['b2']!r} is not used by name='adafactor' (its second "
                     "moment's rate is optimizer.extra.decay_rate)")
  wd = float(cfg.weight_decay)
  decay = (lambda n: wd * lr(n)) if callable(lr) else wd * lr
  kw = {"momentum": b.get("b1"), **({"eps": b["eps"]} if "eps" in b else {})}
  return optax.adafactor(lr, **kw, weight_decay_rate=decay if wd > 0 else None,
                         weight_decay_mask=wd_mask, **cfg.extra)


def schedule_free_adamw(cfg, lr, *, wd_mask, sparse_filter) -> optax.GradientTransformation:
  """``optax.contrib.schedule_free`` of momentum-free AdamW (``schedule_free_adamw``'s chain)
  with decoupled weight decay under ``wd_mask``; ``extra``: ``weight_lr_power``,
  ``state_dtype``."""
  del sparse_filter
  if cfg.schedule.kind != "constant":
    raise ValueError(f"optimizer.schedule.kind={cfg.schedule.kind!r}: name="
                     "'schedule_free_adamw' needs 'constant' (warmup allowed; schedule-free "
                     "averaging replaces the decay)")
  b = {"b1": 0.9, "b2": 0.999, "eps": 1e-8, **cfg.betas()}
  if not b["b1"] > 0:
    raise ValueError(f"optimizer.b1={b['b1']!r} must be > 0 for name='schedule_free_adamw'")
  base = optax.chain(
      optax.scale_by_rms(decay=b["b2"], eps=b["eps"], eps_in_sqrt=False, bias_correction=True),
      optax.add_decayed_weights(cfg.weight_decay, wd_mask),
      optax.scale_by_learning_rate(lr))
  return contrib.schedule_free(base, learning_rate=lr, b1=b["b1"], **cfg.extra)


def _is_sf(x) -> bool:
  return isinstance(x, contrib.ScheduleFreeState)


def eval_params(opt_state: PyTree, params: PyTree) -> PyTree:
  """The parameters to evaluate: schedule-free's averaged point x when ``opt_state`` holds a
  ``ScheduleFreeState`` (``optax.contrib.schedule_free_eval_params``), else ``params``."""
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=_is_sf) if _is_sf(x)]
  if not found:
    return params
  return contrib.schedule_free_eval_params(found[0], params)
