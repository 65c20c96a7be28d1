"""``make run``'s training part: tiny on the embedded corpus, AdamW vs AdamW-BC.

Both runs see the same examples in the same order (same seed, same batch, same steps); the
AdamW-BC run uses the leave-one-out layout, which sweeps those examples twice per step.
"""

from __future__ import annotations

import pathlib
import shutil

from scaleopt.config import resolve_config
from scaleopt.train import config as C
from scaleopt.train import loop, metrics

RUNS = (("adamw", "tiny"), ("adamw_bc", "tiny_adamw_bc"))  # shipped train config names


def run_default(out_dir: pathlib.Path, steps: int = 300) -> dict:
  """Trains both runs into ``out_dir/train/<name>``, writes ``out_dir/train_curves.png`` and
  ``out_dir/train_summary.md``, prints the table; returns {name: summary}."""
  out_dir = pathlib.Path(out_dir)
  base = out_dir / "train"
  results, rows = {}, {}
  for name, cfg_file in RUNS:
    run_dir = base / name
    if run_dir.exists():
      shutil.rmtree(run_dir)  # the demo's own previous output
    cfg = C.load_config(resolve_config(cfg_file, "train"),
                        [f"run.steps={steps}", f"run.eval_every={max(steps // 6, 1)}"])
    print(f"\n== pretraining tiny on the embedded corpus with {name} ({steps} steps) ==")
    results[name] = loop.train(cfg, run_dir)
    rows[name] = metrics.read_metrics(run_dir / "metrics.jsonl")
  metrics.plot_curves(rows, out_dir / "train_curves.png",
                      title=f"tiny on the stdlib corpus, {steps} steps, equal examples")
  head = ("| optimizer | layout | steps | sequences | final eval loss | final train loss | "
          "tokens/s | wall s |")
  lines = [head, "|" + "---|" * 8]
  for name, s in results.items():
    seqs = s["tokens"] // C.load_config(resolve_config(dict(RUNS)[name], "train")).data.seq_len
    lines.append(f"| {name} | {s['layout']} | {s['steps']} | {seqs} | {s['final_eval_loss']:.4f} "
                 f"| {s['final_train_loss']:.4f} | {s['tokens_per_s']:.0f} | "
                 f"{s['wall_time_s']:.0f} |")
  table = "\n".join(lines)
  (out_dir / "train_summary.md").write_text(
      "# tiny pretraining, AdamW vs AdamW-BC (embedded corpus)\n\n" + table + "\n\n"
      "tokens/s counts distinct training tokens; AdamW-BC (leave-one-out) does two gradient "
      "sweeps per step over the same examples. Curves: train_curves.png; per-run metrics in "
      "train/<optimizer>/.\n")
  print("\n" + table)
  print(f"curves: {out_dir / 'train_curves.png'}")
  return results
