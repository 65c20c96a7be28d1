"""Cheap cells: lr/seed cells in one vmapped, once-compiled step equal ordinary training runs."""

import copy
import json
import pathlib
import sys

import jax
import numpy as np
import pytest

from scaleopt.study import vmapped
from scaleopt.train import checkpoint, config as C, loop, metrics

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "train"))
from train_helpers import tiny_raw  # noqa: E402


def _cfg(lr, seed, steps=6):
  raw = tiny_raw(run={"steps": steps, "log_every": 1, "eval_every": 0, "eval_tokens": 256,
                      "checkpoint_every": 0, "tensorboard": False, "seed": seed,
                      "async_checkpoint": False},
                 data={"seq_len": 32, "batch_size": 8, "microbatches": 2},
                 optimizer={"name": "adamw_bc", "learning_rate": lr,
                            "extra": {"mode": "full", "crossfit": "loo"},
                            "schedule": {"kind": "cosine", "warmup_steps": 2,
                                         "min_lr_ratio": 0.1}})
  return C.from_dict(raw)


def _params(d, cfg):
  s = loop.setup(cfg)
  fns = loop.compile_fns(s)
  ck = checkpoint.Checkpointer(d / "checkpoints", 2, False)
  state, _ = ck.restore(ck.latest_step(), checkpoint.abstract(fns.state_shape, fns.state_sh))
  ck.close()
  return state.params


@pytest.mark.integration
def test_vmapped_cells_equal_ordinary_runs_and_share_one_compile(tmp_path):
  cfgs = [_cfg(3e-3, 0), _cfg(1e-2, 1)]
  dirs = [tmp_path / "v0", tmp_path / "v1"]
  res = vmapped.train_group(cfgs, dirs, resume_step=None, key="t")
  assert res.status == ["ok", "ok"]
  assert res.train_loss[0] != res.train_loss[1]  # the cells differ: the check is not vacuous
  cfg, d = cfgs[1], dirs[1]
  ref = tmp_path / "ref"  # reference: the ordinary trainer, lr inside the schedule
  loop.train(cfg, ref)
  got = metrics.read_metrics(d / "metrics.jsonl")
  want = metrics.read_metrics(ref / "metrics.jsonl")
  assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 7))
  for k in ("loss", "grad_norm", "update_norm", "lr"):
    np.testing.assert_allclose([r[k] for r in got], [r[k] for r in want], rtol=2e-4, err_msg=k)
  # the cell's checkpoint is a loop checkpoint: same tree, same values per coordinate
  pv, pr = _params(d, cfg), _params(ref, cfg)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), pv, pr)
  summ = json.loads((d / "summary.json").read_text())
  assert summ["steps"] == 6 and summ["cells_at_once"] == 2
  # one format: the cell's metrics rows and summary carry what the trainer's carry
  assert [sorted(r) for r in got] == [sorted(r) for r in want]
  ref_summ = json.loads((ref / "summary.json").read_text())
  assert set(ref_summ) <= set(summ), set(ref_summ) - set(summ)
  for k in ("steps", "tokens", "skipped_steps", "optimizer", "layout", "optimizer_numerics"):
    assert summ[k] == ref_summ[k], k  # (eval_set differs: a cell is scored on the val half)

  # other learning rates and seeds of the same group: the same executable, no recompile
  fns = vmapped.group_fns(None, 2, False, key="t")
  assert fns.step._cache_size() == 1
  res2 = vmapped.train_group([_cfg(5e-3, 3), _cfg(7e-3, 4)], [tmp_path / "c", tmp_path / "e"],
                             resume_step=None, key="t")
  assert fns.step._cache_size() == 1
  assert res2.status == ["ok", "ok"] and res2.train_loss[0] != res.train_loss[0]


@pytest.mark.integration
def test_a_diverged_cell_is_marked_and_the_group_stops_only_when_every_cell_has(tmp_path,
                                                                                capsys):
  """The trainer's skip guard per cell: a cell whose steps are non-finite (lr 1e30) reaches
  run.max_consecutive_skips and is marked diverged while its neighbour trains to the end;
  a group whose every cell diverges stops there, as an ordinary run does."""
  def cfg(lr, seed):
    raw = copy.deepcopy(_cfg(lr, seed, steps=12).to_dict())
    raw["run"]["max_consecutive_skips"] = 3
    raw["optimizer"].update(name="adamw", extra={})
    return C.from_dict(raw)

  res = vmapped.train_group([cfg(1e30, 0), cfg(3e-3, 1)], [tmp_path / "a", tmp_path / "b"],
                            resume_step=None)
  assert res.status == ["diverged", "ok"]
  rows = [metrics.read_metrics(tmp_path / d / "metrics.jsonl") for d in "ab"]
  assert [r["step"] for r in rows[1]] == list(range(1, 13))
  assert rows[0][-1]["consec"] >= 3 and rows[1][-1]["consec"] == 0
  assert np.isfinite(res.test_loss[1]) and res.test_loss[1] < res.train_loss[1] + 1.0
  assert json.loads((tmp_path / "a" / "summary.json").read_text())["stopped_early"] is True
  out = capsys.readouterr().out  # one progress line per cell and log (run.progress is off)
  assert "[lr 0.003 seed 1] step 12/12 loss" in out

  res = vmapped.train_group([cfg(1e30, 0), cfg(2e30, 1)], [tmp_path / "c", tmp_path / "d"],
                            resume_step=None)
  assert res.status == ["diverged", "diverged"]
  last = metrics.read_metrics(tmp_path / "c" / "metrics.jsonl")[-1]["step"]
  assert last < 12 and json.loads((tmp_path / "c" / "summary.json").read_text())["steps"] == last


@pytest.mark.slow
@pytest.mark.parametrize("name, extra", [
    ("sophia_bc", {"mode": "full", "crossfit": "rolling_b", "k": 2}),
    ("shampoo_bc", {"mode": "full", "crossfit": "rolling_b", "root_every": 2, "graft": "adam"}),
    ("muon", {}),
])
def test_other_optimizers_take_the_learning_rate_linearly(tmp_path, name, extra):
  """engines.LR_LINEAR: the one-cell vmap path (traced lr on the lr-1 optimizer) follows an
  ordinary run with the lr in the schedule, refresh / root steps included."""
  raw = copy.deepcopy(_cfg(1e-2, 1, steps=5).to_dict())
  raw["optimizer"].update(name=name, extra=extra, learning_rate=2e-3)
  cfg = C.from_dict(raw)
  vmapped.train_group([cfg], [tmp_path / "v"], resume_step=None)
  loop.train(cfg, tmp_path / "ref")
  got = metrics.read_metrics(tmp_path / "v" / "metrics.jsonl")
  want = metrics.read_metrics(tmp_path / "ref" / "metrics.jsonl")
  for k in ("loss", "update_norm"):
    np.testing.assert_allclose([r[k] for r in got], [r[k] for r in want], rtol=5e-4, err_msg=k)


def test_offloaded_statistics_in_study_cells_are_a_config_error(tmp_path):
  """Vmapped cells run each cell's statistics step on every step (a batched ``lax.cond``), so
  host-resident statistics would cross to the device every step: a one-line config error."""
  raw = copy.deepcopy(_cfg(2e-3, 0, steps=2).to_dict())
  raw["optimizer"].update(name="shampoo", extra={"block_size": 16, "offload_statistics": True})
  with pytest.raises(C.ConfigError, match="offload_statistics=true: study cells run vmapped"):
    vmapped.train_group([C.from_dict(raw)], [tmp_path / "v"], resume_step=None)
  assert not (tmp_path / "v").exists()
