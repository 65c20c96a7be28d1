"""benchmarks/loo_memory.py --quick: the table's rows and columns, and one-line input errors.

Two forms (the AdamW baseline and bfloat16-stored one-pass LOO) keep the run to two compiles
of the small decoder; the other forms share their code path.
"""

import os
import subprocess
import sys

import pytest


def _run(*args):
  env = dict(os.environ, PYTHONPATH=os.getcwd())
  return subprocess.run([sys.executable, "benchmarks/loo_memory.py", "--quick", *args],
                        env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.integration  # two compiles of a small decoder in a subprocess
def test_quick_table():
  out = _run("--forms", "adamw,loo 1-pass bf16")
  assert out.returncode == 0, out.stderr[-2000:]
  rows = [l.split("|")[1:-1] for l in out.stdout.splitlines() if l.startswith("| ")]
  assert [r[0].strip() for r in rows] == ["form", "adamw", "loo 1-pass bf16"]
  base, bf16 = rows[1], rows[2]
  assert float(base[5]) == 1.0  # AdamW over itself
  for r in (base, bf16):
    mb, temp, ms, tps = (float(x.replace(",", "")) for x in r[1:5])
    assert 0 < temp <= mb and ms > 0 and tps > 0
    # tokens per step / time per step, within the printed precision (ms to 0.1, tokens/s to 1)
    assert 8 * 16 / ((ms + 0.05) / 1e3) - 1 <= tps <= 8 * 16 / ((ms - 0.05) / 1e3) + 1
  assert float(bf16[5]) > 0


def test_unknown_form_is_a_one_line_error():
  out = _run("--forms", "adamw,loo 3-pass")
  assert out.returncode == 2 and out.stderr.strip() == (
      "--forms: unknown form 'loo 3-pass'; known: adamw, loo 2-pass, loo 1-pass f32, "
      "loo 1-pass bf16")
