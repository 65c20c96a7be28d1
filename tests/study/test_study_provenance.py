"""Each study cell records its provenance; a report refuses mixed corpora and lists the
commits and cards its cells came from."""

import json

import pytest

from scaleopt.config import ConfigError
from scaleopt.study import config as SC
from scaleopt.study import report, runner, store

from test_study_config import BC_TINY, _raw


def _prov(corpus="c1", commit="a" * 40, kind="NVIDIA H100 80GB HBM3"):
  return {"commit": commit, "dirty": False, "corpus": {"content_sha256": corpus},
          "device_kind": kind, "devices": 1, "deterministic": True}


def _folder(d, prov):
  d.mkdir(parents=True)
  (d / "result.json").write_text(json.dumps({"id": f"adamw/{d.name}", "status": "ok",
                                             "val_loss": 3.0, "test_loss": 3.1}))
  summary = {"steps": 3} if prov is None else {"steps": 3, "provenance": prov}
  (d / "summary.json").write_text(json.dumps(summary))


def test_store_records_and_rows_carry_the_provenance(tmp_path):
  out = tmp_path / "s"
  _folder(out / "cells" / "adamw" / "new", _prov())
  _folder(out / "cells" / "adamw" / "old", None)
  store.absorb(out, remove=True)
  recs = {r["cell"]["id"]: r for r in store.read(out)}
  assert recs["adamw/new"]["provenance"] == _prov() and recs["adamw/old"]["provenance"] is None
  rows = {r["id"]: r for r in store.rows(out)}
  assert rows["adamw/new"]["provenance"]["corpus"]["content_sha256"] == "c1"


def test_report_refuses_cells_of_different_corpora():
  rows = [{"id": "a/x", "provenance": _prov()}, {"id": "b/x", "provenance": _prov()},
          {"id": "c/x", "provenance": None}, {"id": "d/x"}]
  report.check_corpora(rows)  # cells without a record are not compared
  rows[1]["provenance"] = _prov(corpus="c2")
  with pytest.raises(ConfigError, match="cells a/x and b/x were trained on different corpora"):
    report.check_corpora(rows)


def test_summary_lists_commits_and_cards_once_cells_record_them():
  st = SC.from_dict(_raw(), BC_TINY)
  row = {"id": "adamw/lr=0.001,seed=0", "arm": "adamw", "lr": 1e-3, "seed": 0,
         "status": "ok", "val_loss": 3.0, "test_loss": 3.1, "card": "cpu"}
  old = report.summary_md(st, [row], [], set())
  assert "Cells came from" not in old  # reports of cells without provenance stay as they were
  new = report.summary_md(st, [{**row, "provenance": _prov()},
                               {**row, "id": "x", "provenance": _prov(commit="b" * 40,
                                                                     kind="NVIDIA H200")}],
                          [], set())
  assert (f"Cells came from commits {'a' * 12} (1), {'b' * 12} (1); cards "
          "1x NVIDIA H100 80GB HBM3 (1), 1x NVIDIA H200 (1).") in new


def _recorded_cell(tmp_path):
  """A study, its first cell, the cell's folder with its ``cell.json`` and that record."""
  st = SC.from_dict(_raw(), BC_TINY)
  cell = st.search_cells()[0]
  d = tmp_path / "cell"
  runner.write_cell_meta(st, cell, d)
  return st, cell, d, json.loads((d / "cell.json").read_text())


def test_a_cell_folder_recorded_before_data_seed_existed_still_matches(tmp_path):
  st, cell, d, meta = _recorded_cell(tmp_path)
  assert meta["config"]["data.seed"] is None and "run.deterministic" not in meta["config"]
  del meta["config"]["data.seed"]  # an older record
  (d / "cell.json").write_text(json.dumps(meta))
  runner.check_cell_folder(st, cell, d)
  meta["config"]["data.seed"] = 4
  (d / "cell.json").write_text(json.dumps(meta))
  with pytest.raises(ConfigError, match="data.seed=4"):
    runner.check_cell_folder(st, cell, d)


def test_a_cell_folder_recorded_before_host_phases_was_cosmetic_still_matches(tmp_path):
  st, cell, d, meta = _recorded_cell(tmp_path)
  assert "run.host_phases" not in meta["config"]
  meta["config"]["run.host_phases"] = "auto"  # an older record kept the key
  (d / "cell.json").write_text(json.dumps(meta))
  runner.check_cell_folder(st, cell, d)
  meta["config"]["optimizer.weight_decay"] = 0.5  # a key that is not cosmetic still counts
  (d / "cell.json").write_text(json.dumps(meta))
  with pytest.raises(ConfigError, match="optimizer.weight_decay=0.5"):
    runner.check_cell_folder(st, cell, d)


def test_data_seed_is_a_study_axis_beside_the_run_seed():
  from scaleopt.train.config import data_seed
  raw = {**_raw(), "seeds": [0, 1], "grid": {"data.seed": [5, 6]}}
  st = SC.from_dict(raw, BC_TINY)
  arm, lr = st.search_cells()[0].arm, st.search_cells()[0].lr
  cells = [c for c in st.search_cells() if c.arm == arm and c.lr == lr]
  cfgs = {(c.seed, dict(c.grid)["data.seed"]): st.cell_config(c) for c in cells}
  assert {(k, (cf.run.seed, data_seed(cf))) for k, cf in cfgs.items()} == {
      ((r, d), (r, d)) for r in (0, 1) for d in (5, 6)}
  # the vmapped engine groups cells that differ in run.seed only: one data order per group
  assert SC.group_key(cfgs[0, 5]) == SC.group_key(cfgs[1, 5]) != SC.group_key(cfgs[0, 6])


@pytest.mark.integration  # a vmapped group trains (one compile)
def test_vmapped_cells_take_their_data_order_from_data_seed_and_record_provenance(
    tmp_path, monkeypatch):
  import pathlib
  import sys
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "train"))
  from train_helpers import tiny_raw

  from scaleopt.study import vmapped
  from scaleopt.train import config as C, data as D

  def cfg(seed, data_seed):
    return C.from_dict(tiny_raw(
        run={"steps": 3, "log_every": 1, "eval_every": 0, "eval_tokens": 256,
             "checkpoint_every": 0, "tensorboard": False, "seed": seed, "deterministic": True},
        data={"seq_len": 32, "batch_size": 8, "microbatches": 2, "seed": data_seed}))

  made = []
  real = D.Batches.__init__
  monkeypatch.setattr(D.Batches, "__init__",
                      lambda self, *a, seed=0, **k: (made.append(seed), real(self, *a, seed=seed,
                                                                            **k))[1])
  # two initializations, one data order: one iterator for both cells
  res = vmapped.train_group([cfg(0, 7), cfg(1, 7)], [tmp_path / "a", tmp_path / "b"],
                            resume_step=None, key="p")
  assert made == [7] and res.status == ["ok", "ok"]
  sa, sb = res.summaries
  assert sa["provenance"]["deterministic"] is True
  assert sa["provenance"]["corpus"]["content_sha256"] == sb["provenance"]["corpus"]["content_sha256"]
  assert sa["state_sha256"] != sb["state_sha256"]  # other initializations, other final states
  # data.seed unset: each cell's order follows its run.seed
  made.clear()
  vmapped.train_group([cfg(0, None), cfg(1, None)], [tmp_path / "c", tmp_path / "d"],
                      resume_step=None, key="p")
  assert made == [0, 1]
