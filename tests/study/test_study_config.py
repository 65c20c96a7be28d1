"""Study configs: grid expansion, overrides, one-line errors with exit code 2, sharding."""

import copy
import dataclasses
import json
import pathlib

import pytest
import yaml

from scaleopt import cli
from scaleopt.study import config as SC
from scaleopt.study import runner
from scaleopt.train.config import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[2]
BC_TINY = ROOT / "configs" / "studies" / "bc_tiny.yaml"


def _raw():
  return SC.apply_overrides(yaml.safe_load(BC_TINY.read_text()), [])


def test_bc_tiny_expands_to_2x2x2_ordinary_configs():
  st = SC.load(BC_TINY)
  cells = st.search_cells()
  assert len(cells) == 8 and len({c.id for c in cells}) == 8
  assert {(c.arm, c.lr, c.seed) for c in cells} == {
      (a, lr, s) for a in ("adamw", "adamw_bc") for lr in (3e-3, 1e-2) for s in (0, 1)}
  c = next(c for c in cells if c.arm == "adamw_bc" and c.lr == 1e-2 and c.seed == 1)
  cfg = st.cell_config(c)
  assert cfg.optimizer.name == "adamw_bc" and cfg.optimizer.learning_rate == 1e-2
  assert cfg.optimizer.extra == {"mode": "full", "crossfit": "loo"}
  assert cfg.run.seed == 1 and cfg.run.steps == 30 and cfg.model.config.d_model == 32
  # the base file's keys survive where the study does not touch them
  assert cfg.optimizer.weight_decay == 0.1 and cfg.data.source == "embedded"
  # lr and seed cells of one arm share a compile group; arms do not
  keys = {(c.arm, SC.group_key(st.cell_config(c))) for c in cells}
  assert len({k for _, k in keys}) == 2


def test_grid_per_arm_lrs_best_lr_seeds_and_overrides():
  raw = _raw()
  raw["arms"]["adamw_bc"]["learning_rates"] = [1e-3, 2e-3, 4e-3]
  raw["best_lr_seeds"] = [0, 1, 2, 3]
  st = SC.from_dict(SC.apply_overrides(raw, ["run.steps=7", "seeds=[5]",
                                             "grid.data.microbatches=[2, 4]",
                                             "arms.adamw.optimizer.weight_decay=0.0"]), BC_TINY)
  assert st.cell_config(st.search_cells()[0]).optimizer.weight_decay == 0.0
  cells = st.search_cells()
  assert len(cells) == 2 * 1 * 2 + 3 * 1 * 2  # (adamw 2 lrs + bc 3 lrs) x 1 seed x 2 grid
  assert all(st.cell_config(c).run.steps == 7 for c in cells)
  assert {st.cell_config(c).data.microbatches for c in cells} == {2, 4}
  extra = st.best_lr_cells("adamw", (("data.microbatches", 4),), 1e-2)
  assert [c.seed for c in extra] == [0, 1, 2, 3] and all(c.stage == 2 for c in extra)
  assert extra[0].id == "adamw/data.microbatches=4,lr=0.01,seed=0"


@pytest.mark.parametrize("edit, key", [
    (lambda r: r.update(bogus=1), "bogus"),
    (lambda r: r["arms"]["adamw_bc"].update({"optimizer.extra": {"crossfit": "nope"}}),
     "crossfit"),
    (lambda r: r["arms"]["adamw"].update({"lr": 1}), "arms.adamw.lr"),
    (lambda r: r.update(learning_rates=[-1.0]), "learning_rates"),
    (lambda r: r.update(baseline="sgd"), "baseline"),
    (lambda r: r["train"]["run"].update(steps=0), "run.steps"),
    (lambda r: r.update(grid={"run.seed": [1, 2]}), "grid.run.seed"),
    (lambda r: r.update(engine={"kind": "gpu"}), "engine.kind"),
])
def test_config_errors_name_the_key(edit, key):
  raw = _raw()
  edit(raw)
  with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
    SC.from_dict(raw, BC_TINY)


def test_cli_config_error_is_one_line_exit_2(tmp_path, capsys):
  rc = cli.main(["study", "--config", str(BC_TINY), "--out", str(tmp_path),
                 "--set", "optimizer.clip_norm=-1"])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and len(err) == 1 and "clip_norm" in err[0], err
  rc = cli.main(["study", "--config", str(BC_TINY), "--out", str(tmp_path), "--shard", "2/2"])
  assert rc == 2 and "--shard" in capsys.readouterr().err
  rc = cli.main(["study", "--config", str(tmp_path / "nope.yaml"), "--out", str(tmp_path)])
  assert rc == 2 and "nope.yaml" in capsys.readouterr().err


def test_changed_study_refuses_old_cell_folder(tmp_path):
  st = SC.load(BC_TINY)
  c = st.search_cells()[0]
  d = runner.cell_dir(tmp_path, c)
  runner.write_cell_meta(st, c, d)
  runner.check_cell_folder(st, c, d)  # same config: fine
  st2 = SC.load(BC_TINY, ["optimizer.weight_decay=0.0", "run.progress=true"])
  with pytest.raises(ConfigError, match=r"optimizer\.weight_decay=0\.1"):
    runner.check_cell_folder(st2, c, d)
  st3 = SC.load(BC_TINY, ["run.progress=true", "run.checkpoint_every=3"])  # cosmetic only
  runner.check_cell_folder(st3, c, d)


