r"""Alpha of L(N) per optimizer from a language-model width study (``configs/studies/lm_alpha``).

    python experiments/lm_alpha_report.py STUDY_DIR OUT_DIR [--bootstrap 2000] [--window 3]

Reads the study folder alone (its finished cells, ``cells.jsonl``, and ``study.yaml``, the
optional ``diag.csv`` of ``experiments/lm_alpha_diag.py``); works on CPU. Arms are named
``<optimizer>+<d_model>``. Per optimizer (``scaleopt.scaling.lm_alpha.study_alpha``): at each
width the lr with the smallest seed-mean loss on the held-out split's val half, the test-half
loss of every seed at that lr, N = non-embedding parameters of the width's model
(``count_params`` minus the tied embedding V d), alpha by OLS of log L on log N with the
draw-cluster t interval (seeds = draws), and the fit-window report (alpha without the smallest /
largest N, over every sub-window of >= ``--window`` widths, local slopes).

Two fits:
  raw    L itself (byte-level loss does not decay to 0, so this alpha is a lower bound);
  floor  L - L_inf, with L_inf from one pooled three-parameter fit over all optimizers,
             log Lbar_a(N) ~ log(L_inf + exp(b_a) N^-alpha_a)   (least squares in log L),
         L_inf shared (the corpus's irreducible loss), b_a and alpha_a per optimizer; L_inf is
         bounded below the smallest per-seed loss, so every resample stays positive. The floor
         is then held fixed: its own uncertainty is not in the interval.

Writes OUT_DIR/alpha.md, alpha.csv (one row per optimizer and fit), losses.csv (the per-seed
losses behind every fit), results.csv (every finished cell), diag.csv (when the study has
one), lm_alpha.png (L(N) with seed bands, floor-subtracted L(N) with the fits, local slopes).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import pathlib
import sys
import tempfile

import numpy as np

SIZE_KEY = "d_model"
SEP = "+"
RESULT_COLUMNS = ["cell", "arm", "lr", "seed", "stage", "status", "steps", "tokens",
                  "val_loss", "test_loss", "train_loss", "wall_time_s", "tokens_per_s",
                  "cells_at_once", "engine", "card"]


class ReportError(ValueError):
  """A study folder that cannot be reported (message names the path)."""


# --------------------------------------------------------------------------------- inputs


def write_results(study: pathlib.Path, path: pathlib.Path,
                  prefixes: list[str] | None = None) -> list[dict]:
  """Every finished cell of ``study`` (``scaleopt.study.store``; with ``prefixes``, of the arms
  starting with one of them) as a results.csv at ``path``."""
  from scaleopt.study import report
  if not (study / "cells.jsonl").is_file() and not (study / "cells").is_dir():
    raise ReportError(f"{study}: no cells.jsonl and no cells/ folder (not a study folder, "
                      "or nothing ran yet)")
  rows = sorted((r for r in report.read_rows(study)
                 if prefixes is None or r["arm"].startswith(tuple(prefixes))),
                key=lambda r: r["id"])
  if not rows:
    raise ReportError(f"{study}: no finished cell")
  bad = [r["arm"] for r in rows if SEP not in r["arm"]]
  if bad:
    raise ReportError(f"{study}: arm {bad[0]!r} is not named <optimizer>{SEP}<d_model>")
  with path.open("w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=RESULT_COLUMNS, extrasaction="ignore")
    w.writeheader()
    for r in rows:
      w.writerow({**{k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()},
                  "cell": r["id"]})
  return rows


def _model_section(study: pathlib.Path, r: dict) -> dict:
  """A cell's model config, from its stored config fingerprint (flattened keys)."""
  if not r.get("config"):
    raise ReportError(f"{study}: cell {r['id']!r} has no stored config")
  model: dict = {}
  for k, v in r["config"].items():
    if k.startswith("model."):
      *path, last = k.split(".")[1:]
      d = model
      for part in path:
        d = d.setdefault(part, {})
      d[last] = v
  return model


