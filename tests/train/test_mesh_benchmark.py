"""benchmarks/mesh_throughput.py: the batch fit and the per-executed-token accounting."""

import importlib.util
import pathlib
import re

import pytest

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "mesh_throughput.py"
_spec = importlib.util.spec_from_file_location("mesh_throughput", _PATH)
mt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mt)


@pytest.mark.parametrize("fixed,per_seq,limit", [
    (1.5e9, 1.9e9, 70 * 2**30),  # about qwen2.5-0.5b fsdp4 at 1024 tokens
    (3.0e9, 2.5e9, 3.0e9 + 7 * 2.5e9),  # the limit exactly on a size: that size fits
    (1e6, 3e5, 2.9e6),
])
def test_fit_choice_is_the_largest_size_under_the_limit(fixed, per_seq, limit):
  peak = lambda b: fixed + per_seq * b
  want = max(b for b in range(1, 1000) if peak(b) <= limit)  # brute force over sizes
  for probes in ((8, 16), (1, 2), (4, 16, 32)):
    assert mt.fit_choice([(b, peak(b)) for b in probes], limit) == want


def test_fit_choice_rejects_a_flat_peak():
  with pytest.raises(ValueError, match="does not grow"):
    mt.fit_choice([(8, 5e9), (16, 5e9)], 70 * 2**30)


def _row(name, axis, batch, micro, ms, optimizer="adamw", groups=1, sweeps=1.0, extra=None):
  tokens = groups * batch * 1024
  return dict(name=name, axis=axis, n=4, preset="gpt2-small", batch=batch, seq=1024,
              micro=micro, optimizer=optimizer, extra=extra or {}, groups=groups,
              sweeps=sweeps, tokens_per_s=tokens / (ms / 1e3), mfu=0.3, final_loss=3.0,
              devices=4, device_kind="card", jax="0.0")


def _cells(text, name):
  line = next(l for l in text.splitlines() if l.startswith(f"| {name} |"))
  return [c.strip() for c in line.strip("|").split("|")]


def test_per_executed_token_ratios_count_groups_and_sweeps():
  # step times chosen by hand; the expected ratios below are worked out from them
  rows = [
      _row("adamw fast", "fsdp", 64, 1, 40.0),
      _row("adamw m4", "data", 64, 4, 45.0),
      _row("loo", "data", 64, 4, 100.0, "adamw_bc", sweeps=2.0, extra={"crossfit": "loo"}),
      # A/B: 2 groups of 32 sequences in 2 microbatches = 64 sequences in 4 microbatches
      _row("sophia_bc", "data", 32, 2, 48.0, "sophia_bc", groups=2),
  ]
  text = mt.table(rows)
  head = [c.strip() for c in text.splitlines()[2].strip("|").split("|")]
  col = {k: head.index(k) for k in ("tokens/step", "microbatches", "ms/step", "vs adamw step",
                                     "vs adamw token", "same micro")}
  loo, soph = _cells(text, "loo"), _cells(text, "sophia_bc")
  assert loo[col["ms/step"]] == "100.0" and loo[col["vs adamw step"]] == "2.50x"
  assert loo[col["vs adamw token"]] == "1.25x"  # (100 / 2) / 40
  assert loo[col["same micro"]] == "1.11x"  # (100 / 2) / 45
  assert soph[col["tokens/step"]] == "65536" and soph[col["microbatches"]] == "4"
  assert soph[col["ms/step"]] == "48.0" and soph[col["vs adamw token"]] == "1.20x"
  assert soph[col["same micro"]] == "1.07x"  # 48 / 45
  assert re.search(r"card: card; devices in the row's process: 4; jax 0\.0", text)


def test_configurations_run_on_the_callers_visible_gpus(monkeypatch):
  """With CUDA_VISIBLE_DEVICES set, a configuration takes the first N of those GPUs (a
  benchmark on GPUs 2,3 must not land on GPU 0 beside other work)."""
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
  assert mt.visible_gpus([0]) == "2" and mt.visible_gpus([0, 1]) == "2,3"
  assert mt.visible_gpus([1]) == "3"
  with pytest.raises(SystemExit, match="has 2 GPU"):
    mt.visible_gpus([0, 1, 2])
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
  assert mt.visible_gpus([0, 1, 2]) == "0,1,2"
