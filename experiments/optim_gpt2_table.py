"""gpt2-small optimizer table: AdamW, AdamW-BC (LOO, A/B) and Shampoo (grafted / ungrafted).

Setting (one GPU): gpt2-small shapes, the embedded corpus as bytes, 32 x 1024 tokens per step
(A/B layouts draw a second group of 32 sequences as B), bf16 compute, cosine schedule with 20
warm-up steps (floor 0.1), clip 1.0, b2 = 0.95, wd 0.1, one seed. Every arm runs through the
trainer (``scaleopt.train.loop.train``) in one process; a CSV row is written after each arm,
so a run cut short still reports what finished. Arms run in priority order and an arm is
skipped when the time left (``--budget-s``) cannot hold it (estimated from the arms before).

    python experiments/optim_gpt2_table.py --out OUT_DIR [--steps 300] [--budget-s 400]
    python experiments/optim_gpt2_table.py --out /tmp/t --quick     # CPU smoke test, tiny model
"""

from __future__ import annotations

import argparse
import csv
import pathlib
import sys
import tempfile
import time

import jax

# (label, optimizer section, microbatches per group, steps factor, relative cost)
ARMS = [
    ("adamw", {"name": "adamw", "learning_rate": 3e-4}, 1, 1.0, 1.0),
    ("adamw_bc full A/B", {"name": "adamw_bc", "learning_rate": 3e-4,
                           "extra": {"mode": "full", "crossfit": "ab"}}, 8, 1.0, 2.0),
    ("adamw_bc full LOO", {"name": "adamw_bc", "learning_rate": 3e-4,
                           "extra": {"mode": "full", "crossfit": "loo"}}, 8, 1.0, 2.0),
    ("adamw_bc full A/B, numerator-only clip (reference)",
     {"name": "adamw_bc", "learning_rate": 3e-4, "clip_numerator_only": True,
      "extra": {"mode": "full", "crossfit": "ab"}}, 8, 1.0, 2.0),
    ("adamw_bc cf A/B", {"name": "adamw_bc", "learning_rate": 3e-4,
                         "extra": {"mode": "cf", "crossfit": "ab"}}, 8, 1.0, 2.0),
    ("shampoo graft=adam (150 steps)", {"name": "shampoo", "learning_rate": 6e-4,
                                        "extra": {"block_size": 512, "graft": "adam"}},
     1, 0.5, 0.7),
    ("shampoo graft=none (150 steps)", {"name": "shampoo", "learning_rate": 6e-4,
                                        "extra": {"block_size": 512, "graft": "none"}},
     1, 0.5, 0.7),
]


def raw_config(opt: dict, m: int, steps: int, quick: bool) -> dict:
  opt = {"weight_decay": 0.1, "clip_norm": 1.0, "b1": 0.9, "b2": 0.95,
         "schedule": {"kind": "cosine", "warmup_steps": 20, "min_lr_ratio": 0.1,
                      "total_steps": steps}, **opt}
  model = ({"preset": "tiny", "dtype": "float32", "d_model": 32, "n_layers": 1, "d_ff": 64}
           if quick else {"preset": "gpt2-small", "dtype": "bfloat16", "remat": "none",
                          "scan_unroll": 12, "wd_policy": "matrices-only"})
  data = ({"source": "embedded", "seq_len": 32, "batch_size": 8, "microbatches": m}
          if quick else {"source": "embedded", "seq_len": 1024, "batch_size": 32,
                         "microbatches": m})
  return {"run": {"seed": 0, "steps": steps, "log_every": max(steps // 6, 1),
                  "eval_every": steps, "eval_tokens": 512 if quick else 131072,
                  "checkpoint_every": 0, "progress": False, "tensorboard": False,
                  "plot": False},
          "model": model, "data": data, "optimizer": opt, "mesh": {"data": -1}}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--steps", type=int, default=300)
  ap.add_argument("--budget-s", type=float, default=400.0)
  ap.add_argument("--quick", action="store_true")
  args = ap.parse_args(argv)
  from scaleopt.train import config as C
  from scaleopt.train import loop

  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  dev = jax.devices()[0]
  print(f"device {dev.platform} {getattr(dev, 'device_kind', '')}; jax {jax.__version__}",
        flush=True)
  t_start = time.time()
  unit = None  # seconds per unit of relative cost at full steps, from finished arms
  fields = ["arm", "optimizer", "lr", "microbatches", "layout", "steps", "eval_loss",
            "train_loss", "wall_s", "compile_s", "tokens_per_s", "skipped", "device", "jax"]
  with open(out / "gpt2_table.csv", "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=fields)
    w.writeheader()
    for label, opt, m, frac, cost in ARMS:
      steps = max(int(args.steps * frac), 1)
      left = args.budget_s - (time.time() - t_start)
      need = 30.0 + (unit * cost * frac if unit else 0.0)
      if left < need:
        print(f"skip {label}: {left:.0f} s left, needs ~{need:.0f} s", flush=True)
        continue
      t0 = time.time()
      s = loop.train(C.from_dict(raw_config(opt, m, steps, args.quick)),
                     tempfile.mkdtemp(prefix="gpt2_table_"))  # checkpoints stay off $OUT
      wall = time.time() - t0
      unit = max(unit or 0.0, (wall - 30.0) / (cost * frac))
      row = {"arm": label, "optimizer": opt["name"], "lr": opt["learning_rate"],
             "microbatches": m, "layout": s["layout"], "steps": s["steps"],
             "eval_loss": f"{s['final_eval_loss']:.4f}", "train_loss":
             f"{s['final_train_loss']:.4f}", "wall_s": f"{wall:.1f}",
             "compile_s": f"{s.get('compile_s') or 0:.1f}",
             "tokens_per_s": f"{s.get('tokens_per_s') or 0:.0f}",
             "skipped": s.get("skipped_steps"), "device": s["device_kind"], "jax": jax.__version__}
      w.writerow(row)
      f.flush()
      print(row, flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
