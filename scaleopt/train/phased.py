"""One compiled train step per outcome of the step's every-N work, picked by the host.

The optimizer's periodic work (Shampoo's statistics and roots, Sophia's curvature refresh,
the collectors' refresh steps) and the trainer's telemetry branch on step counters
(``scaleopt.optim.phases``). Compiled as one program those are device branches, and on a GPU
the runtime copies each branch predicate to the host before it launches the branch: the host
cannot dispatch the next step while the current one runs, and the launches after each branch
wait for it. ``PhasedStep`` compiles one program per combination of outcomes instead (Shampoo
with roots every 10 steps: a root program and a plain one), and ``Dispatcher`` picks one per
step from the counters the host keeps (``run.host_phases``, on by default on GPUs):

* ``step``, the trainer's step: exact.
* ``count``, the optimizer's applied updates: it advances on every step but a skipped
  (non-finite) one, and the loop learns that a step was skipped two steps later. A skip thus
  shifts the count predicted for the two steps dispatched meanwhile (one of them may do the
  work one step early, or not do it when its true count calls for it), and when the skipped
  step was one that did the work (its result was discarded with the step), the first step
  dispatched after the skip is known does it again.

Without skips every step computes what the one-program step computes; ``shifts`` counts the
steps whose outcomes differed from the optimizer's true count.
"""

from __future__ import annotations

import collections
import functools
import math
import sys
from typing import Any, Callable, Iterable

import jax
import numpy as np

from scaleopt.optim import phases
from scaleopt.train import checkpoint, faults

_AHEAD = 4096  # at most this many steps are scanned for the outcomes to compile ahead


class PhasedStep:
  """``step_fn`` compiled once per combination of outcomes of the schedules it asks about
  (found, when first asked for, by tracing it once with device branches)."""

  def __init__(self, step_fn: Callable, jit_kwargs: dict, state_shape: Any, batch_shape: Any):
    self._fn, self._jit_kwargs = step_fn, jit_kwargs
    self._shapes = (state_shape, batch_shape)
    self._jitted, self._compiled = {}, {}

  @functools.cached_property
  def schedules(self) -> tuple:
    with phases.record() as found:
      jax.eval_shape(self._fn, *self._shapes)
    return tuple(sorted(found))

  @property
  def period(self) -> int:
    return math.lcm(*(s.every for s in self.schedules)) if self.schedules else 1

  def key(self, counters: dict) -> tuple:
    """The outcome of every schedule at these counter values."""
    return tuple(s.due_at(counters[s.counter]) for s in self.schedules)

  def keys_ahead(self, step: int, count: int, until: int) -> list:
    """The distinct outcomes of the steps from ``step`` (at optimizer count ``count``) up to
    ``until`` if none is skipped, over at most one period of the schedules."""
    n = max(0, min(until - step, self.period, _AHEAD))
    return list(dict.fromkeys(self.key({"step": step + i, "count": count + i})
                              for i in range(n)))

  def _program(self, key: tuple):
    if key not in self._jitted:
      outcomes = dict(zip(self.schedules, key))

      def fn(state, batch):
        with phases.static(outcomes):
          return self._fn(state, batch)

      self._jitted[key] = jax.jit(fn, **self._jit_kwargs)
    return self._jitted[key]

  def compile(self, keys: Iterable[tuple], state_arg: Any, batch_arg: Any) -> None:
    """Compiles the programs of ``keys`` now, one after another (abstract arguments with
    shardings), for their memory analysis (``side_by_side_bytes``).

    The steps run through the jitted functions, not these ahead-of-time executables: an
    executable whose step holds cuDNN attention may fail at its first run while it loads its
    cuDNN graphs, where the jitted call runs."""
    for k in dict.fromkeys(keys):
      if k not in self._compiled:
        self._compiled[k] = self._program(k).lower(state_arg, batch_arg).compile()

  @property
  def programs(self) -> int:
    return len(self._compiled)

  def side_by_side_bytes(self) -> int:
    """Device bytes per device if the compiled programs' temporaries sit side by side, with
    the arguments and the outputs that do not reuse them. The device allocator keeps one
    program's temporaries where its last run put them and allocates the batches of later
    steps around them, so a program whose temporaries are larger than any earlier one's can
    find no gap wide enough unless the pool holds them all."""
    ma = [c.memory_analysis() for c in self._compiled.values()]
    if not ma or any(m is None for m in ma):
      return 0
    top = max(ma, key=lambda m: m.argument_size_in_bytes + m.output_size_in_bytes)
    return (top.argument_size_in_bytes + top.output_size_in_bytes - top.alias_size_in_bytes
            + sum(m.temp_size_in_bytes for m in ma))

  def __call__(self, key: tuple, state, batch):
    return self._program(key)(state, batch)


