"""Where the train step's GPU time goes: a profiler trace of a few steps, summed by kernel kind.

  PYTHONPATH=. python benchmarks/profile_step.py [--preset gpt2-small --batch 32 --micro 1
      --unroll 0 --steps 3 --out DIR --top 25 --hlo FILE] [--set KEY=VALUE ...]

``--set`` takes the training config's dotted overrides, e.g. ``--set optimizer.name=adamw_bc
--set optimizer.extra.loo_passes=1`` or ``--set optimizer.name=shampoo`` (the step then also
holds that optimizer's statistics; a root step of Shampoo is among the recorded steps only if
``--steps`` reaches it).

Builds the training system's jitted step (``scaleopt.train``: collector, AdamW, skip guard,
metrics) for the preset, runs warm-up steps on a fixed batch, then records ``--steps`` steps
with ``jax.profiler.trace(create_perfetto_trace=True)`` and sums the device-side kernel
durations per step by kind: GEMM (cuBLAS), attention (cuDNN), XLA fusions (elementwise and
reductions), copies / memsets, collectives (NCCL), other. Kernel time can exceed the step time
only where kernels overlap (several streams). The ``--top`` kernels are listed by time; a fusion's
row also shows the bytes it reads and writes per call (its operands and outputs in the compiled
HLO, an upper bound where it reads only part of an operand) and the bandwidth that gives.
``--hlo FILE`` writes the compiled step's HLO text, to map fusions back to the model's ops.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

import jax

from scaleopt.models import accounting
from scaleopt.train import config as C
from scaleopt.train import data as D
from scaleopt.train import flops, loop

KINDS = (("collective", ("nccl", "all-reduce", "all-gather", "reduce-scatter", "allreduce",
                         "allgather", "reducescatter")),
         ("attention", ("cudnn", "fmha", "flash", "sdpa", "attention")),
         ("gemm", ("gemm", "cublas", "xmma", "nvjet", "cutlass", "matmul", "gemv")),
         ("copy/memset", ("memcpy", "memset", "copy")),
         ("fusion", ("fusion", "loop_", "input_", "reduce", "wrapped", "convert", "transpose",
                     "concatenate", "slice", "scatter", "gather", "triton")))


def kind_of(name: str) -> str:
  low = name.lower()
  for kind, keys in KINDS:
    if any(k in low for k in keys):
      return kind
  return "other"


def gpu_events(trace: dict) -> list[dict]:
  """Complete events ("X") on device processes of a perfetto/chrome trace."""
  names = {e["pid"]: e.get("args", {}).get("name", "") for e in trace.get("traceEvents", [])
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  dev = {p for p, n in names.items() if "gpu" in n.lower() or "device" in n.lower()}
  threads = {(e["pid"], e["tid"]): e.get("args", {}).get("name", "")
             for e in trace.get("traceEvents", [])
             if e.get("ph") == "M" and e.get("name") == "thread_name" and e["pid"] in dev}
  streams = {k for k, n in threads.items() if "stream" in n.lower()}  # not derived XLA lines
  ev = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
  if streams:
    return [e for e in ev if (e["pid"], e["tid"]) in streams]
  return [e for e in ev if e["pid"] in dev] if dev else ev


_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
          "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_INSTR = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([\w\-]+)\((.*?)\)(?:, |$)")
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")


def _array_bytes(text: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(text):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _BYTES[dtype]
  return total


def fusion_bytes(hlo_text: str) -> dict[str, int]:
  """Bytes each fusion of a compiled HLO module reads and writes: its operands' and outputs'
  sizes (an upper bound where an operand is broadcast or sliced inside the fusion)."""
  sizes, fusions = {}, {}
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    name, shape, op, operands = m.groups()
    sizes[name] = _array_bytes(shape)
    if op == "fusion":
      fusions[name] = (sizes[name], re.findall(r"%([\w.\-]+)", operands))
  # Kernels are named after their fusion with '.' written as '_'.
  return {n.replace(".", "_"): out + sum(sizes.get(o, 0) for o in ops)
          for n, (out, ops) in fusions.items()}


def summarize(events: list[dict], steps: int, top: int = 25,
              nbytes: dict[str, int] | None = None) -> str:
  """Per-kind and per-kernel times; with ``nbytes`` (fusion name -> bytes) a fusion row also
  shows its traffic per call and the bandwidth it reached."""
  nbytes = nbytes or {}
  by_kind, by_name = collections.Counter(), collections.Counter()
  count = collections.Counter()
  for e in events:
    by_kind[kind_of(e["name"])] += e["dur"]
    by_name[e["name"]] += e["dur"]
    count[e["name"]] += 1
  total = sum(by_kind.values())
  out = ["| kernel kind | ms per step | share |", "|---|---|---|"]
  for k, v in by_kind.most_common():
    out.append(f"| {k} | {v / 1e3 / steps:.2f} | {100 * v / max(total, 1):.1f}% |")
  out.append(f"| all kernels | {total / 1e3 / steps:.2f} | 100% |")
  out += ["", "| kernel | kind | calls per step | ms per step | MB per call | GB/s |",
          "|---|---|---|---|---|---|"]
  for n, v in by_name.most_common(top):
    b = nbytes.get(n)
    bw = f"{b / 1e6:.0f} | {b * count[n] / (v * 1e-6) / 1e9:.0f}" if b else "- | -"
    out.append(f"| {n[:90]} | {kind_of(n)} | {count[n] / steps:.0f} | {v / 1e3 / steps:.2f} "
               f"| {bw} |")
  return "\n".join(out)


def _timed(step, state, batch, warmup: int, steps: int):
  """(state, seconds per step) over ``steps`` steps after ``warmup`` untimed ones."""
  for _ in range(warmup):
    state, m = step(state, batch)
  if warmup:
    jax.block_until_ready(m["loss"])
  t0 = time.perf_counter()
  for _ in range(steps):
    state, m = step(state, batch)
  jax.block_until_ready(m["loss"])
  return state, (time.perf_counter() - t0) / max(steps, 1)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="gpt2-small")
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--seq", type=int, default=1024)
  ap.add_argument("--micro", type=int, default=1)
  ap.add_argument("--unroll", type=int, default=0,
                  help="model scan_unroll (0: all layers, no loop)")
  ap.add_argument("--steps", type=int, default=3)
  ap.add_argument("--warmup", type=int, default=5)
  ap.add_argument("--unfused", action="store_true", help="plain float32-logits loss")
  ap.add_argument("--out", default=None, help="directory for the trace (default: temporary)")
  ap.add_argument("--top", type=int, default=25, help="kernels listed by time")
  ap.add_argument("--hlo", default=None, help="write the compiled step's HLO text here")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="training-config override, e.g. optimizer.name=shampoo (repeatable)")
  args = ap.parse_args(argv)
  raw = {"run": {"steps": 1, "progress": False, "plot": False, "tensorboard": False},
         "model": {"preset": args.preset, "dtype": "bfloat16", "max_seq_len": args.seq,
                   "scan_unroll": args.unroll, "fused_loss": not args.unfused},
         "data": {"source": "embedded", "seq_len": args.seq, "batch_size": args.batch,
                  "microbatches": args.micro},
         "optimizer": {"name": "adamw"}, "mesh": {"data": -1}}
  try:
    cfg = C.from_dict(C.apply_overrides(raw, args.set))
    s = loop.setup(cfg)
    fns = loop.compile_fns(s)
    d = cfg.data
    it = D.Batches(s.train_w, d.batch_size, d.microbatches, groups=s.spec.num_groups,
                   rolling_b=s.spec.layout == "rolling_b", seed=0)
    batch = {k: jax.device_put(v, fns.batch_sh) for k, v in it.next().items()}
    state = fns.init()
    step = fns.train_step.lower(state, batch).compile()
  except (C.ConfigError, ValueError) as e:
    print(f"profile_step: {e}", file=sys.stderr)
    return 2
  state, wall = _timed(step, state, batch, args.warmup, args.steps)
  out = args.out or tempfile.mkdtemp()
  with jax.profiler.trace(out, create_perfetto_trace=True):
    _timed(step, state, batch, 0, args.steps)
  files = sorted(glob.glob(os.path.join(out, "**", "*.trace.json.gz"), recursive=True))
  dev = jax.devices()[0]
  print(f"# {dev.device_kind} x {jax.device_count()}, jax {jax.__version__}, {args.preset} "
        f"{d.batch_size} x {d.seq_len}, {d.microbatches} microbatch(es), fused loss "
        f"{not args.unfused}, {' '.join(args.set) or 'adamw'}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  peak = flops.peak_flops(dev, None)
  tokens_per_s = s.spec.num_groups * d.batch_size * d.seq_len / wall
  mfu = peak and accounting.mfu(tokens_per_s, s.model.cfg, d.seq_len, peak * jax.device_count())
  util = f", MFU {100 * mfu:.1f}%" if peak else ""
  print(f"# step time without the profiler: {1e3 * wall:.1f} ms{util}")
  if not files:
    print("# no perfetto trace was written")
    return 1
  with gzip.open(files[-1], "rt") as f:
    trace = json.load(f)
  hlo = step.as_text() or ""
  if args.hlo:
    with open(args.hlo, "w") as f:
      f.write(hlo)
  print(summarize(gpu_events(trace), args.steps, args.top, fusion_bytes(hlo)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
