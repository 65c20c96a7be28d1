"""Full training-system throughput / MFU next to the bare jitted step (same process, same card).

  PYTHONPATH=. python benchmarks/train_throughput.py           # gpt2-small, 32 x 1024, one GPU
  PYTHONPATH=. python benchmarks/train_throughput.py --quick   # tiny shapes, CPU smoke run

Rows:
* ``bare step``: ``jit(value_and_grad + optax.adamw)`` with donated buffers on a fixed batch
  (benchmarks/models_throughput.py), for the plain-JAX reference model (plain loss) and for
  scaleopt.models (its fused head + cross-entropy, as in the training system).
* ``train system``: ``scaleopt.train.loop.train`` on the embedded corpus (host data pipeline,
  collector scan, clipping, skip guard, metrics, checkpoint at the end), tokens/s measured by the
  loop over all steps after the first (compile) and without eval/checkpoint time.

MFU = executed model FLOP/s / peak, with flops_per_token = 6 N + 12 L T H h; AdamW-BC's
leave-one-out layout sweeps every example twice, so its MFU counts both sweeps and its tokens/s
counts distinct tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys
import tempfile

import jax

from scaleopt import models
from scaleopt.train import config as C
from scaleopt.train import flops, loop

HERE = pathlib.Path(__file__).resolve().parent


def _models_throughput():
  spec = importlib.util.spec_from_file_location("models_throughput", HERE / "models_throughput.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def system_run(preset: str, optimizer: dict, batch: int, seq: int, micro: int, steps: int,
               dtype: str, out: pathlib.Path, unroll: int = 1) -> dict:
  raw = {
      "run": {"steps": steps, "log_every": 10, "eval_every": 0, "eval_tokens": batch * seq,
              "checkpoint_every": 0, "progress": False, "plot": False, "tensorboard": False},
      "model": {"preset": preset, "dtype": dtype, "max_seq_len": seq, "scan_unroll": unroll},
      "data": {"source": "embedded", "seq_len": seq, "batch_size": batch, "microbatches": micro},
      "optimizer": {"schedule": {"kind": "cosine", "warmup_steps": 2}, **optimizer},
  }
  return loop.train(C.from_dict(raw), out)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="tiny shapes on CPU (smoke run)")
  ap.add_argument("--preset", default="gpt2-small")
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--seq", type=int, default=1024)
  ap.add_argument("--steps", type=int, default=40)
  ap.add_argument("--micro", default="1,2,4",
                  help="microbatch counts to time (adamw at each, adamw_bc LOO at each >= 2)")
  ap.add_argument("--unroll", type=int, default=1,
                  help="model scan_unroll (layers unrolled per scan iteration; see docs/models.md)")
  args = ap.parse_args(argv)
  dtype = "bfloat16"
  if args.quick:
    args.preset, args.batch, args.seq, args.steps, dtype = "tiny", 8, 64, 12, "float32"
  cfg = models.get_preset(args.preset).replace(max_seq_len=args.seq, dtype=dtype,
                                               scan_unroll=args.unroll)
  dev = jax.devices()[0]
  peak = flops.peak_flops(dev, None)
  fpt = models.flops_per_token(cfg, args.seq)
  ntok = args.batch * args.seq
  print(f"# device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}, preset "
        f"{args.preset}, batch {args.batch} x {args.seq}, params "
        f"{models.count_params(cfg) / 1e6:.1f}M, flops/token {fpt / 1e6:.1f}M, peak "
        f"{peak / 1e12 if peak else float('nan'):.0f} TFLOP/s", flush=True)

  rows = []  # (name, optimizer, microbatches, tokens/s, executed tokens/s)
  mt = _models_throughput()
  import functools
  tokens = jax.random.randint(jax.random.key(1), (args.batch, args.seq + 1), 0, cfg.vocab_size)
  impl = "cudnn" if dev.platform == "gpu" else "xla"
  if dtype == "bfloat16":
    for name, init, apply in (
        ("bare step, plain-JAX reference model", lambda k: mt.ref_init(cfg, k),
         functools.partial(mt.ref_apply, cfg, impl)),
        ("bare step, scaleopt model",) + models.functional(cfg)):
      fused = models.functional_loss(cfg) if name.endswith("scaleopt model") else None
      for _, mode, first, dt in mt.bench_model(name, init, apply, tokens, 20, 3, ("adamw",),
                                               head_loss_fn=fused):
        rows.append((name, "optax.adamw", 1, ntok / dt, ntok / dt))
        print(f"# {name}: {1e3 * dt:.1f} ms/step (compile+1st {first:.1f}s)", flush=True)
  else:  # CPU smoke run: only the scaleopt bare step (the reference model is bf16-only)
    init, apply = models.functional(cfg)
    for _, mode, first, dt in mt.bench_model("bare", init, apply, tokens, 5, 1, ("adamw",),
                                             head_loss_fn=models.functional_loss(cfg)):
      rows.append(("bare step, scaleopt model", "optax.adamw", 1, ntok / dt, ntok / dt))

  adamw = {"name": "adamw", "learning_rate": 6e-4}
  bc = {"name": "adamw_bc", "learning_rate": 6e-4, "extra": {"mode": "full", "crossfit": "loo"}}
  micros = [int(x) for x in args.micro.split(",")]
  runs = [("train system", adamw, m) for m in micros]
  runs += [("train system", bc, m) for m in micros if m >= 2]
  with tempfile.TemporaryDirectory() as tmp:
    for i, (name, opt, micro) in enumerate(runs):
      s = system_run(args.preset, opt, args.batch, args.seq, micro, args.steps, dtype,
                     pathlib.Path(tmp) / str(i), unroll=args.unroll)
      passes = s["sweeps_per_step"]
      label = opt["name"] + (" (LOO)" if s["layout"] == "loo" else "")
      rows.append((name, label, micro, s["tokens_per_s"], s["tokens_per_s"] * passes))
      print(f"# {name} {label} m={micro}: {s['tokens_per_s']:,.0f} tokens/s, compile "
            f"{s['compile_s']:.1f}s, final loss {s['final_train_loss']:.3f}", flush=True)

  bare = next(r for r in rows if r[0] == "bare step, scaleopt model")[3]
  print("\n| what | optimizer | microbatches | ms/step | tokens/s | MFU | vs bare step |")
  print("|---|---|---|---|---|---|---|")
  for name, opt, micro, tps, exec_tps in rows:
    mfu = f"{100 * exec_tps * fpt / peak:.1f}%" if peak else "n/a"
    rel = f"{100 * (exec_tps / bare - 1):+.1f}%"
    print(f"| {name} | {opt} | {micro} | {1e3 * ntok / tps:.1f} | {tps:,.0f} | {mfu} | {rel} |")
  print("\n(vs bare step compares executed-token throughput: the LOO row does 2 sweeps/step)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
