"""Training-system throughput across meshes and GPU counts, each configuration in its own process.

  PYTHONPATH=. python benchmarks/mesh_throughput.py --configs data1,data2,fsdp2,tensor2 \
      [--preset gpt2-small --batch 64 --micro 2 --unroll 12 --steps 30 --csv OUT.csv]
  PYTHONPATH=. python benchmarks/mesh_throughput.py --quick      # CPU smoke run (2 devices)

A configuration is ``AXISN[+option...]``: AXIS one of data / fsdp / tensor, N its size (the
number of GPUs; ``data1`` is the one-GPU baseline, run with ``CUDA_VISIBLE_DEVICES=0``).
Options: ``legacy`` (the model without its sharding constraints and with the unfused loss: the
program before the FSDP fix), ``unfused`` (plain float32-logits loss), ``mK`` (K
microbatches), ``bN`` (N sequences per step), ``pNAME`` (model preset), ``chunksK`` (fused
loss in K sequence slices), ``optNAME`` (optimizer, default adamw), ``uK`` (scan_unroll),
``seqT`` (sequence length), ``remat`` / ``dots`` (full / dots rematerialization), ``xNAME``
(an extra XLA flag from ``XLA_OPTIONS``), ``eKEY=VALUE`` (an ``optimizer.extra`` entry, e.g.
``+optadamw_bc+ecrossfit=loo``, ``+optshampoo+eroot_every=10``, ``+emu_dtype=bfloat16``).

Every configuration runs ``scaleopt.train.loop.train`` on the embedded corpus (host data
pipeline, collector scan, clipping, skip guard, metrics) in a fresh process with a timeout;
tokens/s is the loop's own measurement over all steps after the compile step. One-GPU
configurations next to each other in ``--configs`` run two at a time, one per GPU, when
``--pair-single`` is given. The table's ratios divide by the first ``data1`` row with the same batch, microbatch
and preset options (same run, same card). Further columns:

  vs 1 GPU/GPU-batch  tokens/s over the ``data1`` row whose batch is this row's batch / GPUs
                      (same per-GPU batch; the weak-scaling ratio)
  vs adamw step       ms/step over the fastest ``adamw`` row (any mesh and microbatching) with
                      the same GPU count, preset, sequence length and global batch
  vs adamw token      the same per executed token (forward+backward sweeps per step: the
                      bias-corrected layouts run group B or leave-one-out passes)

A multi-GPU configuration sees the first N GPUs (``CUDA_VISIBLE_DEVICES=0..N-1``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
GPU_FLAGS = ("--xla_gpu_enable_triton_gemm=false "
             "--xla_gpu_enable_latency_hiding_scheduler=true")
# Per-configuration XLA flag options (``+xNAME``), appended to XLA_FLAGS of that process.
XLA_OPTIONS = {
    "lt": "--xla_gpu_enable_cublaslt=true",
    "nocb": "--xla_gpu_enable_command_buffer=",
    "db": "--xla_gpu_enable_while_loop_double_buffering=true",
}


def parse(name: str, defaults: dict) -> dict:
  """``fsdp2+m4+legacy`` -> the run's settings."""
  head, *opts = name.split("+")
  m = re.fullmatch(r"(data|fsdp|tensor)(\d+)", head)
  if not m:
    raise SystemExit(f"bad configuration {name!r}: expected AXISN[+option...], AXIS in "
                     "data/fsdp/tensor")
  c = dict(defaults, name=name, axis=m.group(1), n=int(m.group(2)), legacy=False, fused=True)
  for o in opts:
    if o == "legacy":
      c["legacy"], c["fused"] = True, False
    elif o == "unfused":
      c["fused"] = False
    elif re.fullmatch(r"m\d+", o):
      c["micro"] = int(o[1:])
    elif re.fullmatch(r"b\d+", o):
      c["batch"] = int(o[1:])
    elif re.fullmatch(r"chunks\d+", o):
      c["chunks"] = int(o[6:])
    elif o[:1] == "x" and o[1:] in XLA_OPTIONS:
      c["xla"] = c.get("xla", "") + " " + XLA_OPTIONS[o[1:]]
    elif re.fullmatch(r"u\d+", o):
      c["unroll"] = int(o[1:])
    elif re.fullmatch(r"seq\d+", o):
      c["seq"] = int(o[3:])
    elif o in ("remat", "dots"):
      c["remat"] = "full" if o == "remat" else "dots"
    elif re.fullmatch(r"e[A-Za-z_0-9]+=.+", o):
      k, v = o[1:].split("=", 1)
      c["extra"] = dict(c.get("extra", {}), **{k: _value(v)})
    elif o.startswith("opt"):
      c["optimizer"] = o[3:]
    elif o.startswith("p"):
      c["preset"] = o[1:]
    else:
      raise SystemExit(f"bad option {o!r} in configuration {name!r}")
  return c


