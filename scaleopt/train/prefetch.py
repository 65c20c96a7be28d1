"""Work made ahead by a background thread: the one prefetcher of the trainer and of
``scaleopt data prepare``.

``Ahead(source, depth)`` runs an iterator in a thread, ``depth`` items ahead of the consumer;
``next()`` hands them out in order, raises the iterator's exception where the consumer reaches
it (never earlier) and ``StopIteration`` at its end. ``Prefetch`` is the trainer's use: device
batches (the iterator's ``next()`` and the host-to-device put) with the iterator position after
the batches handed out so far (what a checkpoint records).

A train step whose program holds a ``lax.cond`` or ``while_loop`` makes the GPU runtime read the
predicate on the host, so dispatching it returns only once the previous step has run; the next
batch's host work then hides behind the step only when it runs beside it, in this thread. In
data preparation the thread reads and parses the inputs while the encoder (which releases the
GIL) tokenizes the previous batch.

``Prefetch.quiet()`` holds the copies back while a block runs: the trainer runs each step
program's first execution in it. On a GPU that first run loads the program's cuDNN graphs, and
cuDNN's loader captures the compute stream into a CUDA graph; a host-to-device copy that has to
wait for that stream (its memory was last used by a step) can join the capture and make it fail
("capturing stream has unjoined work").
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any, Callable, Iterator, Optional

_END = object()  # the source is exhausted


class Ahead:
  """``source`` run ahead in a daemon thread, at most ``depth`` items queued."""

  def __init__(self, source: Iterator, depth: int = 2, name: str = "scaleopt-ahead"):
    self._q: Any = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self._done = False
    self._thread = threading.Thread(target=self._fill, args=(source,), name=name, daemon=True)
    self._thread.start()

  def _put(self, item) -> bool:
    while not self._stop.is_set():
      try:
        self._q.put(item, timeout=0.1)
        return True
      except queue.Full:
        continue
    return False

  def _fill(self, source: Iterator) -> None:
    try:
      for x in source:
        if not self._put((x, None)):
          return
      self._put((_END, None))
    except BaseException as e:  # noqa: BLE001 -- handed to the consumer, in order
      self._put((None, e))

  def next(self) -> Any:
    """The next item; the source's exception where it was raised; StopIteration at its end."""
    if self._done:
      raise StopIteration
    while True:
      try:
        x, err = self._q.get(timeout=1.0)
        break
      except queue.Empty:
        if not self._thread.is_alive() and self._q.empty():
          self._done = True
          raise StopIteration from None
    if err is not None:
      self._done = True
      raise err
    if x is _END:
      self._done = True
      raise StopIteration
    return x

  def __iter__(self):
    return self

  __next__ = next

  def close(self, timeout: Optional[float] = None) -> None:
    """Stops the thread (it ends at its next hand-over) and waits for it."""
    self._stop.set()
    self._thread.join(timeout=timeout)


class Prefetch(Ahead):
  """Training batches on the devices: ``put(it.next())`` made ahead (``depth`` queued and one in
  hand), at most ``count`` of them. ``state()`` is ``it``'s position after the batches handed
  out so far; an error of ``it`` is raised by the ``next()`` that reaches it."""

  def __init__(self, it, put: Callable, count: int, depth: int = 2):
    import jax  # here: data preparation uses ``Ahead`` without JAX installed
    self._state = it.state()
    self._copy = threading.Lock()  # held from a copy's start until it has landed

    def batches():
      for _ in range(count):
        host = it.next()
        with self._copy:
          batch = jax.block_until_ready(put(host))
        yield batch, it.state()

    super().__init__(batches(), depth, name="scaleopt-batches")

  def next(self) -> dict:
    try:
      batch, self._state = super().next()
    except StopIteration:
      raise RuntimeError("the batch thread ended without a batch (more batches asked for "
                         "than it was made for)") from None
    return batch

  __next__ = next

  def state(self) -> dict:
    return self._state

  @contextlib.contextmanager
  def quiet(self):
    """No copy to the devices is in flight or starts while the block runs (the one in flight
    lands first); the host work on the next batches goes on."""
    with self._copy:
      yield

  def close(self, timeout: Optional[float] = 10) -> None:
    super().close(timeout)
