"""A study's report from its finished cells: results.csv, summary.md, curves.png, lr.png
(and contrasts.png for a study with ``contrasts``).

Statistics (all over seeds, n = number of finished seeds):

* mean and 95% Student-t interval: ``mean +- t_{0.975, n-1} s / sqrt(n)``, s the sample
  standard deviation (ddof 1); no interval for n < 2.
* the difference from the baseline arm, paired by seed (equal seeds share the initialization
  and, for equal data layouts, the batches): the t-interval of the per-seed differences
  ``d_s = loss_arm(s) - loss_baseline(s)`` over the seeds both have.
* seeds for a target half-width (``contrasts``): the smallest n with
  ``t_{0.975, n-1} sd / sqrt(n) <= target_half_width``, sd from the seeds so far
  (``scaleopt.study.seedplan``; a plan, not a guarantee).
* learning rate: per condition (arm x grid point) the lr with the lowest mean ``val`` loss over
  the search seeds; reported numbers are ``test`` losses at that lr (a disjoint split).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import pathlib
from typing import Optional, Sequence

import numpy as np
from scipy import stats as sps

from scaleopt.study import corrections, seedplan, store, twins
from scaleopt.train import provenance

COLUMNS = ("cell", "arm", "lr", "seed", "stage", "status", "steps", "tokens", "gradient_passes",
           "val_loss", "test_loss", "train_loss", "wall_time_s", "tokens_per_s",
           "cells_at_once", "engine", "card")


@dataclasses.dataclass(frozen=True)
class Interval:
  mean: float
  lo: float
  hi: float
  n: int

  def fmt(self, digits: int = 4, signed: bool = False) -> str:
    f = f"{'+' if signed else ''}.{digits}f"
    if self.n == 0:
      return "-"
    if self.n < 2:
      return f"{self.mean:{f}} (n=1)"
    return f"{self.mean:{f}} [{self.lo:{f}}, {self.hi:{f}}]"


def t_interval(x: Sequence[float], level: float = 0.95) -> Interval:
  """Mean and two-sided Student-t interval of the mean (normal samples, unknown variance)."""
  x = np.asarray([v for v in x if v is not None and math.isfinite(v)], np.float64)
  n = x.size
  if n == 0:
    return Interval(math.nan, math.nan, math.nan, 0)
  m = float(x.mean())
  if n < 2:
    return Interval(m, math.nan, math.nan, 1)
  half = float(sps.t.ppf(0.5 + level / 2, n - 1) * x.std(ddof=1) / math.sqrt(n))
  return Interval(m, m - half, m + half, n)


def paired_interval(a: dict, b: dict, level: float = 0.95) -> Interval:
  """t-interval of a[s] - b[s] over the seeds s where both are finite."""
  common = [s for s in a if s in b and _finite(a[s]) and _finite(b[s])]
  return t_interval([a[s] - b[s] for s in sorted(common)], level)


def verdict(iv: Interval) -> str:
  if iv.n < 2 or not math.isfinite(iv.lo):
    return "n < 2"
  return "lower" if iv.hi < 0 else ("higher" if iv.lo > 0 else "n.s.")


def _finite(v) -> bool:
  return v is not None and isinstance(v, (int, float)) and math.isfinite(v)


def clean(d: dict) -> dict:
  return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


# ---------------------------------------------------------------------------------------------
# Finished cells.


def finished_ids(out: pathlib.Path) -> set:
  return {r["cell"]["id"] for r in store.finished(pathlib.Path(out))}


def read_rows(out: pathlib.Path) -> list[dict]:
  """The finished cells of ``out`` (``store.finished``), sorted by cell id; all scored on the
  same held-out sets (``check_eval_sets``)."""
  rows = sorted(store.rows(pathlib.Path(out)), key=lambda r: r["id"])
  check_eval_sets(rows)
  check_corpora(rows)
  return rows


def check_corpora(rows: list[dict]) -> None:
  """ConfigError (one line naming two cells) when cells were trained on different corpora
  (the ``content_sha256`` of their provenance: every shard and the tokenizer). Cells recorded
  without one (before provenance was kept) are not compared."""
  from scaleopt.config import ConfigError
  first = {}
  for r in rows:
    key = provenance.corpus_key(r.get("provenance"))
    if key is not None:
      first.setdefault(key, r)
  if len(first) > 1:
    (ha, a), (hb, b) = list(first.items())[:2]
    raise ConfigError(f"cells {a.get('id')} and {b.get('id')} were trained on different "
                      f"corpora ({str(ha)[:12]} vs {str(hb)[:12]}: other shards or tokenizer); "
                      "a report compares only cells trained on the same corpus")


def check_eval_sets(rows: list[dict]) -> None:
  """ConfigError (one line naming two cells) when cells were scored on different held-out
  sets (``val_set`` / ``test_set``, the hashes of ``scaleopt.train.data.EvalSet``): their
  losses are not comparable. Cells that recorded no hash all agree with one another."""
  from scaleopt.config import ConfigError
  for key in ("val_set", "test_set"):
    first = {}
    for r in rows:
      first.setdefault(r.get(key), r)
    if len(first) > 1:
      (ha, a), (hb, b) = list(first.items())[:2]
      raise ConfigError(f"cells {a.get('id')} and {b.get('id')} were scored on different "
                        f"{key[:-4]} sets ({ha} vs {hb}: other data, seq_len or "
                        "run.eval_tokens); a report compares only cells scored on the same set")


def _cond_rows(st, rows: list[dict], cond: tuple) -> list[dict]:
  arm, grid = cond
  return [r for r in rows if r["arm"] == arm and all(
      str(r.get(k)) == str(v) for k, v in grid)]


def lr_table(st, rows: list[dict], cond: tuple) -> dict:
  """lr -> (mean val loss over the search seeds, finished seeds, non-finite seeds)."""
  out = {}
  for lr in st.lrs(cond[0]):
    vals = [r["val_loss"] for r in _cond_rows(st, rows, cond)
            if math.isclose(r["lr"], lr, rel_tol=1e-9) and r["seed"] in st.arm_seeds(cond[0])]
    ok = [v for v in vals if _finite(v)]
    mean = float(np.mean(ok)) if ok and len(ok) == len(vals) else math.inf
    out[lr] = (mean, len(vals), len(vals) - len(ok))
  return out


def at_edge(st, c: "Condition") -> bool:
  """The best lr is the smallest or largest of the arm's grid (with 3 or more lrs): the grid
  may not bracket the optimum; extend it."""
  lrs = st.lrs(c.arm)
  return c.best_lr is not None and len(lrs) >= 3 and (
      math.isclose(c.best_lr, min(lrs)) or math.isclose(c.best_lr, max(lrs)))


def best_lr(st, rows: list[dict], cond: tuple) -> Optional[float]:
  """The lr with the lowest mean val loss once every search cell of ``cond`` is finished (an
  lr where any seed diverged counts as infinitely bad); None before."""
  tab = lr_table(st, rows, cond)
  if any(n < len(st.arm_seeds(cond[0])) for _, n, _ in tab.values()):
    return None
  return min(tab, key=lambda lr: (tab[lr][0], lr))


@dataclasses.dataclass
class Condition:
  arm: str
  grid: tuple
  best_lr: Optional[float]
  test: dict  # seed -> test loss at the best lr
  val: dict
  passes: Optional[float]
  curves: dict  # seed -> {curve name: {step: value}} at the best lr


def analyse(st, rows: list[dict]) -> list[Condition]:
  out = []
  for cond in dict.fromkeys(c.condition for c in st.search_cells()):
    lr = best_lr(st, rows, cond)
    sel = [r for r in _cond_rows(st, rows, cond)
           if lr is not None and math.isclose(r["lr"], lr, rel_tol=1e-9)]
    out.append(Condition(cond[0], cond[1], lr, {r["seed"]: r["test_loss"] for r in sel},
                         {r["seed"]: r["val_loss"] for r in sel},
                         sel[0]["gradient_passes"] if sel else None,
                         {r["seed"]: r["curves"] for r in sel}))
  return out


# ---------------------------------------------------------------------------------------------
# Outputs.


def write_csv(st, rows: list[dict], path: pathlib.Path) -> None:
  grid_keys = list(st.grid)
  cols = ["cell", "arm", *grid_keys, *COLUMNS[2:]]
  with path.open("w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for r in sorted(rows, key=lambda r: r["id"]):
      w.writerow({**{k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()},
                  "cell": r["id"]})


def _grid_str(grid: tuple) -> str:
  return ", ".join(f"{k}={v}" for k, v in grid) or "-"


def _own_baselines(st, conds: list[Condition], has_grid: bool) -> list[str]:
  """Rows for arms that name their own baseline (``arms.X.baseline``): X minus that arm,
  paired by seed, at each one's best lr."""
  by = {(c.arm, c.grid): c for c in conds}
  out = []
  for c in conds:
    ob = by.get((st.arms[c.arm].get("baseline"), c.grid))
    if ob is None:
      continue
    if c.best_lr is None or ob.best_lr is None:
      d, ver = "search unfinished", "-"
    else:
      iv = paired_interval(c.test, ob.test)
      d, ver = iv.fmt(signed=True), verdict(iv)
    out.append("| " + " | ".join([c.arm] + ([_grid_str(c.grid)] if has_grid else [])
                                 + [ob.arm, d, ver]) + " |")
  if not out:
    return []
  head = ["arm"] + (["grid"] if has_grid else []) + ["own baseline", "diff [95% CI]", "verdict"]
  return ["", "Against each arm's own baseline (its standard form, each at its best lr; paired "
          "by seed):", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"] + out


def contrast_rows(st, conds: list[Condition]) -> list[dict]:
  """The study's ``contrasts``, one row per (contrast, grid point): arm_a - arm_b in ``test``
  loss, paired by seed (``paired_interval``), each arm at its best lr (the fixed one when the
  arm has a single learning rate)."""
  by = {(c.arm, c.grid): c for c in conds}
  rows = []
  for a, b, label in st.contrasts:
    for g in dict.fromkeys(c.grid for c in conds):
      ca, cb = by[(a, g)], by[(b, g)]
      ready = ca.best_lr is not None and cb.best_lr is not None
      iv = paired_interval(ca.test, cb.test) if ready else None
      per_seed = {s: ca.test[s] - cb.test[s] for s in sorted(set(ca.test) & set(cb.test))
                  } if ready else {}  # a diverged seed (non-finite) is printed as such
      rows.append({"a": a, "b": b, "label": label, "grid": g, "interval": iv,
                   "verdict": verdict(iv) if ready else "-", "per_seed": per_seed,
                   "plan": seedplan.seed_plan(ca.test, cb.test, st.target_half_width)
                   if ready else None})
  return rows


def contrast_lines(st, conds: list[Condition], has_grid: bool) -> list[str]:
  """The ``contrasts`` table of summary.md (nothing when the study has none)."""
  rows = contrast_rows(st, conds)
  if not rows:
    return []
  h = st.target_half_width
  head = ["contrast"] + (["grid"] if has_grid else []) + [
      "isolates", "seeds", "diff a - b [95% CI]", "verdict", "per seed", "sd of diff",
      "half-width", f"seeds for +-{h:g}"]
  out = ["", "## Contrasts", "",
         "Each row is arm a minus arm b in `test` loss, paired by seed (t-interval of the "
         "per-seed differences over the seeds both finished); `lower`: a is better.", "",
         "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
  for r in rows:
    d = "unfinished" if r["interval"] is None else r["interval"].fmt(signed=True)
    p = r["plan"]
    plan = ["-"] * 3 if p is None or p.n < 2 else [
        f"{p.sd:.4f}", f"{p.half_width:.4f}", p.needed_str()]
    out.append("| " + " | ".join(
        [f"{r['a']} - {r['b']}"] + ([_grid_str(r["grid"])] if has_grid else [])
        + [r["label"], "-" if r["interval"] is None else str(r["interval"].n), d,
           r["verdict"], ", ".join(f"s{s} {v:+.4f}" if _finite(v) else f"s{s} diverged"
                                   for s, v in r["per_seed"].items()) or "-"] + plan)
        + " |")
  out += ["", f"Seed plan: `sd of diff` is the sample s.d. of the per-seed differences, "
          "`half-width` the 95% interval's half-width now, and the last column the smallest n "
          f"with t(0.975, n-1) sd / sqrt(n) <= {h:g} (`target_half_width`), sd from the seeds "
          "so far: a plan, not a guarantee (sd from few seeds is itself uncertain)."]
  if st.sequential:
    names = [f"{a} - {b}" for a, b, _ in seedplan.driving(st)]
    out += [f"Sequential seeds (up to {st.sequential.max_seeds} per arm) go to the contrasts "
            f"{', '.join(names)} while their half-width is above {h:g}."]
  return out


def _count_line(rows: list[dict], planned: set[str]) -> str:
  """'N of M planned cells finished', naming finished cells outside the current plan (extra seeds
  at a learning rate that was best before the grid changed): kept in results.csv, not used."""
  done = {r["id"] for r in rows}
  line = f"{len(done & planned)} of {len(planned)} planned cells finished"
  extra = len(done - planned)
  return line + (f" (and {extra} cell(s) outside the current plan, e.g. extra seeds at "
                 "a former best lr: in results.csv, not used below)" if extra else "")


def summary_md(st, rows: list[dict], conds: list[Condition], planned: set[str]) -> str:
  cards = sorted({r.get("card") for r in rows if r.get("card")})
  base = {c.grid: c for c in conds if c.arm == st.baseline}
  by = {(c.arm, c.grid): c for c in conds}
  has_grid = bool(st.grid)
  lines = [f"# Study `{st.name}`", "",
           _count_line(rows, planned) + f"; card(s): {', '.join(cards) or '-'}.",
           "Learning rate chosen per arm (and grid point) on the `val` half of the held-out "
           "split (lowest mean over the search seeds "
           f"{st.seeds}); every number below is the `test` half, at that learning rate. "
           "Intervals: 95% Student-t over seeds (mean +- t(0.975, n-1) s/sqrt(n)); "
           f"differences from `{st.baseline}` are paired by seed (t-interval of the per-seed "
           "differences). Verdict: `lower`/`higher` when the interval excludes 0, else `n.s.`.",
           ""]
  if any(r.get("provenance") for r in rows):  # cells recorded with their provenance
    lines[3:3] = ["Cells came from " + provenance.describe_sources(
        [r.get("provenance") for r in rows]) + ".", ""]
  head = ["arm"] + (["grid"] if has_grid else []) + [
      "best lr", "seeds", "test loss [95% CI]", "grad passes", f"diff vs {st.baseline} [95% CI]",
      "verdict", "at equal grad passes"]
  lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
  for c in conds:
    iv = t_interval(list(c.test.values()))
    b = base.get(c.grid)
    diff, ver, eq = "-", "-", "-"
    ratio = "-"
    if b is not None and c.arm != st.baseline and b.best_lr is not None and c.best_lr is not None:
      d = paired_interval(c.test, b.test)
      diff, ver = d.fmt(signed=True), verdict(d)
      if c.passes and b.passes and not math.isclose(c.passes, b.passes):
        found = []
        for cb in st.compute_baselines:
          o = by.get((cb, c.grid))
          if cb != c.arm and o and o.passes and math.isclose(o.passes, c.passes):
            de = paired_interval(c.test, o.test)
            found.append(f"vs {cb}: {de.fmt(signed=True)} {verdict(de)}")
        eq = "; ".join(found) or "no equal-pass baseline"
    if b is not None and c.passes and b.passes:
      ratio = f"{c.passes / b.passes:g}x"
    n_bad = sum(not _finite(v) for v in c.test.values())
    seeds = f"{iv.n}" + (f" (+{n_bad} diverged)" if n_bad else "")
    lr = ("search unfinished" if _cond_rows(st, rows, (c.arm, c.grid)) else "not run yet"
          ) if c.best_lr is None else (
        f"{c.best_lr:g}" + (" (grid edge)" if at_edge(st, c) else ""))
    cells = [c.arm] + ([_grid_str(c.grid)] if has_grid else []) + [
        lr, seeds, iv.fmt(), ratio, diff, ver, eq]
    lines.append("| " + " | ".join(cells) + " |")
  lines += _own_baselines(st, conds, has_grid)
  lines += contrast_lines(st, conds, has_grid)
  lines += corrections.lines(st, conds)
  lines += twins.lines(st, rows)
  if any(at_edge(st, c) for c in conds):
    lines += ["", "(grid edge): the best lr is the smallest or largest tried, so the grid may not "
              "bracket that arm's optimum; its numbers are an upper bound on its loss."]
  lines += ["", "## Learning-rate search", "",
            "Mean `val` loss over the search seeds (inf: a seed diverged; - : unfinished).", ""]
  all_lrs = sorted({lr for a in st.arms for lr in st.lrs(a)})
  head = ["arm"] + (["grid"] if has_grid else []) + [f"{lr:g}" for lr in all_lrs]
  lines += ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
  for c in conds:
    tab = lr_table(st, rows, (c.arm, c.grid))
    cells = []
    for lr in all_lrs:
      if lr not in tab or tab[lr][1] < len(st.arm_seeds(c.arm)):
        cells.append("-")
      else:
        v = f"{tab[lr][0]:.4f}"
        cells.append(f"**{v}**" if c.best_lr is not None and math.isclose(lr, c.best_lr) else v)
    lines.append("| " + " | ".join([c.arm] + ([_grid_str(c.grid)] if has_grid else []) + cells)
                 + " |")
  lines += ["", "Files: `results.csv` (one row per cell), `curves.png` (loss curves at each "
            "arm's best lr; line = mean over seeds, band = min..max), `lr.png` (final val loss "
            "against lr; bars = min..max over seeds)"
            + (", `contrasts.png` (each contrast's paired loss difference a - b over steps: "
               "thin lines per seed, thick their mean)" if st.contrasts else "") + ".", ""]
  return "\n".join(lines)


def plot(st, rows: list[dict], conds: list[Condition], out: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  grids = list(dict.fromkeys(c.grid for c in conds))
  arms = list(st.arms)
  color = {a: f"C{i % 10}" for i, a in enumerate(arms)}
  w = min(4.5 * len(grids), 18)
  fig, axes = plt.subplots(1, len(grids), figsize=(w, 3.8), squeeze=False)
  for ax, g in zip(axes[0], grids):
    for c in conds:
      if c.grid != g or not c.curves:
        continue
      for key, ls, lab in (("loss", "-", "train"), ("eval_loss", "--", "val")):
        curves = [cv[key] for cv in c.curves.values()]
        steps = sorted(set.intersection(*(set(cv) for cv in curves))) if curves else []
        if not steps:
          continue
        y = np.array([[cv[s] for s in steps] for cv in curves], np.float64)
        ax.plot(steps, y.mean(0), ls=ls, color=color[c.arm], marker="o" if lab == "val" else None,
                ms=3, label=f"{c.arm} {lab} (lr {c.best_lr:g}, n={len(curves)})")
        ax.fill_between(steps, y.min(0), y.max(0), color=color[c.arm], alpha=0.2, lw=0)
    _finish(ax, _grid_str(g) if st.grid else st.name, "step", "loss (nats/token)")
  _save(fig, out / "curves.png")

  fig, axes = plt.subplots(1, len(grids), figsize=(w, 3.8), squeeze=False)
  for ax, g in zip(axes[0], grids):
    for a in arms:
      pts = []
      for lr in st.lrs(a):
        v = [r["val_loss"] for r in _cond_rows(st, rows, (a, g))
             if math.isclose(r["lr"], lr, rel_tol=1e-9) and _finite(r["val_loss"])]
        if v:
          pts.append((lr, np.mean(v), np.min(v), np.max(v)))
      if pts:
        x, m, lo, hi = map(np.array, zip(*pts))
        ax.errorbar(x, m, yerr=[m - lo, hi - m], color=color[a], marker="o", capsize=3, label=a)
    ax.set_xscale("log")
    _finish(ax, _grid_str(g) if st.grid else st.name, "peak learning rate", "final val loss")
  _save(fig, out / "lr.png")
  if st.contrasts:
    plot_contrasts(st, conds, out / "contrasts.png")


def plot_contrasts(st, conds: list[Condition], path: pathlib.Path) -> None:
  """One panel per contrast (and grid point): the per-seed difference a - b of the train loss
  (solid) and of the val loss (markers) at the steps both arms logged; the thick line is the
  mean over the seeds both finished."""
  import matplotlib.pyplot as plt
  by = {(c.arm, c.grid): c for c in conds}
  panels = [(a, b, g) for a, b, _ in st.contrasts for g in dict.fromkeys(c.grid for c in conds)]
  cols = min(len(panels), 3)
  rows_n = -(-len(panels) // cols)
  fig, axes = plt.subplots(rows_n, cols, figsize=(4.2 * cols, 3.2 * rows_n), squeeze=False)
  for ax, (a, b, g) in zip(axes.flat, panels):
    ca, cb = by[(a, g)], by[(b, g)]
    for key, name, style, color in (("loss", "train", "-", "C0"), ("eval_loss", "val", "o", "C1")):
      diffs = []  # per seed: {step: a - b}
      for s in sorted(set(ca.curves) & set(cb.curves)):
        xa, xb = ca.curves[s].get(key, {}), cb.curves[s].get(key, {})
        d = {t: xa[t] - xb[t] for t in sorted(set(xa) & set(xb))}
        if d:
          ax.plot(list(d), list(d.values()), style, color=color, lw=0.7, ms=3, alpha=0.5,
                  label=f"{name} seed {s}")
          diffs.append(d)
      common = sorted(set.intersection(*map(set, diffs))) if len(diffs) > 1 else []
      if common:
        m = np.mean([[d[t] for t in common] for d in diffs], axis=0)
        ax.plot(common, m, style.replace("o", "o-"), color=color, lw=2, label=f"{name} mean")
    ax.axhline(0.0, color="k", lw=0.6)
    _finish(ax, f"{a} - {b}" + (f" ({_grid_str(g)})" if st.grid else ""), "step",
            "loss difference (nats/token)")
  for ax in list(axes.flat)[len(panels):]:
    ax.set_visible(False)
  _save(fig, path)


def _finish(ax, title: str, xlabel: str, ylabel: str) -> None:
  ax.set_title(title, fontsize=9)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.grid(alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=6)


def _save(fig, path: pathlib.Path) -> None:
  import matplotlib.pyplot as plt
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_report(st, out: pathlib.Path, plots: bool = True) -> list[Condition]:
  out = pathlib.Path(out)
  rows = read_rows(out)
  conds = analyse(st, rows)
  planned = {c.id for c in st.search_cells()} | {
      c.id for k in conds
      for c in st.best_lr_cells(k.arm, k.grid, k.best_lr if k.best_lr is not None
                                else st.lrs(k.arm)[0])} | {
      c.id for c in seedplan.sequential_cells(st, conds)}
  write_csv(st, rows, out / "results.csv")
  (out / "summary.md").write_text(summary_md(st, rows, conds, planned))
  if plots and rows:
    plot(st, rows, conds, out)
  return conds
