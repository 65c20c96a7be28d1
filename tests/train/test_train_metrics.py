"""The hand-written TensorBoard event format and the JSON outputs."""

import json
import struct

from scaleopt.train import metrics as M


def test_crc32c_known_vectors():
  # RFC 3720 / iSCSI check values for CRC-32C
  assert M.crc32c(b"123456789") == 0xE3069283
  assert M.crc32c(b"") == 0
  assert M.crc32c(bytes(32)) == 0x8A9136AA
  assert M.crc32c(bytes([0xFF] * 32)) == 0x62A8AB43


def _parse_varint(b, i):
  shift = n = 0
  while True:
    x = b[i]; i += 1
    n |= (x & 0x7F) << shift
    shift += 7
    if not x & 0x80:
      return n, i


def _parse(msg):
  """Generic protobuf wire-format parser: {field: [values]} (bytes for length-delimited)."""
  out, i = {}, 0
  while i < len(msg):
    key, i = _parse_varint(msg, i)
    f, w = key >> 3, key & 7
    if w == 0:
      v, i = _parse_varint(msg, i)
    elif w == 1:
      v = struct.unpack("<d", msg[i:i + 8])[0]; i += 8
    elif w == 5:
      v = struct.unpack("<f", msg[i:i + 4])[0]; i += 4
    else:
      n, i = _parse_varint(msg, i)
      v = msg[i:i + n]; i += n
    out.setdefault(f, []).append(v)
  return out


def test_event_file_roundtrip(tmp_path):
  w = M.TBWriter(tmp_path)
  w.scalars(7, {"loss": 2.5, "lr": 1e-3, "flag": True, "nan": float("nan")})
  w.scalars(300000, {"eval_loss": 1.25})
  w.close()
  recs = M.read_events(w.path)  # checks both CRCs of every record
  assert len(recs) == 3
  assert _parse(recs[0])[3] == [b"brain.Event:2"]
  e1 = _parse(recs[1])
  assert e1[2] == [7]
  values = [_parse(v) for v in _parse(e1[5][0])[1]]
  got = {v[1][0].decode(): v[2][0] for v in values}
  assert got == {"loss": 2.5, "lr": struct.unpack("<f", struct.pack("<f", 1e-3))[0]}
  e2 = _parse(recs[2])
  assert e2[2] == [300000]
  # corrupting one byte is detected
  raw = bytearray(w.path.read_bytes())
  raw[-6] ^= 1
  w.path.write_bytes(bytes(raw))
  try:
    M.read_events(w.path)
    assert False, "corruption not detected"
  except ValueError as e:
    assert "crc" in str(e)


def test_metrics_log_truncates_on_resume(tmp_path):
  log = M.MetricsLog(tmp_path, tensorboard=False)
  for s in range(1, 6):
    log.write({"step": s, "loss": float(s), "bad": float("inf")})
  log.close()
  rows = M.read_metrics(tmp_path / "metrics.jsonl")
  assert rows[0]["bad"] is None  # non-finite -> null, the file stays valid JSON
  log = M.MetricsLog(tmp_path, resume_step=3, tensorboard=False)
  log.write({"step": 4, "loss": 40.0})
  log.close()
  assert [r["loss"] for r in M.read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3, 40]
  M.write_summary(tmp_path, {"x": float("nan"), "y": 1})
  assert json.loads((tmp_path / "summary.json").read_text()) == {"x": None, "y": 1}