def non_embedding_params(study: pathlib.Path, rows: list[dict]) -> dict[int, int]:
  """width -> non-embedding parameters, from each width's cell config (every optimizer at one
  width must have the same model)."""
  from scaleopt import models
  from scaleopt.train import bridge
  out: dict[int, int] = {}
  for r in rows:
    arm, width = r["arm"].rsplit(SEP, 1)
    mcfg = bridge.model_config(_model_section(study, r))
    if mcfg.d_model != int(width):
      raise ReportError(f"{study}: cell {r['id']!r} has model.d_model={mcfg.d_model}")
    emb = mcfg.vocab_size * mcfg.d_model * (1 if mcfg.tie_embeddings else 2)
    n = models.count_params(mcfg) - emb
    if out.setdefault(mcfg.d_model, n) != n:
      raise ReportError(f"{study}: cell {r['id']!r} (width {width}) has {n} non-embedding "
                        f"parameters but "
                        f"{out[mcfg.d_model]} in another arm")
  return out


def planned(study: pathlib.Path) -> dict:
  """arm -> planned cells (lrs x seeds) from the study.yaml the runner wrote, or {}."""
  import yaml
  p = study / "study.yaml"
  if not p.is_file():
    return {}
  raw = yaml.safe_load(p.read_text()) or {}
  seeds, lrs = raw.get("seeds") or [0], raw.get("learning_rates") or []
  return {a: len((s or {}).get("learning_rates", lrs)) * len(seeds)
          for a, s in (raw.get("arms") or {}).items()}


# --------------------------------------------------------------------------------- fits


def pooled_floor(curves: dict, upper: float) -> dict:
  """L_inf, b_a, alpha_a of log Lbar_a(N) ~ log(L_inf + exp(b_a) N^-alpha_a), L_inf shared.

  ``curves``: optimizer -> (N, mean loss); ``upper``: L_inf stays below it.
  """
  from scipy import optimize

  from scaleopt.scaling import fit as fit_lib
  names = list(curves)
  lo_n = {a: np.log(np.asarray(curves[a][0], float)) for a in names}
  lo_l = {a: np.log(np.asarray(curves[a][1], float)) for a in names}

  def resid(p):
    f = p[0]
    return np.concatenate([np.log(f + np.exp(p[1 + 2 * i] - p[2 + 2 * i] * lo_n[a])) - lo_l[a]
                           for i, a in enumerate(names)])

  f0 = 0.5 * upper
  x0 = [f0]
  for a in names:
    al, icpt = fit_lib.fit_power_law(np.exp(lo_n[a]), np.exp(lo_l[a]) - f0)
    x0 += [icpt, max(al, 1e-3)]
  lb = [0.0] + [-np.inf, 0.0] * len(names)
  ub = [upper] + [np.inf, 10.0] * len(names)
  res = optimize.least_squares(resid, np.clip(x0, lb, ub), bounds=(lb, ub))
  p = res.x
  return {"floor": float(p[0]), "at_bound": bool(p[0] > 0.999 * upper or p[0] < 1e-9),
          "alpha": {a: float(p[2 + 2 * i]) for i, a in enumerate(names)},
          "log_c": {a: float(p[1 + 2 * i]) for i, a in enumerate(names)},
          "rms_log_resid": float(np.sqrt(np.mean(res.fun ** 2)))}


def window_columns(n: np.ndarray, mean_loss: np.ndarray, alpha: float, lo: float, hi: float,
                   width: int) -> dict:
  """The fit-window report (``fit.window_report``) as columns, as in a sweep's alpha.csv."""
  from scaleopt.scaling import fit as fit_lib
  wr = fit_lib.window_report(n, mean_loss, None, width)
  drops = np.asarray([wr.alpha_drop_first, wr.alpha_drop_last])
  shift = float(np.nanmax(np.abs(drops - alpha))) if np.isfinite(drops).any() else math.nan
  half = 0.5 * (hi - lo)
  out = {"alpha_drop_first": wr.alpha_drop_first, "alpha_drop_last": wr.alpha_drop_last,
         "alpha_win_min": wr.alpha_win_min, "alpha_win_max": wr.alpha_win_max,
         "window_shift": shift, "window_ratio": shift / half if half > 0 else math.nan}
  out.update({f"slope_{a}_{b}": float(v) for (a, b), v in zip(wr.windows, wr.slopes)})
  return out


