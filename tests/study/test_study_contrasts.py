"""The ``contrasts`` key and the shipped bc_paper_gpt2 study, run tiny on CPU: every arm and
seed on a corpus prepared in the test, the contrast table of summary.md recomputed from the cells'
results with SciPy's paired t-test (an independent implementation of the interval)."""

import csv
import json
import math
import pathlib
import re
import shutil

import numpy as np
import pytest
from scipy import stats

from scaleopt import cli
from scaleopt.study import config as SC
from scaleopt.study import store
from scaleopt.train.config import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAPER = ROOT / "configs" / "studies" / "bc_paper_gpt2.yaml"
# bc_paper_gpt2 made tiny: the tiny model on bytes, 3 steps of 8 sequences in 4 microbatches
TINY = ["model.preset=tiny", "model.dtype=float32", "model.vocab_size=256", "model.d_model=32",
        "model.n_layers=1", "model.d_ff=64", "model.max_seq_len=32", "data.seq_len=32",
        "data.batch_size=8", "data.microbatches=4", "run.steps=3", "run.eval_every=0",
        "run.eval_tokens=256", "run.checkpoint_every=0", "run.log_every=1",
        "run.async_checkpoint=false", "optimizer.schedule.warmup_steps=1"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """The project's own docs as a byte-token corpus (``scaleopt data prepare``)."""
  tmp = tmp_path_factory.mktemp("corpus")
  (tmp / "text").mkdir()
  for p in sorted((ROOT / "docs").glob("*.md")):
    shutil.copy(p, tmp / "text" / p.name)
  out = tmp / "shards"
  assert cli.main(["data", "prepare", "--input", str(tmp / "text"), "--out", str(out),
                   "--tokenizer", "bytes", "--val-fraction", "0.3", "--quiet"]) == 0
  return out


def _table(summary: str) -> list[list[str]]:
  """The rows of summary.md's "## Contrasts" table, split into cells."""
  lines = summary.split("## Contrasts", 1)[1].splitlines()
  start = next(i for i, ln in enumerate(lines) if ln.startswith("| contrast")) + 2
  out = []
  for ln in lines[start:]:
    if not ln.startswith("|"):
      break
    out.append([c.strip() for c in ln.strip("|").split("|")])
  return out


def _expected(rows: dict, a: str, b: str):
  """mean, lo, hi of the per-seed test-loss differences a - b (SciPy's paired t-test)."""
  la = {int(r["seed"]): float(r["test_loss"]) for r in rows.values() if r["arm"] == a}
  lb = {int(r["seed"]): float(r["test_loss"]) for r in rows.values() if r["arm"] == b}
  seeds = sorted(set(la) & set(lb))
  x, y = np.array([la[s] for s in seeds]), np.array([lb[s] for s in seeds])
  if len(seeds) < 2:
    return float(np.mean(x - y)), None, None
  ci = stats.ttest_rel(x, y).confidence_interval(0.95)
  return float(np.mean(x - y)), float(ci.low), float(ci.high)


def _store_rows(out: pathlib.Path) -> dict:
  """The unrounded test losses of the store (results.csv prints 6 digits: an interval's end
  near 0 could change sides)."""
  return {r["cell"]["id"]: {"arm": r["cell"]["arm"], "seed": r["cell"]["seed"],
                            "test_loss": r["result"]["test_loss"]} for r in store.read(out)}


def _check_row(row: list[str], rows: dict, a: str, b: str, label: str) -> float:
  """One contrast row against SciPy on the store's losses: the difference, its interval, the
  verdict and every seed's difference; returns the mean difference."""
  assert row[0] == f"{a} - {b}" and row[1] == label
  mean, lo, hi = _expected(rows, a, b)
  nums = [float(v) for v in row[3].replace("[", " ").replace("]", " ").replace(",", " ")
          .replace("(n=1)", " ").split()]
  assert math.isclose(nums[0], mean, abs_tol=1.5e-4), (row, mean)  # printed to 4 decimals
  if lo is None:
    assert row[2] == "1" and row[4] == "n < 2"
  else:
    assert math.isclose(nums[1], lo, abs_tol=1.5e-4) and math.isclose(nums[2], hi,
                                                                       abs_tol=1.5e-4), row
    assert row[4] == ("lower" if hi < 0 else "higher" if lo > 0 else "n.s."), (row, lo, hi)
  la = {int(r["seed"]): float(r["test_loss"]) for r in rows.values() if r["arm"] == a}
  lb = {int(r["seed"]): float(r["test_loss"]) for r in rows.values() if r["arm"] == b}
  got = dict(x.split() for x in row[5].split(", "))
  assert sorted(got) == [f"s{s}" for s in sorted(set(la) & set(lb))], row
  for s in set(la) & set(lb):
    assert math.isclose(float(got[f"s{s}"]), la[s] - lb[s], abs_tol=1.5e-4), row
  return mean


def _check_table(out: pathlib.Path, st, arms: set) -> list[list[str]]:
  with (out / "results.csv").open() as fh:
    assert {r["arm"] for r in csv.DictReader(fh)} == arms
  rows = _store_rows(out)
  table = _table((out / "summary.md").read_text())
  assert len(table) == len(st.contrasts)
  for (a, b, label), row in zip(st.contrasts, table):
    _check_row(row, rows, a, b, label)
  assert (out / "contrasts.png").is_file()
  return table


@pytest.mark.integration  # a whole training run: make test-integration
def test_paper_study_runs_tiny_and_its_contrasts_match_scipy(corpus, tmp_path, capsys):
  """Every arm, seeds 0 and 1 (arm 5 and the SOAP arms: their own seed 0), each arm one compile
  (the vmap engine trains both seeds in one step); an extra contrast puts arm 5 in the table."""
  out = tmp_path / "study"
  sets = TINY + [f"data.path={corpus}", "engine.kind=vmap", "engine.cells_at_once=2"]
  extra = "contrasts=" + json.dumps([list(c) for c in SC.load(PAPER, sets).contrasts]
                                    + [["loo_base_sched", "adamw", "one seed"]])
  st = SC.load(PAPER, sets + [extra])
  assert len(st.search_cells()) == 13 and len(st.contrasts) == 8
  args = ["study", "--config", "bc_paper_gpt2", "--out", str(out)]
  for s in sets + [extra]:
    args += ["--set", s]
  assert cli.main(args) == 0
  assert "13 cell(s) trained now, 0 left" in capsys.readouterr().out
  table = _check_table(out, st, set(st.arms))
  assert [r[2] for r in table] == ["2"] * 5 + ["1"] * 3


@pytest.mark.integration  # a subset of the every-arm run above
def test_paper_study_claim_cells_run_tiny(corpus, tmp_path, capsys):
  """The paper's claim as a contrast, on its own: arms 1 and 3 (`adamw`, `loo_paper`) at
  both seeds through the shipped config, tiny (the vmap engine: one compile per arm); the
  contrast row against SciPy, the other rows "unfinished"."""
  out = tmp_path / "study"
  args = ["study", "--config", "bc_paper_gpt2", "--out", str(out), "--cells", "adamw/*",
          "loo_paper/*"]
  for s in TINY + [f"data.path={corpus}", "engine.kind=vmap", "engine.cells_at_once=2"]:
    args += ["--set", s]
  assert cli.main(args) == 0
  assert "4 cell(s) trained now, 0 left" in capsys.readouterr().out
  st = SC.load(PAPER, TINY + [f"data.path={corpus}"])
  table = _table((out / "summary.md").read_text())
  assert table[0][2] == "2"
  mean = _check_row(table[0], _store_rows(out), *st.contrasts[0])
  assert abs(mean) > 1e-3  # a sign or scale error shows at the table's 4 decimals
  assert [r[3] for r in table[1:]] == ["unfinished"] * (len(table) - 1)


def test_paper_study_plan_follows_the_paper():
  """The shipped study against the paper's numbers (its Table 2 setup), not against itself."""
  st = SC.load(PAPER, ["data.path=corpus"])
  cells = st.search_cells()
  assert len(cells) == 2 * 5 + 3
  assert st.arm_seeds("loo_base_sched") == st.arm_seeds("soap") == st.arm_seeds("soap_bc") == [0]
  cfg = {c.arm: st.cell_config(c) for c in cells}
  for arm, c in cfg.items():
    assert c.run.steps * c.data.batch_size * c.data.seq_len == 262_144_000
    assert (c.data.batch_size, c.data.microbatches, c.optimizer.schedule.warmup_steps) == (
        512, 64, 20)
    assert c.run.eval_tokens >= 2_000_000
    o = c.optimizer
    split = arm in ("adamw_split", "loo_paper", "loo", "cf_loo")
    dense = 9e-4 if split else 6e-4
    embed = dense * o.extra.get("sparse_lr_ratio", 1.0)
    assert math.isclose(o.learning_rate, dense) and math.isclose(embed, 6e-4, rel_tol=1e-6)
    assert o.schedule.min_lr_ratio == (0.2 if split else 0.0)
    assert o.clip_norm == 1.0 and o.clip_numerator_only == (arm == "loo_paper")
  assert [(a, b) for a, b, _ in st.contrasts] == [
      ("loo_paper", "adamw"), ("adamw_split", "adamw"), ("cf_loo", "adamw_split"),
      ("loo", "cf_loo"), ("loo_paper", "loo"), ("soap", "adamw"), ("soap_bc", "soap")]
  assert cfg["soap_bc"].optimizer.extra == {"mode": "full", "crossfit": "loo"}
  for arm in ("soap", "soap_bc"):  # SOAP's paper betas, not the base config's AdamW ones
    assert (cfg[arm].optimizer.b1, cfg[arm].optimizer.b2) == (0.95, 0.95)


@pytest.mark.parametrize("contrasts,key", [
    ("[[adamw,nope,x]]", "contrasts[0]"),
    ("[[adamw,adamw,x]]", "contrasts[0]"),
    ("[[adamw,loo]]", "contrasts[0]"),
    ("adamw", "contrasts"),
])
def test_bad_contrast_is_a_one_line_config_error(tmp_path, capsys, contrasts, key):
  sets = ["data.path=x", f"contrasts={contrasts}"]
  with pytest.raises(ConfigError, match=re.escape(key)):
    SC.load(PAPER, sets)
  rc = cli.main(["study", "--config", str(PAPER), "--out", str(tmp_path / "o"), "--list",
                 "--set", sets[0], "--set", sets[1]])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and len(err) == 1 and key in err[0], err
