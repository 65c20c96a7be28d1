"""benchmarks/loo_folds.py: the table's rows on the tiny preset, and one-line input errors."""

import os
import subprocess
import sys

import pytest


def _run(*args):
  env = dict(os.environ, PYTHONPATH=os.getcwd())
  return subprocess.run([sys.executable, "benchmarks/loo_folds.py", "--model", "tiny", *args],
                        env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.integration  # three compiles in a subprocess
def test_tiny_table():
  out = _run("--m", "4", "--chunks", "1,3", "--iters", "1")
  assert out.returncode == 0, out.stderr[-2000:]
  rows = [l.split("|")[1:-1] for l in out.stdout.splitlines() if l.startswith("| ")]
  assert [r[0].strip() for r in rows[1:]] == ["adamw", "loo k=1", "loo k=3",
                                              rows[-1][0].strip()]
  assert rows[-1][0].strip().startswith("read stack")
  assert float(rows[1][2]) == 0.0 and all(float(r[1]) > 0 for r in rows[1:])


@pytest.mark.integration  # each a subprocess that imports jax
@pytest.mark.parametrize("args,says", [(("--chunks", "0"), "--chunks '0'"),
                                       (("--m", "1"), "--m 1"), (("--iters", "0"), "--iters 0")])
def test_bad_input_is_a_one_line_error(args, says):
  out = _run(*args)
  assert out.returncode == 2 and says in out.stderr and len(out.stderr.splitlines()) == 1