def test_shards_split_conditions_and_cover_everything():
  raw = _raw()
  raw["grid"] = {"data.microbatches": [2, 4]}
  st = SC.from_dict(raw, BC_TINY)
  cells = st.search_cells()
  parts = [runner.select(st, cells, f"{i}/3", None) for i in range(3)]
  ids = [c.id for p in parts for c in p]
  assert sorted(ids) == sorted(c.id for c in cells)  # disjoint and complete
  for p in parts:  # a condition (arm x grid point) never straddles shards
    for q in parts:
      if p is not q:
        assert not {c.condition for c in p} & {c.condition for c in q}
  only = runner.select(st, cells, None, ["adamw_bc/*lr=0.01*"])
  assert {c.arm for c in only} == {"adamw_bc"} and {c.lr for c in only} == {1e-2}


def test_claiming_workers_hold_whole_conditions_and_share_everything(tmp_path):
  raw = _raw()
  raw["grid"] = {"data.microbatches": [2, 4]}
  st = SC.from_dict(raw, BC_TINY)
  cells = st.search_cells()
  a, b = runner._Claims(st, tmp_path, "launch1"), runner._Claims(st, tmp_path, "launch1")
  pa, pb = a.mine(cells), b.mine(cells)  # both see every cell: each takes a different one
  assert {c.condition for c in pa} != {c.condition for c in pb}
  todo = [c for c in cells if c not in pa + pb]  # those two conditions finished
  pa2, pb2 = a.mine(todo), b.mine(todo)
  parts = [pa, pb, pa2, pb2]
  assert all(len({c.condition for c in p}) == 1 for p in parts)  # whole conditions
  assert sorted(c.id for p in parts for c in p) == sorted(c.id for c in cells)
  assert a.mine([]) == []
  # a held condition stays with its worker when its extra seeds appear later
  cond = pa2[0].condition
  extra = st.best_lr_cells(cond[0], cond[1], 1e-2)
  assert a.mine(extra) == extra and b.mine(extra) == []
  # a new launch (token) is not blocked by the claims of an interrupted one
  assert runner._Claims(st, tmp_path, "launch2").mine(cells)
  with pytest.raises(ConfigError, match="--claim"):
    runner._Claims(st, tmp_path, "../x")


def test_claiming_workers_hold_single_cells_with_the_loop_engine(tmp_path):
  """With the loop engine (one cell per process) workers claim cells, in plan order: the two
  seeds of a condition go to two workers, and every cell is claimed exactly once."""
  raw = dict(_raw(), seeds=[0, 1], engine={"kind": "loop"})
  st = SC.from_dict(raw, BC_TINY)
  cells = st.search_cells()
  workers = [runner._Claims(st, tmp_path, "launch1") for _ in range(3)]
  first = [w.mine(cells) for w in workers]
  assert [len(p) for p in first] == [1, 1, 1]
  assert [p[0] for p in first] == cells[:3]  # the next unfinished cell first
  todo, taken = list(cells), []
  while todo:
    todo = [c for c in todo if c not in taken]
    got = [c for w in workers for c in w.mine([c for c in todo if c not in taken])]
    if not got:
      break
    taken += got
  assert sorted(c.id for c in taken) == sorted(c.id for c in cells)  # each exactly once
  assert len(taken) == len({c.id for c in taken})


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "studies").glob("*.yaml")),
                         ids=lambda p: p.stem)
def test_shipped_studies_validate(path):
  raw = yaml.safe_load(path.read_text())
  shards = raw.get("train", {}).get("data", {}).get("source") == "shards"
  # every cell's config and every optimizer section build (a shards corpus: any folder name)
  st = SC.load(path, ["data.path=corpus"] if shards else [])
  assert st.name == path.stem
  twin_check = {a for t in st.twins for a in t} == set(st.arms)  # one cell run twice
  assert st.baseline in st.arms and (len(st.search_cells()) >= 8 or twin_check)
  if st.best_lr_seeds:
    assert len(set(st.seeds) | set(st.best_lr_seeds)) >= 3


def test_vmap_engine_only_for_fresh_single_device_cells(tmp_path):
  from scaleopt.study import engines
  st = SC.load(BC_TINY)
  cells = st.search_cells()
  cfg = st.cell_config(cells[0])
  assert engines.vmap_ok(cfg)
  cfg = dataclasses.replace(  # starts from given weights: the loop does that
      cfg, model=dataclasses.replace(cfg.model, init_from="ckpt/some-params"))
  assert not engines.vmap_ok(cfg)
  sizes = [len(u) for u in runner.units(st, cells, tmp_path)]
  assert sizes == [4, 4]  # one group per arm, cells_at_once = 4
  st2 = SC.load(BC_TINY, ["arms.adamw.optimizer.name=sophia"])  # lax.cond inside: one at a time
  assert sorted(len(u) for u in runner.units(st2, st2.search_cells(), tmp_path)) == [1] * 4 + [4]


def test_cli_list_prints_the_units_left(tmp_path, capsys):
  assert cli.main(["study", "--config", "bc_tiny", "--out", str(tmp_path), "--list"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[-1].startswith("study bc_tiny: 8 cell(s) left")
  assert [l.split(":")[0] for l in out[:-1]] == ["4 at once", "4 at once"]
  assert not (tmp_path / "cells").exists()  # nothing trained
