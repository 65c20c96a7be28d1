"""Spectral diagnostic beside the language-model alpha study: the corpus and the final activations.

Run where the study folder holds its kept checkpoints (``engine.keep_checkpoints: true``, i.e.
on the training machine right after ``scaleopt study``); writes the small ``STUDY_DIR/diag.csv``
that ``experiments/lm_alpha_report.py`` reads, so the checkpoints need not travel:

    python experiments/lm_alpha_diag.py STUDY_DIR [--seed 0] [--arms adamw muon ...]

Rows (``scaleopt.scaling.diagnostic``: s_hat of lambda_k ~ k^-s_hat on the bulk of the spectrum,
with the R^2 of that power law):

  corpus       the one-hot covariance of the training split's bytes, ``unigram`` and ``bigram``
               (``corpus.onehot_spectrum``: the rank-frequency curve of bytes / byte pairs);
  activations  per arm and width, the cell at the learning rate the study chose on the val half
               (``lm_alpha.arm_curve``) and seed ``--seed``: the covariance of the final
               residual stream Norm(x_L) on held-out windows (``corpus.lm_activations``).

A condition without a finished checkpoint at that lr and seed gets a row with ``status``
saying why (e.g. ``no checkpoint``), never a guessed number.
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import sys

COLUMNS = ["kind", "name", "d_model", "lr", "seed", "status", "s_hat", "r2", "k_min", "k_max",
           "rank", "top_share"]
SIZE_KEY = "d_model"


def spectrum_row(kind: str, name: str, lam, **extra) -> dict:
  """One diag.csv row from descending eigenvalues (or a sample matrix)."""
  import numpy as np

  from scaleopt.scaling import diagnostic
  d = diagnostic.diagnose(lam)
  lam = d.eigenvalues
  return {"kind": kind, "name": name, "status": "ok", "s_hat": d.s_hat, "r2": d.r2,
          "k_min": d.k_range[0], "k_max": d.k_range[1],
          "rank": int(np.sum(lam > 1e-12 * lam[0])), "top_share": float(lam[0] / lam.sum()),
          **extra}


def corpus_rows() -> list[dict]:
  from scaleopt.scaling import corpus
  from scaleopt.train.data import embedded_tokens
  tokens = embedded_tokens("train")
  return [spectrum_row("corpus", order, corpus.onehot_spectrum(tokens, order))
          for order in ("unigram", "bigram")]


def chosen_cells(study: pathlib.Path, arms: list[str] | None, seed: int) -> list[dict]:
  """(arm, width, lr, cell folder) at each condition's chosen lr (val half), seed ``seed``."""
  import lm_alpha_report  # this script's folder is on sys.path

  from scaleopt.scaling import lm_alpha
  rows = lm_alpha.read_rows(lm_alpha_report.results_csv(study), SIZE_KEY, arm_sep="+")
  out = []
  for arm in dict.fromkeys(r["arm"] for r in rows):
    if arms and arm not in arms:
      continue
    try:
      sizes, _, chosen = lm_alpha.arm_curve([r for r in rows if r["arm"] == arm], SIZE_KEY)
    except ValueError as e:
      print(f"{arm}: skipped ({e})", file=sys.stderr)
      continue
    for size in sizes:
      w = int(size)
      d = study / "cells" / f"{arm}+{w}" / f"lr={chosen[size]:g},seed={seed}"
      out.append({"arm": arm, "d_model": w, "lr": chosen[size], "dir": d})
  return out


def final_params(cell_dir: pathlib.Path):
  """(model config, params on the host) of a finished cell's newest checkpoint, or None."""
  import jax

  from scaleopt.train import checkpoint, loop
  from scaleopt.train.config import load_config
  ck_dir = cell_dir / "checkpoints"
  if not (cell_dir / "result.json").is_file() or not ck_dir.is_dir():
    return None
  cfg = load_config(cell_dir / "config.yaml")
  s = loop.setup(cfg)
  fns = loop.compile_fns(s)  # shapes and shardings only; nothing compiles here
  ck = checkpoint.Checkpointer(ck_dir, cfg.run.keep_checkpoints, False)
  step = ck.latest_step()
  if step is None:
    ck.close()
    return None
  state, _ = ck.restore(step, checkpoint.abstract(fns.state_shape, fns.state_sh))
  ck.close()
  return s.model.cfg, jax.device_get(state.params)


def activation_rows(study: pathlib.Path, arms: list[str] | None, seed: int, n_windows: int,
                    seq_len: int) -> list[dict]:
  from scaleopt.scaling import corpus
  out = []
  for c in chosen_cells(study, arms, seed):
    meta = {"kind": "activations", "name": c["arm"], "d_model": c["d_model"], "lr": c["lr"],
            "seed": seed}
    got = final_params(c["dir"])
    if got is None:
      out.append({**meta, "status": "no checkpoint"})
      continue
    mcfg, params = got
    acts = corpus.lm_activations(mcfg, params, n_windows=n_windows, seq_len=seq_len)
    out.append(spectrum_row(**meta, lam=acts))
    print(f"{c['arm']}+{c['d_model']}: s_hat {out[-1]['s_hat']:.3f} "
          f"(R^2 {out[-1]['r2']:.3f})", flush=True)
  return out


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("study", help="the study folder (holds cells/)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--arms", nargs="*", default=None, help="optimizers (default: every arm)")
  ap.add_argument("--windows", type=int, default=64, help="held-out windows per model")
  ap.add_argument("--seq-len", type=int, default=128, help="tokens per window")
  a = ap.parse_args(argv)
  study = pathlib.Path(a.study)
  if a.windows < 1 or a.seq_len < 2:
    print(f"error: --windows {a.windows} must be >= 1 and --seq-len {a.seq_len} >= 2",
          file=sys.stderr)
    return 2
  try:
    rows = corpus_rows() + activation_rows(study, a.arms, a.seed, a.windows, a.seq_len)
  except ValueError as e:  # not a study folder, arms not named <optimizer>+<d_model>, ...
    print(f"error: {e}", file=sys.stderr)
    return 2
  with open(study / "diag.csv", "w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=COLUMNS)
    w.writeheader()
    w.writerows(rows)
  print(f"{len(rows)} row(s) in {study / 'diag.csv'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
