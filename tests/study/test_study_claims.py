"""Workers sharing a study folder never train one cell at once, whatever their --claim tokens:
a cell whose folder another live process owns (``runfolder.owner``) is skipped, not retrained.
The engines are replaced by stand-ins that record what they were asked to train."""

import json
import pathlib
import subprocess
import sys

import pytest
import yaml

from scaleopt.study import config as SC
from scaleopt.study import engines, runner, store

ROOT = pathlib.Path(__file__).resolve().parents[2]
BC_TINY = ROOT / "configs" / "studies" / "bc_tiny.yaml"

_HOLD = """
import contextlib, sys
from scaleopt.train import runfolder
with contextlib.ExitStack() as held:
  for d in sys.argv[1:]:
    held.enter_context(runfolder.owner(d, command="other worker"))
  print("held", flush=True)
  sys.stdin.read()
"""


@pytest.fixture
def trained(monkeypatch):
  """Stand-in engines: each finishes its cells at once and records their folders (checking
  that this process owns each folder while it trains)."""
  seen = []

  def result(d):
    holder = json.loads((d / runner.runfolder.LOCK).read_text())
    assert holder["command"] == "scaleopt study"
    seen.append(f"{d.parent.name}/{d.name}")  # the cell id
    return {"status": "finished", "val_loss": 1.0, "test_loss": 1.0, "train_loss": 1.0}

  monkeypatch.setattr(engines, "run_loop", lambda cfg, d, resume: result(d))
  monkeypatch.setattr(engines, "run_vmapped",
                      lambda cfgs, dirs, step, stop, key=None: [result(d) for d in dirs])
  return seen


def _study():
  raw = SC.apply_overrides(yaml.safe_load(BC_TINY.read_text()), [])
  raw["grid"] = {"data.microbatches": [2, 4]}  # 4 conditions of 4 cells
  return SC.from_dict(raw, BC_TINY)


def test_a_cell_another_process_trains_is_skipped_not_trained_twice(tmp_path, trained):
  st = _study()
  out = tmp_path / "study"
  cells = st.search_cells()
  conds = runner.conditions(st)
  # another worker trains one cell of the first condition and every cell of the second
  busy = [next(c for c in cells if c.condition == conds[0])]
  busy += [c for c in cells if c.condition == conds[1]]
  holder = subprocess.Popen([sys.executable, "-c", _HOLD]
                            + [str(runner.cell_dir(out, c)) for c in busy],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            cwd=ROOT)
  try:
    assert holder.stdout.readline().strip() == "held"
    # a worker of another launch (another token) claims the busy conditions first
    res = runner.run_study(st, out, claim="launch2")
    # the busy cells are skipped while their owner lives; the rest train once
    assert sorted(trained) == sorted(c.id for c in cells if c not in busy)
    assert res["left"] == len(busy) and res["stopped"] is None
    assert not any((runner.cell_dir(out, c) / "cell.json").exists() for c in busy)
  finally:
    holder.stdin.close()
    holder.wait(timeout=30)
  trained.clear()
  res = runner.run_study(st, out, claim="launch3")  # its owner is gone: now it trains, once
  assert sorted(trained) == sorted(c.id for c in busy) and res["left"] == 0
  assert sorted(r["cell"]["id"] for r in store.read(out)) == sorted(c.id for c in cells)


def test_a_cell_finished_while_waiting_is_not_trained_again(tmp_path, trained):
  st = _study()
  out = tmp_path / "study"
  cells = [c for c in st.search_cells() if c.condition == runner.conditions(st)[0]]
  out.mkdir()
  store.append(out, [{"cell": {"id": cells[0].id}, "result": {"id": cells[0].id}}])
  statuses = runner.run_unit(st, cells, out, runner._Stop(None))
  assert statuses[0] == "busy" and statuses[1:] == ["finished"] * (len(cells) - 1)
  assert sorted(trained) == sorted(c.id for c in cells[1:])
