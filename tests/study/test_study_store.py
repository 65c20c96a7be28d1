"""The compact store ``cells.jsonl``: the runner writes it and resumes from it, the report is
rebuilt from it, concurrent writers never record a cell twice, and a study folder of the
one-folder-per-cell layout converts into it with an identical report."""

import csv
import json
import multiprocessing
import shutil

import pytest

from scaleopt.study import config as SC
from scaleopt.study import convert, engines, report, runner, store

from test_study_config import BC_TINY, _raw


def _study():
  raw = _raw()
  raw["seeds"] = [0, 1]
  return SC.from_dict(raw, BC_TINY)


def _loss(arm, lr, seed):  # an arbitrary, cell-specific number the fake engine "measures"
  return 3.0 + 0.1 * seed + (0.2 if arm == "adamw" else 0.0) + 10 * lr


def _fake_run(cfg, d):
  """What a finished training run leaves in its folder, plus the engine's result dict."""
  lr, seed = cfg.optimizer.learning_rate, cfg.run.seed
  arm = d.parent.name
  v = _loss(arm, lr, seed)
  d.mkdir(parents=True, exist_ok=True)
  (d / "checkpoints" / "30").mkdir(parents=True, exist_ok=True)
  rows = [{"step": s, "loss": v + 1.0 / s, "grad_norm": 1.0} for s in (10, 20, 30)]
  rows[1]["eval_loss"] = v + 0.5
  (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (d / "summary.json").write_text(json.dumps({"steps": 30, "resumed_from": None}))
  return {"status": "ok", "steps": 30, "tokens": 960, "gradient_passes": 240.0,
          "val_loss": v, "test_loss": v + 0.01, "train_loss": v + 1 / 30,
          "wall_time_s": 1.0, "tokens_per_s": 960.0, "cells_at_once": 1, "engine": "loop",
          "card": "cpu"}


@pytest.fixture
def fake_engine(monkeypatch):
  trained = []

  def run_loop(cfg, d, resume):
    trained.append(d.relative_to(d.parents[2]).as_posix())
    return _fake_run(cfg, d)

  monkeypatch.setattr(engines, "run_loop", run_loop)
  return trained


def test_runner_writes_resumes_and_reports_from_the_store(tmp_path, fake_engine, monkeypatch):
  monkeypatch.setattr(report, "plot", lambda *a: None)  # plots: tests/study/test_study_run.py
  st = SC.from_dict({**_raw(), "seeds": [0, 1], "engine": {"kind": "loop"}}, BC_TINY)
  out = tmp_path / "s"
  res = runner.run_study(st, out)
  ids = sorted(c.id for c in st.search_cells())
  assert res["ran"] == len(ids) == 8 and sorted(fake_engine) == [f"cells/{i}" for i in ids]
  # every cell is one line of cells.jsonl; its work folder (checkpoints too) is gone
  lines = (out / store.STORE).read_text().splitlines()
  assert sorted(json.loads(x)["cell"]["id"] for x in lines) == ids
  assert not (out / "cells").exists()
  rec = {r["cell"]["id"]: r for r in store.read(out)}["adamw_bc/lr=0.01,seed=1"]
  assert rec["cell"] == {"id": "adamw_bc/lr=0.01,seed=1", "arm": "adamw_bc", "grid": {},
                         "lr": 0.01, "seed": 1, "stage": 1}
  assert rec["config"]["optimizer.name"] == "adamw_bc"
  assert rec["config"]["optimizer.learning_rate"] == 0.01
  v = _loss("adamw_bc", 0.01, 1)
  assert rec["curves"] == {"loss": [[10, v + 0.1], [20, v + 0.05], [30, v + 1 / 30]],
                           "eval_loss": [[20, v + 0.5]]}
  assert rec["summary"] == {"steps": 30, "resumed_from": None}

  # resume: nothing finished is trained again; a cell missing from the store is
  fake_engine.clear()
  assert runner.run_study(st, out)["ran"] == 0 and fake_engine == []
  (out / store.STORE).write_text("".join(x + "\n" for x in lines
                                         if "adamw/lr=0.003,seed=0" not in x))
  assert runner.run_study(st, out)["ran"] == 1
  assert fake_engine == ["cells/adamw/lr=0.003,seed=0"]

  # the report is rebuilt from the store alone
  for f in ("results.csv", "summary.md"):
    (out / f).unlink()
  assert runner.study_main(BC_TINY, str(out), overrides=["seeds=[0,1]", "engine.kind=loop"],
                           report_only=True) == 0
  with (out / "results.csv").open() as fh:
    got = {r["cell"]: r for r in csv.DictReader(fh)}
  assert sorted(got) == ids
  for c in st.search_cells():
    assert float(got[c.id]["test_loss"]) == pytest.approx(_loss(c.arm, c.lr, c.seed) + 0.01)
  best = {c.arm: c.best_lr for c in report.analyse(st, report.read_rows(out))}
  assert best == {"adamw": 0.003, "adamw_bc": 0.003}  # the lowest _loss
  assert "| adamw_bc | 0.003 | 2 |" in (out / "summary.md").read_text()


def _append_many(args):
  out, worker = args
  for i in range(40):  # every worker tries the same 40 cells
    store.append(out, [{"cell": {"id": f"a/lr=1,seed={i}"}, "result": {"by": worker},
                        "pad": "x" * 20000}])


def test_concurrent_writers_record_each_cell_once(tmp_path):
  # fork (spawn would import JAX four times): the children only append JSON lines and import
  # nothing, so JAX's threads in this process are not touched; a hang fails at the timeout
  with multiprocessing.get_context("fork").Pool(4) as pool:
    pool.map_async(_append_many, [(tmp_path, w) for w in range(4)]).get(timeout=300)
  lines = (tmp_path / store.STORE).read_text().splitlines()
  ids = [json.loads(x)["cell"]["id"] for x in lines]  # every line whole
  assert sorted(ids) == sorted(f"a/lr=1,seed={i}" for i in range(40))


def test_a_cut_line_is_skipped_and_the_next_record_starts_a_new_line(tmp_path, capsys):
  store.append(tmp_path, [{"cell": {"id": "a"}}])
  with (tmp_path / store.STORE).open("a") as fh:
    fh.write('{"cell": {"id": "b"')  # a writer killed mid-line
  assert store.append(tmp_path, [{"cell": {"id": "c"}}]) == 1
  assert [r["cell"]["id"] for r in store.read(tmp_path)] == ["a", "c"]
  assert f"{tmp_path / store.STORE}:2 is not a cell record" in capsys.readouterr().err


def _old_layout(out, st):
  """A study folder as the per-cell layout wrote it (the fake engine's files + result.json),
  and one unfinished cell with a checkpoint."""
  cells = st.search_cells()
  for c in cells[:-1]:
    d = runner.cell_dir(out, c)
    runner.write_cell_meta(st, c, d)
    r = _fake_run(st.cell_config(c), d)
    shutil.rmtree(d / "checkpoints")
    (d / "config.yaml").write_text("run: {}\n")
    runner.write_result(d, {"id": c.id, "arm": c.arm, "lr": c.lr, "seed": c.seed,
                            "stage": c.stage, **r})
  d = runner.cell_dir(out, cells[-1])
  runner.write_cell_meta(st, cells[-1], d)
  (d / "checkpoints" / "10").mkdir(parents=True)
  return cells


def test_converter_on_an_old_layout_folder(tmp_path, capsys):
  st = _study()
  old, new = tmp_path / "old", tmp_path / "new"
  cells = _old_layout(old, st)
  report.write_report(st, old, plots=False)
  shutil.copytree(old, new)
  results = {c.id: json.loads((runner.cell_dir(old, c) / "result.json").read_text())
             for c in cells[:-1]}
  metrics = {c.id: [json.loads(x) for x in
                    (runner.cell_dir(old, c) / "metrics.jsonl").read_text().splitlines()]
             for c in cells[:-1]}

  assert convert.main([str(new), "--remove"]) == 0
  assert f"{len(cells) - 1} cell(s) added" in capsys.readouterr().out
  recs = {r["cell"]["id"]: r for r in store.read(new)}
  assert sorted(recs) == sorted(results)
  for cid, rec in recs.items():
    assert rec["result"] == results[cid]
    assert rec["curves"]["loss"] == [[m["step"], m["loss"]] for m in metrics[cid]]
    assert rec["curves"]["eval_loss"] == [[m["step"], m["eval_loss"]] for m in metrics[cid]
                                          if "eval_loss" in m]
  # finished folders are gone; the unfinished one (a checkpoint) stays and is still planned
  assert [p.relative_to(new / "cells").as_posix() for p in (new / "cells").glob("*/*")] == [
      cells[-1].id]
  assert [c.id for c in runner.plan(st, new)] == [cells[-1].id]
  report.write_report(st, new, plots=False)
  for f in ("results.csv", "summary.md"):
    assert (new / f).read_text() == (old / f).read_text(), f
  # a second run adds nothing; a folder without cells/ is one line, exit 2
  assert convert.main([str(new)]) == 0 and "0 cell(s) added" in capsys.readouterr().out
  assert convert.main([str(tmp_path / "nothing")]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "nothing: no cells/ folder" in err


@pytest.mark.parametrize("name", ["bc_gpt2", "bc_gpt2_loo_m", "scale_vectors_dense",
                                  "scale_vectors_moe", "bc_paper_gpt2"])
def test_committed_reports_rebuild_from_their_store(tmp_path, name):
  """The shipped studies' summary.md and results.csv (written from the per-cell folders they
  were converted from) come back byte for byte from cells.jsonl alone."""
  src = BC_TINY.parents[2] / "docs" / "studies" / name
  shutil.copy(src / store.STORE, tmp_path / store.STORE)
  sets = ["data.path=runs/corpus"] if name == "bc_paper_gpt2" else None  # the path it ran with
  report.write_report(SC.load(BC_TINY.parent / f"{name}.yaml", sets), tmp_path, plots=False)
  for f in ("summary.md", "results.csv"):
    assert (tmp_path / f).read_text() == (src / f).read_text(), f
