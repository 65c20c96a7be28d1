"""`make run`'s scaling part: rerun the small preset sweep and print its alpha table."""

from __future__ import annotations

import pathlib

from scaleopt.config import resolve_config
from scaleopt.scaling import config, sweep


def run_default(out_dir: pathlib.Path) -> list[dict]:
  """Run configs/sweeps/small.yaml (sized for a CPU) into out_dir/sweep/."""
  out = pathlib.Path(out_dir) / "sweep"
  cfg = config.load_config(resolve_config("small", "sweep"))
  print(f"\n== scaling-exponent sweep (preset '{cfg['name']}', configs/sweeps/small.yaml) ==")
  res, rows, notes = sweep.run_and_write(cfg, out)
  print(sweep.alpha_table(rows))
  for msg in notes:
    print(f"WARNING: {msg}")
  print(f"sweep: {res.timing['total_s']:.1f} s; alpha.csv, losses.csv and plots in {out}/")
  return rows
