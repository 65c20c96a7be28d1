"""The correction's size per layer beside a study's contrasts: telemetry curves go from a cell's
metrics.jsonl into the store, and summary.md prints, per arm and group, the median over seeds
at each telemetry step (planted values whose median is known by construction)."""

import json
import math

from scaleopt.study import config as SC
from scaleopt.study import report, store

from test_study_config import BC_TINY, _raw

GROUPS = ("layer10.attn", "embed", "layer2.mlp")  # natural order: embed, layer2.mlp, layer10.attn
STEPS = (50, 100)
# seed -> value at (group, step); per (group, step) the three seeds' values are a permutation
# of (lo, mid, hi), so the median is `mid` whatever the order.
MID = {(g, s): 10.0 ** -(i + 3) * (1 + j)
       for i, g in enumerate(GROUPS) for j, s in enumerate(STEPS)}


def _value(seed: int, g: str, s: int) -> float:
  m = MID[(g, s)]
  return (0.5 * m, m, 3.0 * m)[(seed + len(g) + s) % 3]


def _study():
  raw = _raw()
  raw["learning_rates"] = [1e-2, 3e-3]  # 3e-3: worse val loss, its telemetry x100
  raw["seeds"] = [0, 1, 2]
  raw["arms"] = {"adamw": {"optimizer.name": "adamw"},
                 "loo": {"optimizer.name": "adamw_bc",
                         "optimizer.extra": {"mode": "full", "crossfit": "loo"}}}
  raw["contrasts"] = [["loo", "adamw", "the correction"]]
  return SC.from_dict(raw, BC_TINY)


def _metrics(d, seed: int, telemetry: bool, scale: float = 1.0) -> None:
  rows = [{"step": s, "loss": 3.0 - s / 1000} for s in (10, 50, 90, 100)]
  for r in rows:
    if telemetry and r["step"] in STEPS:
      r.update({f"bc_correction/{g}": scale * _value(seed, g, r["step"]) for g in GROUPS},
               **{f"update_norm/{g}": 1.0 for g in GROUPS})
  d.mkdir(parents=True)
  (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _finish(out, st):
  for c in st.search_cells():
    d = out / "cells" / c.arm / c.id.split("/", 1)[1]
    worse = c.lr < 1e-2
    _metrics(d, c.seed, telemetry=c.arm == "loo", scale=100.0 if worse else 1.0)
    (d / "result.json").write_text(json.dumps(
        {"id": c.id, "arm": c.arm, "lr": c.lr, "seed": c.seed, "stage": c.stage,
         "status": "ok", "gradient_passes": 1.0, "val_loss": 3.0 + c.seed + worse,
         "test_loss": 3.0 + c.seed + (0.01 if c.arm == "loo" else 0.0)}))
  store.absorb(out, remove=True)


def test_store_keeps_the_correction_curves_and_not_the_other_telemetry(tmp_path):
  st = _study()
  _finish(tmp_path, st)
  rows = {(r["arm"], r["seed"]): r for r in store.rows(tmp_path) if r["lr"] == 1e-2}
  curves = rows[("loo", 1)]["curves"]
  for g in GROUPS:
    assert curves[f"bc_correction/{g}"] == {s: _value(1, g, s) for s in STEPS}
  assert not any(k.startswith("update_norm/") for k in curves)
  assert curves["loss"][100] == 2.9
  assert not any(k.startswith("bc_correction/") for k in rows[("adamw", 0)]["curves"])


def test_summary_prints_the_median_per_group_and_step_for_the_arms_that_have_it(tmp_path):
  st = _study()
  _finish(tmp_path, st)
  text = report.summary_md(st, store.rows(tmp_path),
                           report.analyse(st, report.read_rows(tmp_path)), set())
  section = text.split("## The correction's size per layer")[1].split("\n## ")[0]
  assert "`loo`" in section and "`adamw`" not in section
  lines = [ln for ln in section.splitlines() if ln.startswith("| ")]
  assert lines[0] == "| group | step 50 | step 100 |"
  assert [ln.split(" | ")[0][2:] for ln in lines[1:]] == ["embed", "layer2.mlp", "layer10.attn"]
  for ln in lines[1:]:
    g, *vals = [x.strip() for x in ln.strip("| ").split("|")]
    for s, v in zip(STEPS, vals):
      assert math.isclose(float(v), MID[(g, s)], rel_tol=5e-3), (g, s, v)


def test_no_section_without_telemetry(tmp_path):
  st = _study()
  for c in st.search_cells():
    d = tmp_path / "cells" / c.arm / c.id.split("/", 1)[1]
    _metrics(d, c.seed, telemetry=False)
    (d / "result.json").write_text(json.dumps(
        {"id": c.id, "arm": c.arm, "lr": c.lr, "seed": c.seed, "stage": c.stage,
         "status": "ok", "gradient_passes": 1.0, "val_loss": 3.0, "test_loss": 3.0}))
  store.absorb(tmp_path, remove=True)
  text = report.summary_md(st, store.rows(tmp_path),
                           report.analyse(st, report.read_rows(tmp_path)), set())
  assert "size per layer" not in text
