"""Twins: the same cell under two arm names, compared bit for bit in the report. Config errors as
one line; the comparison on planted rows (equal, one curve point off, one final loss off); a
tiny study trained twice on CPU reads as bitwise equal; the twin study's cell is the decisive
study's adamw cell."""

import math

import pytest

from scaleopt import cli
from scaleopt.study import config as SC
from scaleopt.study import report, twins
from scaleopt.train.config import ConfigError

from test_study_config import BC_TINY, ROOT, _raw


def _study(edit=None):
  raw = _raw()
  raw["learning_rates"] = [1e-2]
  raw["seeds"] = [0]
  raw["arms"] = {"a": {"optimizer.name": "adamw"}, "a2": {"optimizer.name": "adamw"},
                 "b": {"optimizer.name": "adamw", "optimizer.weight_decay": 0.0}}
  raw["baseline"] = "a"
  raw["twins"] = [["a", "a2"]]
  if edit:
    edit(raw)
  return SC.from_dict(raw, BC_TINY)


@pytest.mark.parametrize("twins_raw, says", [
    ([["a", "c"]], "twins[0]"), ([["a", "a"]], "twins[0]"), ([["a"]], "twins[0]"),
    ("a a2", "'twins' must be a list"), ([["a", "b"]], "differ in their overrides"),
])
def test_bad_twins_are_one_line_config_errors(twins_raw, says):
  with pytest.raises(ConfigError) as e:
    _study(lambda raw: raw.update(twins=twins_raw))
  assert says in str(e.value) and "\n" not in str(e.value)


def test_twins_with_other_seeds_are_refused():
  def edit(raw):
    raw["arms"]["a2"]["seeds"] = [1]
  with pytest.raises(ConfigError, match=r"twins\[0\].*differ in 'seeds'"):
    _study(edit)


def _row(**change):
  row = {"arm": "a", "lr": 0.01, "seed": 0, "card": "cpu", "train_loss": 2.5,
         "val_loss": 2.6, "test_loss": 2.7,
         "curves": {"loss": {10: 3.0, 20: 2.8, 30: 2.6}, "eval_loss": {30: 2.65}}}
  for k, v in change.items():
    if k in row["curves"]:
      row["curves"] = {**row["curves"], k: {**row["curves"][k], **v}}
    else:
      row[k] = v
  return row


def test_compare_equal_rows():
  assert twins.compare(_row(), _row()) == "bitwise equal (7 values)"
  nan = _row(test_loss=math.nan)
  assert twins.compare(nan, _row(test_loss=math.nan)) == "bitwise equal (7 values)"


def test_compare_names_the_first_differing_step():
  b = _row(loss={20: 2.8000001, 30: 2.61}, eval_loss={30: 2.66}, test_loss=2.71)
  line = twins.compare(_row(), b)
  assert line.startswith("differ in 4 of 7 values; first: loss at step 20 (2.8 vs 2.8000001)")


def test_compare_a_final_loss_alone():
  assert "first: test_loss (2.7 vs 2.7000000000000006)" in twins.compare(
      _row(), _row(test_loss=2.7000000000000006))


def test_compare_values_logged_by_one_run_only():
  assert twins.compare(_row(), _row(loss={40: 2.5})).startswith(
      "differ: values logged by one run only")


def test_summary_lists_each_twin_pair_with_its_result():
  st = _study()
  rows = [_row(arm="a", id="a/0"), _row(arm="a2", id="a2/0", loss={30: 2.5}),
          _row(arm="b", id="b/0", test_loss=9.0)]
  text = report.summary_md(st, rows, [], set())
  lines = [ln for ln in text.split("## Twins")[1].splitlines() if ln.startswith("| a = a2")]
  assert lines == ["| a = a2 | 0.01 | 0 | cpu | differ in 1 of 7 values; first: loss at step "
                   "30 (2.6 vs 2.5) |"]
  text = report.summary_md(st, [_row(arm="a", id="a/0")], [], set())
  assert "| a = a2 | - | - | - | no seed finished by both yet |" in text


def test_twins_in_a_study_with_a_grid_are_refused():
  with pytest.raises(ConfigError, match="'twins' needs a study without 'grid'"):
    _study(lambda raw: raw.update(grid={"model.wd_policy": ["iwd", "matrices-only"]}))


def test_tiny_twin_study_trains_bitwise_equal_on_cpu(tmp_path, capsys):
  path = tmp_path / "twin.yaml"
  path.write_text(f"""
name: tiny_twin
base: {ROOT / 'configs' / 'train' / 'tiny.yaml'}
train:
  run: {{steps: 12, log_every: 4, eval_every: 6, eval_tokens: 512, checkpoint_every: 6,
        keep_checkpoints: 1, async_checkpoint: false, progress: false, tensorboard: false,
        plot: false, deterministic: true}}
  model: {{preset: tiny, dtype: float32, d_model: 32, n_layers: 1, d_ff: 64}}
  data: {{seq_len: 32, batch_size: 8, microbatches: 2}}
arms:
  adamw: {{optimizer.name: adamw_bc, optimizer.extra: {{mode: full, crossfit: loo}}}}
  adamw_twin: {{optimizer.name: adamw_bc, optimizer.extra: {{mode: full, crossfit: loo}}}}
learning_rates: [3.0e-3]
seeds: [0]
twins: [[adamw, adamw_twin]]
engine: {{kind: loop}}
""")
  assert cli.main(["study", "--config", str(path), "--out", str(tmp_path / "out")]) == 0
  text = (tmp_path / "out" / "summary.md").read_text()
  row = [ln for ln in text.splitlines() if ln.startswith("| adamw = adamw_twin")]
  assert len(row) == 1 and "bitwise equal" in row[0], text


def test_the_twin_studys_cell_is_the_decisive_studys_adamw_cell():
  studies = ROOT / "configs" / "studies"
  path = ["train.data.path=runs/corpus_dedup"]
  twin = SC.load(studies / "bc_paper_gpt2_twin.yaml", path)
  dec = SC.load(studies / "bc_paper_gpt2_decisive.yaml", path)
  cell = lambda st, arm: next(c for c in st.search_cells() if c.arm == arm and c.seed == 0)
  fp = lambda st, arm: SC.fingerprint(st.cell_config(cell(st, arm)).to_dict())
  assert fp(twin, "adamw") == fp(dec, "adamw") == fp(twin, "adamw_twin")
  assert twin.cell_config(cell(twin, "adamw")).run.deterministic
  assert twin.twins == [("adamw", "adamw_twin")]