class Dispatcher:
  """Runs each step with the program its predicted counters pick; ``confirm`` each step's
  skip flag, in order, when the loop reads it."""

  def __init__(self, phased: PhasedStep, step: int, count: int):
    self.phased, self.step, self.count = phased, step, count
    self.true_count = count  # of the oldest unconfirmed step
    self.shifts = 0
    self.fresh = False  # the last step ran a program for the first time
    self._ran: set = set()
    self._sent: collections.deque = collections.deque()  # (key, step) not yet confirmed
    self._redo = None

  def _next_key(self) -> tuple:
    key = self.phased.key({"step": self.step, "count": self.count})
    if self._redo is not None:
      key = tuple(a or b for a, b in zip(key, self._redo))
    return key

  @property
  def next_fresh(self) -> bool:
    """The next step will run a program for the first time."""
    return self._next_key() not in self._ran

  def __call__(self, state, batch):
    key, self._redo = self._next_key(), None
    self._sent.append((key, self.step))
    self.fresh = key not in self._ran
    self._ran.add(key)
    self.step += 1
    self.count += 1
    return self.phased(key, state, batch)

  def confirm(self, skipped: bool) -> None:
    """The oldest dispatched step was (not) skipped."""
    key, step = self._sent.popleft()
    if key != self.phased.key({"step": step, "count": self.true_count}):
      self.shifts += 1
    if not skipped:
      self.true_count += 1
      return
    self.count -= 1
    redo = tuple(k and s.counter == "count" for k, s in zip(key, self.phased.schedules))
    if any(redo):
      self._redo = redo


class OneProgram:
  """The one-program step (device branches) behind ``Dispatcher``'s interface."""
  shifts = 0
  fresh = False  # the loop times the first step's compile itself

  def __init__(self, step_fn: Callable):
    self._fn = step_fn
    self.next_fresh = True

  def __call__(self, state, batch):
    self.next_fresh = False
    return self._fn(state, batch)

  def confirm(self, skipped: bool) -> None:
    del skipped


def make_stepper(fns, state, step0: int, steps: int, abstract_batch):
  """``step(state, batch) -> (state, metrics)`` with ``step.confirm(skipped)``, called with
  each step's skip flag in order: the one-program step of ``fns`` (``loop.Compiled``), or,
  where ``fns.phased`` holds host-picked programs, a ``Dispatcher`` over them with the programs
  of steps ``step0..steps`` compiled now. Falls back to the one program (with a note) when
  those programs do not fit a device's memory pool side by side."""
  if fns.phased is None or not fns.phased.schedules:
    return OneProgram(fns.train_step)
  count0 = step0 - int(jax.device_get(state.skipped))  # the optimizer's applied updates
  fns.phased.compile(fns.phased.keys_ahead(step0, count0, steps),
                     checkpoint.abstract(fns.state_shape, fns.state_sh), abstract_batch)
  need = fns.phased.side_by_side_bytes()
  limit = faults.pool_bytes()
  fits = not (limit and need > 0.97 * limit)
  if jax.process_count() > 1:  # every process runs the same programs
    from jax.experimental import multihost_utils
    fits = bool(np.all(multihost_utils.process_allgather(np.array(fits))))
  if fits:
    return Dispatcher(fns.phased, step0, count0)
  if jax.process_index() == 0:
    print(f"run.host_phases: the {fns.phased.programs} step programs need "
          f"{need / 2**30:.1f} GiB per device side by side, more than a device's memory "
          f"pool holds; running one program with device branches", file=sys.stderr)
  return OneProgram(fns.train_step)