def analyse(study: pathlib.Path, out: pathlib.Path, bootstrap: int, window: int) -> dict:
  """Every number of the report (see the module docstring)."""
  from scaleopt.scaling import lm_alpha
  rows = write_results(study, out / "results.csv")
  n_of = non_embedding_params(study, rows)
  sel = lm_alpha.read_rows(out / "results.csv", SIZE_KEY, arm_sep=SEP)
  arms = list(dict.fromkeys(r["arm"] for r in sel))
  curves, skipped = {}, {}
  for a in arms:
    ar = [r for r in sel if r["arm"] == a]
    try:
      sizes, losses, chosen = lm_alpha.arm_curve(ar, SIZE_KEY)
    except ValueError as e:
      skipped[a] = str(e)
      continue
    if len(sizes) < 3:
      skipped[a] = f"{len(sizes)} width(s) finished; a fit needs >= 3"
      continue
    grid = {s: sorted({float(r["lr"]) for r in ar if float(r[SIZE_KEY]) == s}) for s in sizes}
    curves[a] = {"sizes": sizes, "n": np.asarray([n_of[int(s)] for s in sizes], float),
                 "losses": losses, "lr": [chosen[s] for s in sizes],
                 "edge": [int(s) for s in sizes if len(grid[s]) > 1
                          and chosen[s] in (grid[s][0], grid[s][-1])]}
  if not curves:
    raise ReportError(f"{study}: no optimizer has >= 2 seeds at >= 3 widths; nothing to fit "
                      f"({'; '.join(f'{a}: {m}' for a, m in skipped.items())})")
  upper = (1 - 1e-3) * min(float(np.nanmin(c["losses"])) for c in curves.values())
  pool = pooled_floor({a: (c["n"], c["losses"].mean(axis=0)) for a, c in curves.items()}, upper)
  fitted = pathlib.Path(tempfile.mkdtemp(prefix="lm_alpha_")) / "fitted.csv"
  write_results(study, fitted, [a + SEP for a in curves])
  fits = []
  for kind, floor in (("raw", 0.0), ("floor", pool["floor"])):
    by_arm = {r["arm"]: r for r in lm_alpha.study_alpha(
        fitted, SIZE_KEY, n_of=lambda w: n_of[int(w)], floor=floor,
        bootstrap=bootstrap, window=window, arm_sep=SEP)}
    for a, c in curves.items():
      r = by_arm[a]
      fits.append({"optimizer": a, "fit": kind, "floor": floor, "alpha": r["alpha"],
                   "ci_low": r["ci_low"], "ci_high": r["ci_high"], "se": r["se"],
                   "interval_method": r["interval_method"], "seeds": r["seeds"],
                   "widths": " ".join(str(int(s)) for s in c["sizes"]),
                   "n_min": int(c["n"][0]), "n_max": int(c["n"][-1]),
                   "lr": " ".join(f"{v:g}" for v in r["lr"]),
                   "lr_at_grid_edge": " ".join(map(str, c["edge"])),
                   **window_columns(np.asarray(r["n"]), np.asarray(r["mean_loss"]), r["alpha"],
                                    r["ci_low"], r["ci_high"], window)})
  return {"rows": rows, "n_of": n_of, "curves": curves, "skipped": skipped, "pool": pool,
          "fits": fits, "planned": planned(study)}


# --------------------------------------------------------------------------------- outputs


