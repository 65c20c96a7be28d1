"""Work done every N steps: a branch on the device, or one the host picks.

Transforms that do extra work every N steps (Shampoo's statistics and roots, Sophia's
curvature refresh, the collectors' refresh steps) ask ``due(count, every)`` and branch with
``cond(pred, work, skip, *operands)``::

  pred = (count + offset) % every == 0

By default ``due`` returns that traced boolean and ``cond`` is ``lax.cond``: one program, the
device decides. On a GPU the runtime copies every ``lax.cond`` predicate to the host before it
launches the branch, so the host cannot dispatch ahead of the device and the step waits for the
launches after each branch. Under ``static(outcomes)``, a trace-time context, ``due`` returns
the Python bool the caller chose for that schedule and ``cond`` traces only the branch taken:
a program without device branches. ``record()`` collects the ``Schedule``s a traced function
asks about, so a caller can compile one program per combination of outcomes and pick one per
step from counters it keeps on the host (``scaleopt.train`` does this on GPUs,
``run.host_phases``).

A transform's ``count`` must count the updates it applied (as optax counts do): a host that
mirrors it then knows every outcome without reading the device. ``counter`` names what the
value counts (``"count"``: applied optimizer updates; ``"step"``: the trainer's steps).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, NamedTuple, Optional

import jax
import numpy as np


class Schedule(NamedTuple):
  """Work is due when ``(value + offset) % every == 0``; ``value`` counts ``counter``."""
  counter: str
  every: int
  offset: int = 0

  def due_at(self, value: int) -> bool:
    return (int(value) + self.offset) % self.every == 0


class _Context(threading.local):
  recording: Optional[set] = None
  outcomes: Optional[dict] = None


_ctx = _Context()


def due(value, every: int, *, counter: str = "count", offset: int = 0):
  """True where ``(value + offset) % every == 0``: a traced bool, or under ``static`` the
  Python bool chosen for this schedule."""
  try:
    sched = Schedule(counter, int(every), int(offset))
  except (TypeError, jax.errors.ConcretizationTypeError):  # a traced period: device only
    return (value + offset) % every == 0
  if _ctx.recording is not None:
    _ctx.recording.add(sched)
  if _ctx.outcomes is not None and sched in _ctx.outcomes:
    return bool(_ctx.outcomes[sched])
  return (value + offset) % every == 0


def cond(pred, true_fn: Callable, false_fn: Callable, *operands):
  """``lax.cond``, or the branch itself when ``pred`` is a Python bool (``due`` under
  ``static``)."""
  if isinstance(pred, (bool, np.bool_)):
    return (true_fn if pred else false_fn)(*operands)
  return jax.lax.cond(pred, true_fn, false_fn, *operands)


@contextlib.contextmanager
def record() -> Iterator[set]:
  """Collects the ``Schedule`` of every ``due`` traced inside (both branches of a device
  ``cond`` are traced, so one trace without ``static`` finds them all)."""
  prev, _ctx.recording = _ctx.recording, set()
  try:
    yield _ctx.recording
  finally:
    _ctx.recording = prev


@contextlib.contextmanager
def static(outcomes: dict) -> Iterator[None]:
  """Inside, ``due`` returns ``outcomes[schedule]`` (a Python bool) for the schedules given;
  others stay on the device."""
  prev, _ctx.outcomes = _ctx.outcomes, dict(outcomes)
  try:
    yield
  finally:
    _ctx.outcomes = prev
