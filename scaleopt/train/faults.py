"""How a run ends other than by finishing: too many non-finite steps, a signal, out of memory.

``Signals`` turns SIGTERM / SIGINT into a stop the host loop checks between steps;
``out_of_memory`` turns XLA's out-of-memory error into one line that names the settings that
lower the memory. ``scaleopt train`` exits with ``EXIT_SKIPS`` / ``EXIT_SIGNAL`` for them.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from typing import Optional

import jax
import orbax.checkpoint as ocp

from scaleopt.train.config import TrainConfig

EXIT_SKIPS, EXIT_SIGNAL = 3, 143


class SkipLimit(RuntimeError):
  """Too many consecutive non-finite steps; the last good state was checkpointed."""


class Interrupted(RuntimeError):
  """SIGTERM / SIGINT (preemption, Ctrl-C): the state was checkpointed, resume with --resume."""


class OutOfMemory(RuntimeError):
  """The device ran out of memory compiling or running a step; the message is one line with
  the bytes asked for, the device's limit and the settings that lower them."""


_GIB = 2.0 ** 30
_SIZE = r"([0-9.]+)\s*([KMGT]i?B?|bytes|B)"


def _bytes(num: str, unit: str) -> float:
  return float(num) * 1024 ** "BKMGT".index(unit[0] if unit[0] in "KMGT" else "B")


def out_of_memory(e: BaseException, cfg: TrainConfig) -> Optional[OutOfMemory]:
  """The one-line OutOfMemory for an XLA ``RESOURCE_EXHAUSTED`` / out-of-memory error (None
  for any other error). Reads the bytes asked for from the message (XLA's GPU and CPU runtimes
  say "allocate N bytes", its TPU compiler "Used X of Y hbm") and the limit from the message
  or the device's memory pool."""
  text = str(e)
  if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
    return None
  m = (re.search(r"allocat\w*(?:\s+request\s+for)?\s+" + _SIZE, text)
       or re.search(r"[Uu]sed\s+" + _SIZE, text))
  asked = f"{_bytes(*m.groups()) / _GIB:.2f} GiB" if m else "an unreported amount"
  lim = re.search(r"[Uu]sed\s+[0-9.]+\s*\S+\s+of\s+" + _SIZE, text)
  pool = _bytes(*lim.groups()) if lim else pool_bytes()
  limit = f"{pool / _GIB:.2f} GiB" if pool else "unknown"
  d, mdl = cfg.data, cfg.model.config
  return OutOfMemory(
      f"out of device memory: the step asked for {asked}, the device's limit is {limit}; "
      f"lower it with more data.microbatches (now {d.microbatches}: data.batch_size="
      f"{d.batch_size} in smaller pieces, also the evaluation's), model.remat (now "
      f"{mdl.remat!r}; 'full' keeps the fewest activations), mesh.fsdp (now {cfg.mesh.fsdp}; "
      f"parameters and optimizer state split over that many devices) or run.eval_tokens (now "
      f"{cfg.run.eval_tokens}; the held-out set kept on the devices)")


class Signals:
  """SIGTERM / SIGINT -> a stop the loop checks between steps; a second signal exits at once.

  Python runs signal handlers only between bytecodes, so a main thread blocked in a device
  wait would not see them. The C-level handler writes the signal number to a wakeup pipe
  (``signal.set_wakeup_fd``) that a daemon thread reads: the first signal sets the flag (the
  loop then checkpoints and stops), a second one ends the process immediately with
  128 + signum, even if a computation hangs.

  Multi-process runs (``jax.distributed`` with its preemption service, on by default) must
  stop at the same step on every process. There SIGTERM is left to JAX's preemption notifier
  (installed by ``jax.distributed.initialize``), a first SIGINT is forwarded to it as a
  SIGTERM, and ``stop(step)`` is true on every process at the same step: Orbax's
  ``reached_preemption`` (the processes exchange their step counters in the background once
  any of them got the notice and agree on the next step after the largest; between notices
  the check is local). A second SIGINT still exits at once; a second SIGTERM does nothing
  (a hung multi-process run needs SIGINT twice or SIGKILL).
  """

  def __init__(self):
    self.caught = None
    self.agree = _preemption_service()
    self._old, self._fds, self._old_fd, self._thread = {}, None, None, None

  def __enter__(self):
    if threading.current_thread() is not threading.main_thread():
      return self
    r, w = os.pipe()
    os.set_blocking(w, False)
    self._fds = (r, w)
    for sig in (signal.SIGINT,) if self.agree else (signal.SIGTERM, signal.SIGINT):
      self._old[sig] = signal.signal(sig, lambda *_: None)
    self._old_fd = signal.set_wakeup_fd(w)
    self._thread = threading.Thread(target=self._watch, args=(r,), daemon=True)
    self._thread.start()
    return self

  def _watch(self, r: int) -> None:
    while True:
      try:
        b = os.read(r, 1)
      except OSError:
        return
      if not b:
        return
      if self.caught is None:
        self.caught = signal.Signals(b[0]).name
        where = ("with every process at the same step " if self.agree else "")
        print(f"\n{self.caught}: stopping after this step {where}and checkpointing (send it "
              "again to exit at once)", file=sys.stderr, flush=True)
        if self.agree:  # JAX's preemption notifier spreads the notice to every process
          os.kill(os.getpid(), signal.SIGTERM)
      else:
        os._exit(128 + b[0])

  def stop(self, step: int) -> Optional[str]:
    """The signal to stop for after ``step`` (None: go on); call it after every step."""
    if not self.agree:
      return self.caught
    if not ocp.multihost.reached_preemption(step):
      return None
    print(f"preemption notice: every process stops after step {step} and checkpoints",
          file=sys.stderr, flush=True)
    return self.caught or "SIGTERM"

  def __exit__(self, *exc):
    if self._fds is None:
      return
    signal.set_wakeup_fd(self._old_fd)
    for sig, old in self._old.items():
      signal.signal(sig, old)
    r, w = self._fds
    os.close(w)  # the watcher reads EOF and returns
    self._thread.join(timeout=5)
    os.close(r)


def _preemption_service() -> bool:
  """JAX runs distributed with its preemption service (SIGTERM handled by its notifier)."""
  if not jax.distributed.is_initialized():
    return False
  # public flag only (no jax._src): jax.distributed.initialize starts the service when it is on
  return bool(jax.config.jax_enable_preemption_service)



def pool_bytes() -> Optional[int]:
  """The memory pool of this process's first device, in bytes (None where unknown: CPU)."""
  return (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