def _value(v: str):
  """``10`` -> 10, ``1e-3`` -> 0.001, ``true`` -> True, anything else the string."""
  if v.lower() in ("true", "false"):
    return v.lower() == "true"
  for t in (int, float):
    try:
      return t(v)
    except ValueError:
      pass
  return v


def run_one(c: dict) -> dict:
  """Trains one configuration in this process; returns the summary plus settings."""
  import jax
  from scaleopt.train import config as C, loop
  mesh = {"data": 1, "fsdp": 1, "tensor": 1, c["axis"]: c["n"]}
  raw = {
      "run": {"steps": c["steps"], "log_every": 10, "eval_every": 0, "eval_batches": 1,
              "checkpoint_every": 0, "async_checkpoint": False, "progress": False,
              "plot": False, "tensorboard": False, "seed": 0},
      "model": {"preset": c["preset"], "dtype": c["dtype"], "max_seq_len": c["seq"],
                "scan_unroll": c["unroll"], "fused_loss": c["fused"],
                "loss_chunks": c.get("chunks", 1), "remat": c.get("remat", "none")},
      "data": {"source": "embedded", "seq_len": c["seq"], "batch_size": c["batch"],
               "microbatches": c["micro"]},
      "optimizer": {"name": c.get("optimizer", "adamw"), "learning_rate": 6e-4,
                    "extra": c.get("extra", {}),
                    "schedule": {"kind": "cosine", "warmup_steps": 2}},
      "mesh": mesh,
  }
  cfg = C.from_dict(raw)
  s = loop.setup(cfg)
  if c["legacy"]:
    s.model = s.model.with_mesh(None)
  with tempfile.TemporaryDirectory() as tmp:
    out = loop.train(cfg, pathlib.Path(tmp) / "run", s=s)
  return dict(c, tokens_per_s=out["tokens_per_s"], mfu=out["mfu"], compile_s=out["compile_s"],
              final_loss=out["final_train_loss"], devices=jax.device_count(),
              sweeps=out.get("sweeps_per_step", 1.0),
              device_kind=jax.devices()[0].device_kind, jax=jax.__version__)


