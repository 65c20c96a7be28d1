"""The two ways a study trains its cells, both returning the same per-cell result dicts.

``run_loop``: one ordinary ``scaleopt.train.loop.train`` run (any mesh, one compile per cell).
``run_vmapped``: a group of cells through ``vmapped.train_group`` (one device, one compile per
group). Both evaluate the held-out split's ``val`` part (learning-rate selection) and its
``test`` part (reported numbers) at the end, each on its fixed evaluation set
(``data.heldout_eval_sets``: ``run.eval_tokens`` of it, the same for every batch size); each
result records both sets' hashes, and the report compares only cells scored on the same ones.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Optional

import jax

from scaleopt.train import checkpoint, data, evaluation, faults, loop
from scaleopt.train.config import TrainConfig

NAN = float("nan")


# Optimizers whose peak learning rate enters only through the final
# ``scale_by_learning_rate(schedule)`` (checked against ordinary runs in tests/study): the vmap
# engine may trace it. Optimizers registered elsewhere run on the loop engine.
LR_LINEAR = ("adamw", "adamw_bc", "muon", "sophia", "sophia_bc", "shampoo", "shampoo_bc")
# Of those, the ones whose step has no data-dependent branch. Sophia's curvature refresh and
# Shampoo's statistics / root steps sit under ``lax.cond``; under ``vmap`` the step counter is
# batched and both branches would run every step, so their cells go one at a time (one compile).
VMAP_SAFE = ("adamw", "adamw_bc", "muon")


def vmap_ok(cfg: TrainConfig) -> bool:
  """The vmap engine runs on one device, from a fresh initialization (no ``model.init_from``)
  and with an optimizer of ``LR_LINEAR``; other cells fall back to the loop engine."""
  m = cfg.mesh
  one = jax.device_count() == 1 or (m.data == 1 and m.fsdp == 1 and m.tensor == 1)
  return one and not cfg.model.init_from and cfg.optimizer.name in LR_LINEAR


def gradient_passes(cfg: TrainConfig, spec, steps: int) -> float:
  """Sequences through forward + backward: steps x batch x groups x passes per step. Sophia's
  curvature pass is one more pass every ``refresh_every`` steps where it reruns the step's
  own microbatches (``all``, ``symmetric``); with ``ab`` it takes group B's place on refresh
  steps, and ``rolling_b`` counts it in ``passes_per_step``."""
  passes = spec.passes_per_step
  if spec.estimator in ("gnb", "hutchinson") and spec.layout not in ("ab", "rolling_b"):
    passes += 1.0 / spec.refresh_every
  return float(steps * cfg.data.batch_size * spec.num_groups * passes)


def _result(cfg, spec, summ: dict, status: str, val: float, test: float, engine: str) -> dict:
  steps = int(summ.get("steps") or 0)
  bad = status != "ok"
  return {"status": status, "steps": steps, "tokens": summ.get("tokens"),
          "gradient_passes": gradient_passes(cfg, spec, steps),
          "val_loss": NAN if bad else val, "test_loss": NAN if bad else test,
          "train_loss": summ.get("final_train_loss"), "wall_time_s": summ.get("wall_time_s"),
          "tokens_per_s": summ.get("tokens_per_s"),
          "cells_at_once": summ.get("cells_at_once", 1), "engine": engine,
          "card": summ.get("device_kind") or jax.devices()[0].device_kind,
          "val_set": summ.get("eval_set"), "test_set": summ.get("test_set")}


def _heldout_losses(cell_setup: loop.Setup, compiled: loop.Compiled, params) -> dict:
  sets = data.heldout_eval_sets(cell_setup.val_w, cell_setup.cfg.run.eval_tokens)
  return {p: evaluation.make_evaluate(cell_setup.cfg, compiled, ev, False)(params)
          for p, ev in sets.items()}


def run_loop(cfg: TrainConfig, d: pathlib.Path, resume: bool) -> dict:
  """One cell as an ordinary training run; evaluation during training uses the val part."""
  cell_setup = loop.setup(cfg)
  val_setup = dataclasses.replace(cell_setup, val_w=data.heldout_part(cell_setup.val_w, "val"))
  status = "ok"
  try:
    loop.train(cfg, d, resume=resume, s=val_setup)
  except faults.SkipLimit:
    status = "diverged"
  except faults.Interrupted:
    return {"status": "interrupted"}
  summ = json.loads((d / "summary.json").read_text())
  summ["test_set"] = evaluation.eval_identity(data.heldout_eval_sets(
      cell_setup.val_w, cfg.run.eval_tokens)["test"])["eval_set"]
  losses = {"val": NAN, "test": NAN}
  if status == "ok":
    compiled = loop.compile_fns(cell_setup)
    ck = checkpoint.Checkpointer(d / "checkpoints", cfg.run.keep_checkpoints, False)
    state, _ = ck.restore(ck.latest_step(),
                          checkpoint.abstract(compiled.state_shape, compiled.state_sh))
    ck.close()
    losses = _heldout_losses(cell_setup, compiled, state.params)
  return _result(cfg, cell_setup.spec, summ, status, losses["val"], losses["test"], "loop")


def run_vmapped(cfgs: list[TrainConfig], dirs: list[pathlib.Path], resume_step: Optional[int],
                should_stop, key: Optional[str] = None) -> list[dict]:
  from scaleopt.study import vmapped
  res = vmapped.train_group(cfgs, dirs, resume_step=resume_step, should_stop=should_stop,
                            key=key)
  out = []
  for i, cfg in enumerate(cfgs):
    if res.status[i] == "interrupted":
      out.append({"status": "interrupted"})
      continue
    out.append(_result(cfg, res.spec, res.summaries[i], res.status[i], res.val_loss[i],
                       res.test_loss[i], "vmap"))
  return out
