"""Learning-rate schedules from a small config: cosine, warmup-stable-decay, constant.

All three start with a linear warmup from 0 to the peak ``learning_rate`` over
``warmup_steps`` (lr(0) = 0, lr(warmup_steps) = peak; no warmup when it is 0), then:

* ``cosine``:   lr(t) = floor + (peak - floor) (1 + cos(pi s)) / 2,  s = (t - w) / (T - w),
  reaching floor = ``min_lr_ratio`` * peak at ``total_steps`` = T and staying there.
* ``wsd``:      constant peak until the last ``decay_fraction`` * T steps, then a linear decay
  to floor = ``min_lr_ratio`` * peak at T (Hu et al. 2024, "MiniCPM"; the decay shape is
  ``decay_shape``: ``linear`` or ``cosine``).
* ``constant``: peak after warmup.

``make_schedule`` accepts a plain dict or a ``ScheduleConfig``; unknown keys and bad values
raise ``ValueError`` naming the key and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Union

import jax.numpy as jnp
import optax

KINDS = ("cosine", "wsd", "constant")
DECAY_SHAPES = ("linear", "cosine")


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
  """Learning-rate schedule (see the module docstring for the formulas)."""
  kind: str = "cosine"
  warmup_steps: int = 0
  total_steps: int = 1000
  min_lr_ratio: float = 0.0
  decay_fraction: float = 0.2
  decay_shape: str = "linear"

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"schedule.kind={self.kind!r} is not allowed; choose one of {KINDS}")
    if self.decay_shape not in DECAY_SHAPES:
      raise ValueError(f"schedule.decay_shape={self.decay_shape!r} is not allowed; choose one "
                       f"of {DECAY_SHAPES}")
    for name in ("warmup_steps", "total_steps"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"schedule.{name}={v!r} must be an integer >= 0")
    if self.kind != "constant" and self.total_steps < 1:
      raise ValueError(f"schedule.total_steps={self.total_steps!r} must be >= 1 for "
                       f"kind={self.kind!r}")
    if self.kind != "constant" and self.warmup_steps > self.total_steps:
      raise ValueError(f"schedule.warmup_steps={self.warmup_steps} must be <= "
                       f"schedule.total_steps={self.total_steps}")
    if not _is_num(self.min_lr_ratio) or not 0.0 <= self.min_lr_ratio <= 1.0:
      raise ValueError(f"schedule.min_lr_ratio={self.min_lr_ratio!r} must be a number in [0, 1]")
    if not _is_num(self.decay_fraction) or not 0.0 <= self.decay_fraction <= 1.0:
      raise ValueError(f"schedule.decay_fraction={self.decay_fraction!r} must be a number in "
                       "[0, 1]")
    if self.kind == "wsd":
      decay = int(round(self.decay_fraction * self.total_steps))
      if self.warmup_steps + decay > self.total_steps:
        raise ValueError(f"schedule: warmup_steps ({self.warmup_steps}) + decay_fraction * "
                         f"total_steps ({decay}) exceeds total_steps ({self.total_steps})")

  @classmethod
  def from_dict(cls, d: Union[Mapping[str, Any], "ScheduleConfig", None]) -> "ScheduleConfig":
    if d is None:
      return cls()
    if isinstance(d, ScheduleConfig):
      return d
    if not isinstance(d, Mapping):
      raise ValueError(f"schedule must be a mapping or ScheduleConfig, got {type(d).__name__}")
    allowed = tuple(f.name for f in dataclasses.fields(cls))
    for k in d:
      if k not in allowed:
        raise ValueError(f"schedule.{k} is not a known key; allowed keys: {allowed}")
    return cls(**dict(d))


def _is_num(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def make_schedule(schedule_cfg: Union[Mapping[str, Any], ScheduleConfig, None],
                  learning_rate: float) -> optax.Schedule:
  """An Optax schedule ``step -> lr`` (jit-compatible) for a schedule config and peak lr."""
  if not _is_num(learning_rate) or learning_rate < 0:
    raise ValueError(f"learning_rate={learning_rate!r} must be a number >= 0")
  c = ScheduleConfig.from_dict(schedule_cfg)
  peak = float(learning_rate)
  floor = peak * float(c.min_lr_ratio)
  w = c.warmup_steps

  def warm(step):
    return peak * jnp.minimum(step.astype(jnp.float32) / max(w, 1), 1.0)

  if c.kind == "constant":
    def sched(step):
      step = jnp.asarray(step)
      return warm(step) if w > 0 else jnp.full(step.shape, peak, jnp.float32)
    return sched

  T = c.total_steps
  if c.kind == "cosine":
    decay_start, decay_len = w, max(T - w, 1)
    shape = "cosine"
  else:
    decay_len = int(round(c.decay_fraction * T))
    decay_start = T - decay_len
    decay_len = max(decay_len, 1)
    shape = c.decay_shape

  def sched(step):
    step = jnp.asarray(step)
    s = jnp.clip((step.astype(jnp.float32) - decay_start) / decay_len, 0.0, 1.0)
    if shape == "cosine":
      frac = 0.5 * (1.0 + jnp.cos(math.pi * s))
    else:
      frac = 1.0 - s
    main = floor + (peak - floor) * frac
    if w > 0:
      return jnp.where(step < w, warm(step), main)
    return main

  return sched
