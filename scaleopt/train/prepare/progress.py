"""The progress line of ``scaleopt data prepare``."""

from __future__ import annotations

import sys
import time


class Progress:
  """A line on stderr every ``every`` seconds: text read, MB/s, tokens."""

  def __init__(self, on: bool, every: float = 5.0):
    self.on, self.every, self.t0 = on, every, time.perf_counter()
    self.last, self.bytes = self.t0, 0

  def rate(self) -> float:
    return self.bytes / 1e6 / max(time.perf_counter() - self.t0, 1e-9)

  def tick(self, writers: dict, force: bool = False) -> None:
    now = time.perf_counter()
    if self.on and (force or now - self.last >= self.every):
      self.last = now
      toks = ", ".join(f"{s} {w.total:,}" for s, w in writers.items())
      print(f"prepare: {self.bytes / 1e6:,.1f} MB of text, {self.rate():.2f} MB/s, tokens "
            f"{toks}", file=sys.stderr, flush=True)