def write_csv(path: pathlib.Path, rows: list[dict]) -> None:
  cols = list(dict.fromkeys(k for r in rows for k in r))
  with path.open("w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=cols)
    w.writeheader()
    for r in rows:
      w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def loss_rows(res: dict) -> list[dict]:
  out = []
  for a, c in res["curves"].items():
    for j, s in enumerate(c["sizes"]):
      for i in range(c["losses"].shape[0]):
        out.append({"optimizer": a, "d_model": int(s), "N": int(c["n"][j]), "lr": c["lr"][j],
                    "seed_index": i, "test_loss": float(c["losses"][i, j])})
  return out


def plot(res: dict, path: pathlib.Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  pool = res["pool"]
  fig, axes = plt.subplots(1, 3, figsize=(14, 4))
  for a, c in res["curves"].items():
    n, ls = c["n"], c["losses"]
    line = axes[0].plot(n, ls.mean(axis=0), marker="o", ms=3, label=a)[0]
    axes[0].fill_between(n, ls.min(axis=0), ls.max(axis=0), color=line.get_color(), alpha=0.2)
    nn = np.geomspace(n[0], n[-1], 50)
    fitted = pool["floor"] + np.exp(pool["log_c"][a]) * nn ** -pool["alpha"][a]
    axes[0].plot(nn, fitted, "--", color=line.get_color(), lw=0.8)
    ex = ls - pool["floor"]
    axes[1].plot(n, ex.mean(axis=0), marker="o", ms=3, color=line.get_color(),
                 label=f"{a}: alpha {pool['alpha'][a]:.3f}")
    axes[1].fill_between(n, ex.min(axis=0), ex.max(axis=0), color=line.get_color(), alpha=0.2)
    slopes = -np.diff(np.log(ex.mean(axis=0))) / np.diff(np.log(n))
    axes[2].plot(np.sqrt(n[1:] * n[:-1]), slopes, marker="o", ms=3, color=line.get_color(),
                 label=a)
  for ax, title, ylabel in (
      (axes[0], "test loss (band: seeds min-max; dashed: pooled fit)", "test loss (nats/byte)"),
      (axes[1], f"L - L_inf (L_inf = {pool['floor']:.3f}, pooled)", "excess loss"),
      (axes[2], "local slope -dlog(L - L_inf)/dlog N", "local alpha")):
    ax.set_xscale("log")
    if ax is not axes[2]:
      ax.set_yscale("log")
    ax.set_xlabel("N (non-embedding parameters)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _f(v, d: int = 3) -> str:
  return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.{d}f}"


def diag_md(diag: list[dict]) -> list[str]:
  if not diag:
    return ["No diag.csv in the study folder (run experiments/lm_alpha_diag.py where the "
            "checkpoints are)."]
  lines = ["Spectral exponent s_hat of lambda_k ~ k^-s_hat (bulk of the spectrum, R^2 of the "
           "power law in brackets):", ""]
  corpus = [r for r in diag if r["kind"] == "corpus"]
  lines += [f"- corpus {r['name']}: s_hat {_f(float(r['s_hat']))} "
            f"(R^2 {_f(float(r['r2']))})" for r in corpus]
  acts = [r for r in diag if r["kind"] == "activations"]
  widths = sorted({int(r["d_model"]) for r in acts})
  if acts:
    lines += ["", "Final activations Norm(x_L) on held-out windows, at the chosen lr, seed "
              f"{acts[0]['seed']}:", "",
              "| optimizer | " + " | ".join(f"d={w}" for w in widths) + " |",
              "|---|" + "---|" * len(widths)]
    for a in dict.fromkeys(r["name"] for r in acts):
      cells = {int(r["d_model"]): r for r in acts if r["name"] == a}
      lines.append(f"| {a} | " + " | ".join(
          (f"{_f(float(cells[w]['s_hat']), 2)} ({_f(float(cells[w]['r2']), 2)})"
           if cells[w]["status"] == "ok" else cells[w]["status"]) if w in cells else "-"
          for w in widths) + " |")
  return lines


def alpha_md(res: dict, diag: list[dict]) -> str:
  rows, pool = res["rows"], res["pool"]
  cards = sorted({str(r.get("card")) for r in rows})
  tokens = sorted({int(r["tokens"]) for r in rows if r.get("tokens")})
  status = {}
  for r in rows:
    status[r["status"]] = status.get(r["status"], 0) + 1
  n_planned = sum(res["planned"].values())
  lines = ["# Alpha of L(N) on language models", "",
           f"{len(rows)} finished cells" + (f" of {n_planned} planned" if n_planned else "")
           + f" ({', '.join(f'{v} {k}' for k, v in sorted(status.items()))}); card(s): "
           f"{', '.join(cards)}; tokens per cell: {', '.join(map(str, tokens))}.",
           "N = non-embedding parameters: " + ", ".join(
               f"d={w}: {n:,}" for w, n in sorted(res["n_of"].items())) + ".", "",
           "| optimizer | fit | alpha [95% CI] | seeds | N range | lr per width (val) | "
           "without smallest / largest N | sub-window range |",
           "|---|---|---|---|---|---|---|---|"]
  for f in res["fits"]:
    edge = f" (edge: {f['lr_at_grid_edge']})" if f["lr_at_grid_edge"] else ""
    lines.append(
        f"| {f['optimizer']} | {f['fit']} | {_f(f['alpha'])} [{_f(f['ci_low'])}, "
        f"{_f(f['ci_high'])}] | {f['seeds']} | {f['n_min']:,}-{f['n_max']:,} | "
        f"{f['lr']}{edge} | {_f(f['alpha_drop_first'])} / {_f(f['alpha_drop_last'])} | "
        f"{_f(f['alpha_win_min'])}-{_f(f['alpha_win_max'])} |")
  widths = sorted({int(v) for c in res["curves"].values() for v in c["sizes"]})
  lines += ["", "Test loss (nats/byte) at the chosen lr, mean +- sd over seeds:", "",
            "| optimizer | " + " | ".join(f"d={w}" for w in widths) + " |",
            "|---|" + "---|" * len(widths)]
  for a, c in res["curves"].items():
    at = {int(v): c["losses"][:, j] for j, v in enumerate(c["sizes"])}
    lines.append(f"| {a} | " + " | ".join(
        f"{at[w].mean():.4f} +- {at[w].std(ddof=1):.4f}" if w in at else "-" for w in widths)
        + " |")
  lines += ["", f"Floor: L_inf = {pool['floor']:.4f} nats/byte from the pooled fit "
            f"(rms log residual {pool['rms_log_resid']:.4f})"
            + (" -- at its bound, so the floor is not identified by these widths: read the raw "
               "alphas" if pool["at_bound"] else "") + "; pooled-fit alphas: "
            + ", ".join(f"{a} {v:.3f}" for a, v in pool["alpha"].items()) + ".",
            "Interval: draw-cluster t over seeds (`cluster_t`), the floor held fixed. "
            "'edge': widths whose chosen lr is the smallest or largest tried."]
  flagged = [f for f in res["fits"] if f["window_ratio"] > 1]
  if flagged:
    lines.append(f"Fit window: dropping the smallest or largest N moves alpha by more than the "
                 f"interval half-width in {len(flagged)} of {len(res['fits'])} fits, so L(N) is "
                 "not one power law over these widths at this precision (lm_alpha.png, right).")
  if res["skipped"]:
    lines.append("Not fitted: " + "; ".join(f"{a} ({m})" for a, m in res["skipped"].items()))
  missing = sorted(set(res["planned"]) - {r["arm"] for r in rows})
  if missing:
    lines.append(f"Arms without any finished cell: {', '.join(missing)}.")
  lines += ["", "## Spectral diagnostic", ""] + diag_md(diag)
  lines += ["", "![L(N)](lm_alpha.png)", ""]
  return "\n".join(lines)


def read_diag(study: pathlib.Path) -> list[dict]:
  p = study / "diag.csv"
  if not p.is_file():
    return []
  with p.open(newline="") as fh:
    return list(csv.DictReader(fh))


def report(study: pathlib.Path, out: pathlib.Path, bootstrap: int = 2000,
           window: int = 3) -> dict:
  out.mkdir(parents=True, exist_ok=True)
  res = analyse(study, out, bootstrap, window)
  diag = read_diag(study)
  write_csv(out / "alpha.csv", res["fits"])
  write_csv(out / "losses.csv", loss_rows(res))
  if diag:
    write_csv(out / "diag.csv", diag)
  plot(res, out / "lm_alpha.png")
  (out / "alpha.md").write_text(alpha_md(res, diag))
  (out / "pooled_floor.json").write_text(json.dumps(res["pool"], indent=1) + "\n")
  return res


def results_csv(study: pathlib.Path) -> pathlib.Path:
  """A results.csv of the study's finished cells in a temporary folder (for the diagnostic)."""
  path = pathlib.Path(tempfile.mkdtemp(prefix="lm_alpha_")) / "results.csv"
  write_results(study, path)
  return path


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("study", help="the study folder (cells/, study.yaml, optional diag.csv)")
  ap.add_argument("out", help="where alpha.md, alpha.csv, losses.csv, lm_alpha.png go")
  ap.add_argument("--bootstrap", type=int, default=2000)
  ap.add_argument("--window", type=int, default=3)
  a = ap.parse_args(argv)
  if a.bootstrap < 1 or a.window < 2:
    print(f"error: --bootstrap {a.bootstrap} must be >= 1 and --window {a.window} >= 2",
          file=sys.stderr)
    return 2
  try:
    res = report(pathlib.Path(a.study), pathlib.Path(a.out), a.bootstrap, a.window)
  except (ReportError, ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  for f in res["fits"]:
    print(f"{f['optimizer']:>10} {f['fit']:>5}: alpha {f['alpha']:.3f} "
          f"[{f['ci_low']:.3f}, {f['ci_high']:.3f}]")
  print(f"report in {a.out}/alpha.md")
  return 0


if __name__ == "__main__":
  sys.exit(main())
