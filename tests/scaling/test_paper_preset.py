"""The reproduce targets (the paper's s = 1 pair, the shape of the shift) on the full `paper` preset (slow)."""

import pathlib

import pytest

from scaleopt.scaling import config, sweep

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_paper_preset_meets_reproduce_targets():
  cfg = config.load_config(ROOT / "configs/sweeps/paper.yaml",
                           ["compute.progress=false", "fit.bootstrap=200"])
  rows, _ = sweep.summarize(sweep.run_sweep(cfg))
  a = {(r["s"], r["optimizer"]): r["alpha"] for r in rows}
  assert abs(a[(1.0, "gd")] - 0.12) <= 0.03
  assert abs(a[(1.0, "ng")] - 0.31) <= 0.03
  for s in (1.0, 1.25, 1.5, 2.0):
    for opt in ("adam", "kron_sqrt", "msign", "ng"):
      assert a[(s, opt)] >= a[(s, "gd")], (s, opt)
  shift = {s: a[(s, "ng")] - a[(s, "gd")] for s in (1.0, 1.5, 2.0)}
  assert shift[1.5] > shift[1.0]
  assert shift[2.0] >= 0.5 * shift[1.5]
