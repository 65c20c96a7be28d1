"""Run outputs: metrics.jsonl, summary.json, TensorBoard event files, the loss-curve PNG.

The TensorBoard writer needs no TensorFlow: an event file is a sequence of records

  uint64 length | uint32 masked_crc32c(length) | data (an ``Event`` protobuf) | uint32 masked_crc32c(data)

with ``masked(c) = ((c >> 15 | c << 17) + 0xa282ead8) mod 2^32``; the few protobuf fields
used (Event.wall_time=1 double, step=2 int64, file_version=3 string, summary=5; Summary.value=1;
Value.tag=1 string, simple_value=2 float) are encoded by hand below.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import socket
import struct
import time
from typing import Optional

# ---------------------------------------------------------------------------------------------
# CRC-32C (Castagnoli), table driven.

_POLY = 0x82F63B78
_TABLE = []
for _i in range(256):
  _c = _i
  for _ in range(8):
    _c = (_c >> 1) ^ _POLY if _c & 1 else _c >> 1
  _TABLE.append(_c)


def crc32c(data: bytes) -> int:
  c = 0xFFFFFFFF
  t = _TABLE
  for b in data:
    c = t[(c ^ b) & 0xFF] ^ (c >> 8)
  return c ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  c = crc32c(data)
  return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# Minimal protobuf encoding.


def _varint(n: int) -> bytes:
  out = bytearray()
  n &= (1 << 64) - 1
  while True:
    b = n & 0x7F
    n >>= 7
    if n:
      out.append(b | 0x80)
    else:
      out.append(b)
      return bytes(out)


def _key(field: int, wire: int) -> bytes:
  return _varint(field << 3 | wire)


def _bytes_field(field: int, data: bytes) -> bytes:
  return _key(field, 2) + _varint(len(data)) + data


def _event(wall_time: float, step: int, *, file_version: Optional[str] = None,
           scalars: Optional[dict] = None) -> bytes:
  out = _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(step)
  if file_version is not None:
    out += _bytes_field(3, file_version.encode())
  if scalars:
    summary = b"".join(
        _bytes_field(1, _bytes_field(1, tag.encode()) + _key(2, 5) + struct.pack("<f", v))
        for tag, v in scalars.items())
    out += _bytes_field(5, summary)
  return out


def _record(data: bytes) -> bytes:
  n = struct.pack("<Q", len(data))
  return n + struct.pack("<I", masked_crc32c(n)) + data + struct.pack("<I", masked_crc32c(data))


class TBWriter:
  """Appends scalar summaries to ``DIR/events.out.tfevents.<time>.<host>``."""

  def __init__(self, directory: str | pathlib.Path):
    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    self.path = d / f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
    self._f = open(self.path, "ab")
    self._f.write(_record(_event(time.time(), 0, file_version="brain.Event:2")))

  def scalars(self, step: int, values: dict) -> None:
    vals = {k: float(v) for k, v in values.items() if isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(float(v))}
    if vals:
      self._f.write(_record(_event(time.time(), step, scalars=vals)))

  def flush(self) -> None:
    self._f.flush()

  def close(self) -> None:
    self._f.close()


def read_events(path: str | pathlib.Path) -> list[bytes]:
  """Record payloads of an event file, checking both CRCs (for tests and tools)."""
  data = pathlib.Path(path).read_bytes()
  out, i = [], 0
  while i < len(data):
    head = data[i:i + 8]
    (n,) = struct.unpack("<Q", head)
    if struct.unpack("<I", data[i + 8:i + 12])[0] != masked_crc32c(head):
      raise ValueError(f"{path}: bad length crc at byte {i}")
    payload = data[i + 12:i + 12 + n]
    if struct.unpack("<I", data[i + 12 + n:i + 16 + n])[0] != masked_crc32c(payload):
      raise ValueError(f"{path}: bad data crc at byte {i}")
    out.append(payload)
    i += 16 + n
  return out


# ---------------------------------------------------------------------------------------------
# JSON outputs and the plot.


def _clean(v):
  if isinstance(v, float) and not math.isfinite(v):
    return None
  return v


class MetricsLog:
  """``metrics.jsonl`` (one object per logged step) plus TensorBoard scalars."""

  def __init__(self, out_dir: pathlib.Path, *, resume_step: Optional[int] = None,
               tensorboard: bool = True, enabled: bool = True):
    self.path = out_dir / "metrics.jsonl"
    self.enabled = enabled
    if not enabled:
      self._f, self.tb = None, None
      return
    if resume_step is not None and self.path.exists():  # drop what the restored state undid
      keep = [l for l in self.path.read_text().splitlines()
              if l.strip() and json.loads(l)["step"] <= resume_step]
      self.path.write_text("".join(l + "\n" for l in keep))
    elif resume_step is None and self.path.exists():
      self.path.unlink()
    self._f = open(self.path, "a")
    self.tb = TBWriter(out_dir / "tb") if tensorboard else None

  def write(self, row: dict) -> None:
    if not self.enabled:
      return
    self._f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
    if self.tb is not None:
      self.tb.scalars(int(row["step"]), {k: v for k, v in row.items() if k != "step"})

  def flush(self) -> None:
    if self.enabled:
      self._f.flush()
      if self.tb is not None:
        self.tb.flush()

  def close(self) -> None:
    if self.enabled:
      self._f.close()
      if self.tb is not None:
        self.tb.close()


def read_metrics(path: str | pathlib.Path) -> list[dict]:
  return [json.loads(l) for l in pathlib.Path(path).read_text().splitlines() if l.strip()]


def write_summary(out_dir: pathlib.Path, summary: dict) -> None:
  (out_dir / "summary.json").write_text(
      json.dumps({k: _clean(v) for k, v in summary.items()}, indent=2) + "\n")


def plot_curves(runs: dict[str, list[dict]], path: pathlib.Path, title: str = "") -> None:
  """Train (thin) and eval (markers) loss against step for one or more runs."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  for i, (name, rows) in enumerate(runs.items()):
    color = f"C{i}"
    tr = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
    ev = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    if tr:
      ax.plot(*zip(*tr), color=color, lw=1, alpha=0.7, label=f"{name} train")
    if ev:
      ax.plot(*zip(*ev), color=color, marker="o", ls="--", label=f"{name} eval")
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats/token)")
  if title:
    ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
