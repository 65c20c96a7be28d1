"""Cells per hour of a study: one cell at a time (ordinary training runs, one compile each)
against the vmapped cell engine (one compile per group; C cells per step).

  python benchmarks/study_throughput.py [--config configs/studies/bc_tiny.yaml]
      [--set KEY=VALUE ...] [--modes loop vmap1 vmap4] [--cells GLOB ...] [--out DIR]

Each mode runs the whole study (or the --cells subset) into a fresh folder and reports wall
time, cells/hour and the speed-up over `loop`; the CPU process time is printed too (on a
shared machine the wall time includes waiting for other processes).
"""

from __future__ import annotations

import argparse
import pathlib
import resource
import shutil
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _cpu_s() -> float:
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_utime + r.ru_stime


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--config", default=str(ROOT / "configs" / "studies" / "bc_tiny.yaml"))
  p.add_argument("--set", action="append", default=[])
  p.add_argument("--modes", nargs="+", default=["loop", "vmap1", "vmap4"],
                 help="loop | vmapC (C cells per vmapped step, e.g. vmap1, vmap8)")
  p.add_argument("--cells", nargs="+", default=None)
  p.add_argument("--out", default=None, help="keep the study folders here (default: temp)")
  a = p.parse_args(argv)
  import jax
  from scaleopt.study import config as SC
  from scaleopt.study import runner
  base = pathlib.Path(a.out) if a.out else pathlib.Path(tempfile.mkdtemp(prefix="study_bench_"))
  rows = []
  for mode in a.modes:
    over = list(a.set) + (["engine.kind=loop"] if mode == "loop" else
                          ["engine.kind=vmap", f"engine.cells_at_once={int(mode[4:])}"])
    st = SC.load(a.config, over)
    out = base / mode
    shutil.rmtree(out, ignore_errors=True)
    t0, c0 = time.time(), _cpu_s()
    res = runner.run_study(st, out, cells=a.cells)
    wall, cpu = time.time() - t0, _cpu_s() - c0
    rows.append((mode, res["ran"], wall, cpu))
    print(f"{mode}: {res['ran']} cells in {wall:.1f} s wall ({cpu:.1f} s CPU)", flush=True)
  ref = rows[0][2] / max(rows[0][1], 1)
  print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, study {st.name}, "
        f"{' '.join(a.set) or 'as configured'}")
  print("| mode | cells | wall s | CPU s | cells/hour | speed-up vs " + rows[0][0] + " |")
  print("|---|---|---|---|---|---|")
  for mode, n, wall, cpu in rows:
    print(f"| {mode} | {n} | {wall:.1f} | {cpu:.1f} | {3600 * n / wall:.0f} | "
          f"{ref / (wall / max(n, 1)):.2f}x |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