def _spawn(c: dict, gpu: str | None, timeout: int) -> tuple[subprocess.Popen, float]:
  env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
  if gpu is not None:
    env["CUDA_VISIBLE_DEVICES"] = gpu
  elif c["platform"] != "cpu":
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(c["n"]))
  if c["platform"] == "cpu":
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={c['n']}"
  elif c.get("xla"):
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + c["xla"]
  p = subprocess.Popen([sys.executable, __file__, "--one", json.dumps(c)], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  return p, time.time() + timeout


def _collect(p: subprocess.Popen, deadline: float, c: dict) -> dict:
  try:
    out, err = p.communicate(timeout=max(1.0, deadline - time.time()))
  except subprocess.TimeoutExpired:
    p.kill()
    p.communicate()
    print(f"# {c['name']}: timed out", flush=True)
    return dict(c, error="timeout")
  lines = [l for l in out.splitlines() if l.startswith("{")]
  if p.returncode or not lines:
    print(f"# {c['name']}: failed (rc {p.returncode})\n{err[-2000:]}", flush=True)
    return dict(c, error=f"rc {p.returncode}")
  r = json.loads(lines[-1])
  print(f"# {c['name']}: {r['tokens_per_s']:,.0f} tokens/s on {r['devices']} x "
        f"{r['device_kind']}, compile {r['compile_s']:.1f}s, loss {r['final_loss']:.3f}",
        flush=True)
  return r


def run_all(configs: list[dict], timeout: int, pair_single, budget: float,
            single_gpu: str = "0") -> list[dict]:
  """Runs in the given order (up to ``pair_single`` consecutive one-GPU configurations at a
  time, one per GPU; True means 2); configurations that would start after ``budget`` seconds
  are skipped."""
  width = 2 if pair_single is True else int(pair_single or 1)
  t0, results, i = time.time(), {}, 0
  gpu = configs[0]["platform"] != "cpu"
  while i < len(configs):
    group = [configs[i]]
    while (len(group) < width and configs[i]["n"] == 1 and i + len(group) < len(configs)
           and configs[i + len(group)]["n"] == 1):
      group.append(configs[i + len(group)])
    i += len(group)
    if time.time() - t0 > budget:
      for c in group:
        print(f"# {c['name']}: skipped (time budget)", flush=True)
        results[c["name"]] = dict(c, error="skipped")
      continue
    ids = [str(j) for j in range(len(group))] if len(group) > 1 else [single_gpu]
    procs = [(c, *_spawn(c, (ids[j] if gpu else None) if c["n"] == 1 else None, timeout))
             for j, c in enumerate(group)]
    for c, p, dl in procs:
      results[c["name"]] = _collect(p, dl, c)
  return [results[c["name"]] for c in configs]


def _ms(r: dict) -> float:
  return 1e3 * r["batch"] * r["seq"] / r["tokens_per_s"]


def _bases(rows: list[dict]) -> tuple:
  """One-GPU tokens/s by (preset, batch, seq, micro, optimizer, extra), and the fastest adamw
  row by (GPUs, preset, seq, global batch)."""
  key = lambda r: (r["preset"], r["batch"], r["seq"], r["micro"], r.get("optimizer", "adamw"),
                   str(r.get("extra", {})))
  one, fast = {}, {}
  for r in rows:
    if "error" in r:
      continue
    if r["axis"] == "data" and r["n"] == 1:
      one.setdefault(key(r), r["tokens_per_s"])
    if r.get("optimizer", "adamw") == "adamw" and not r.get("extra"):
      k = (r["n"], r["preset"], r["seq"], r["batch"])
      if k not in fast or _ms(r) < _ms(fast[k]):
        fast[k] = r
  return one, fast, key


def table(rows: list[dict]) -> str:
  one, fast, key = _bases(rows)
  out = ["| configuration | mesh | GPUs | preset | tokens/step | microbatches | ms/step | "
         "tokens/s | vs one GPU | vs 1 GPU/GPU-batch | vs adamw step | vs adamw token | MFU | "
         "final train loss |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    tok = r["batch"] * r["seq"]
    mesh = f"{r['axis']} {r['n']}"
    if "error" in r:
      out.append(f"| {r['name']} | {mesh} | {r['n']} | {r['preset']} | {tok} | {r['micro']} |"
                 f" - | {r['error']} | - | - | - | - | - | - |")
      continue
    b = one.get(key(r))
    rel = f"{r['tokens_per_s'] / b:.2f}x" if b else "-"
    weak = one.get(key(dict(r, batch=r["batch"] // r["n"])))
    weak = f"{r['tokens_per_s'] / weak:.2f}x" if weak and r["n"] > 1 else "-"
    f = fast.get((r["n"], r["preset"], r["seq"], r["batch"]))
    step = f"{_ms(r) / _ms(f):.2f}x" if f else "-"
    per_tok = (f"{(_ms(r) / r.get('sweeps', 1)) / (_ms(f) / f.get('sweeps', 1)):.2f}x"
               if f else "-")
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
    out.append(f"| {r['name']} | {mesh} | {r['devices']} | {r['preset']} | {tok} | "
               f"{r['micro']} | {_ms(r):.1f} | {r['tokens_per_s']:,.0f} | {rel} | {weak} | "
               f"{step} | {per_tok} | {mfu} | {r['final_loss']:.3f} |")
  return "\n".join(out)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--one", help=argparse.SUPPRESS)
  ap.add_argument("--quick", action="store_true", help="tiny model on 2 CPU devices")
  ap.add_argument("--configs", default="data1,data2,fsdp2,tensor2")
  ap.add_argument("--preset", default="gpt2-small")
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--seq", type=int, default=1024)
  ap.add_argument("--micro", type=int, default=2)
  ap.add_argument("--unroll", type=int, default=12)
  ap.add_argument("--steps", type=int, default=None, help="default 30 (--quick: 6)")
  ap.add_argument("--timeout", type=int, default=240, help="seconds per configuration")
  ap.add_argument("--pair-single", action="store_true",
                  help="run one-GPU configurations two at a time, one per GPU")
  ap.add_argument("--parallel-single", type=int, default=0,
                  help="run up to K consecutive one-GPU configurations at a time, one per GPU")
  ap.add_argument("--single-gpu", default="0", help="GPU for unpaired one-GPU configurations")
  ap.add_argument("--budget", type=float, default=1e9,
                  help="start no configuration after this many seconds")
  ap.add_argument("--csv", help="write the rows here")
  ap.add_argument("--jsonl", help="append the rows here (one JSON object per line)")
  ap.add_argument("--table-from", help="print one table (and --csv) of the rows of these "
                  "comma-separated JSONL files, several runs on one machine together")
  args = ap.parse_args(argv)
  if args.one:
    print(json.dumps(run_one(json.loads(args.one))), flush=True)
    return 0
  if args.table_from:
    rows = [json.loads(l) for f in args.table_from.split(",") if os.path.exists(f)
            for l in open(f) if l.strip()]
    print(table(rows))
    _write_csv(args.csv, rows)
    return 0
  platform, dtype = "gpu", "bfloat16"
  if args.quick:
    args.preset, args.seq, args.unroll = "tiny", 64, 1
    args.batch = 8 if args.batch == ap.get_default("batch") else args.batch
    args.steps = args.steps or 6
    platform, dtype = "cpu", "float32"
  else:
    os.environ.setdefault("XLA_FLAGS", GPU_FLAGS)
  args.steps = args.steps or 30
  defaults = dict(preset=args.preset, batch=args.batch, seq=args.seq, micro=args.micro,
                  unroll=args.unroll, steps=args.steps, dtype=dtype, platform=platform)
  configs = [parse(n, defaults) for n in args.configs.split(",")]
  if args.quick:  # every configuration tiny (plumbing check of a GPU suite on CPU)
    for c in configs:
      c.update(preset="tiny", seq=64, unroll=1, batch=min(c["batch"], 16),
               remat=c.get("remat", "none"))
  print(f"# XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; {len(configs)} configurations, "
        f"{args.steps} steps each", flush=True)
  width = args.parallel_single or (2 if args.pair_single else 1)
  rows = run_all(configs, args.timeout, width, args.budget, args.single_gpu)
  print()
  print(table(rows))
  _write_csv(args.csv, rows)
  if args.jsonl:
    with open(args.jsonl, "a") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  return 0 if all("error" not in r for r in rows) else 1


def _write_csv(path, rows: list) -> None:
  if not path:
    return
  keys = sorted({k for r in rows for k in r})
  with open(path, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=keys)
    w.writeheader()
    w.writerows(rows)


if __name__ == "__main__":
  sys.exit(main())
