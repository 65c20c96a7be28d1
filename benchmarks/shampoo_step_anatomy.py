"""Anatomy of the compiled train step: what an optimizer adds (compile only, nothing runs).

  PYTHONPATH=. python benchmarks/shampoo_step_anatomy.py            # gpt2-small, CPU or GPU
  PYTHONPATH=. python benchmarks/shampoo_step_anatomy.py --configs data1,data1+optshampoo \
      [--preset gpt2-small --batch 64 --seq 1024 --micro 1 --csv OUT.csv]
  PYTHONPATH=. python benchmarks/shampoo_step_anatomy.py --quick    # tiny model (plumbing)

Configurations are ``mesh_throughput.py``'s (``AXISN[+option...]``, e.g.
``fsdp4+optshampoo+ematmul_precision=TF32_TF32_F32``); each is lowered and compiled in its own
process on N devices (on CPU N simulated host devices, on GPU the first N GPUs) exactly as
``scaleopt.train.loop`` builds its train step, and two HLO texts are read:

* the program before XLA's optimizations (backend-independent, global shapes): every dot with
  its precision (``operand_precision`` / ``algorithm``; none: DEFAULT) and FLOPs
  2 * prod(output) * prod(contracted dims);
* the compiled per-device program: collectives (all-gather, reduce-scatter, all-reduce,
  all-to-all, collective-permute, with their async ``-start`` forms) and their result bytes,
  fusions (kernels), and transposes / copies of at least ``--big`` MiB (top level or inside a
  fusion) with their bytes.

Every op is attributed by its source stack (the HLO's stack-frame table): ``shampoo step``
(shampoo_lib/ outside the root computation: statistics, P_L M P_R, blocking, grafting),
``shampoo roots`` (``_roots`` and the collector's factor pass: root steps only, inside
``lax.cond``), ``optimizer`` (other optimizer code: optax, AdamW, the collector),
``model`` (scaleopt/models), ``other`` (the step's plumbing and ops without a source, such
as the partitioner's resharding). Counts are static: an op inside a loop body counts once (the model's layer scan is a
loop; the optimizer's per-step ops are not). "model fwd+bwd" is 6 x parameters x tokens per
step (without attention), for scale. The table has one column per configuration.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import pathlib
import re
import subprocess
import sys
from collections import defaultdict

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import mesh_throughput as mt  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
F32 = "+eroot_method=eigh+ematmul_precision=highest+estats_precision=highest"
DEFAULT_CONFIGS = (f"data1,data1+optshampoo{F32},data1+optshampoo+ematmul_precision=default,"
                   "data1+optshampoo+ematmul_precision=default+estats_precision=default,"
                   f"data1+optshampoo,fsdp4,fsdp4+optshampoo{F32},"
                   "fsdp4+optshampoo+ematmul_precision=default+estats_precision=default")
ROOT_FUNCS = {"_roots", "_factor_pass", "_eig_variances", "eigh_damped", "root_from_eig",
              "newton_inverse_root", "_batched_by_size"}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
PARTS = ("shampoo step", "shampoo roots", "optimizer", "model", "other")
BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
         "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
SHAPE = re.compile(r"\b(" + "|".join(BYTES) + r"|f8\w*)\[([\d,]*)\]")
INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
MIB = 2 ** 20


# ----------------------------------------------------------------------------- HLO text

def shapes_of(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
  """[(dtype, dims)] of an HLO type (an array or a tuple of arrays)."""
  return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in
          SHAPE.findall(type_text)]


def nbytes(type_text: str) -> int:
  return sum(BYTES.get(t, 1) * math.prod(d) for t, d in shapes_of(type_text))


def split_instr(line: str):
  """(name, type text, opcode, rest) of an HLO instruction line, or None."""
  m = INSTR.match(line)
  if not m:
    return None
  name, rest = m.groups()
  if rest.startswith("("):  # tuple type: up to the matching parenthesis
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        break
    type_text, rest = rest[:i + 1], rest[i + 1:].lstrip()
  else:
    type_text, _, rest = rest.partition(" ")
  op = re.match(r"([\w\-]+)\(", rest)
  return (name, type_text, op.group(1), rest) if op else None


def frame_tables(text: str) -> dict:
  """{stack_frame_id: [(file, function), ...] innermost first} from the HLO's tables."""
  sections, cur = defaultdict(dict), None
  for line in text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      cur = line
      continue
    m = re.match(r"^(\d+) (.*)$", line) if cur else None
    if not m:
      cur = None if not line.strip() else cur
      continue
    sections[cur][int(m.group(1))] = m.group(2)
  files = {k: v.strip('"') for k, v in sections["FileNames"].items()}
  funcs = {k: v.strip('"') for k, v in sections["FunctionNames"].items()}
  locs = {}
  for k, v in sections["FileLocations"].items():
    f = re.search(r"file_name_id=(\d+) function_name_id=(\d+)", v)
    locs[k] = (files.get(int(f.group(1)), "?"), funcs.get(int(f.group(2)), "?"))
  frames = {}
  for k, v in sections["StackFrames"].items():
    f = re.search(r"file_location_id=(\d+) parent_frame_id=(\d+)", v)
    frames[k] = (int(f.group(1)), int(f.group(2)))

  def chain(fid):
    out, seen = [], set()
    while fid in frames and fid not in seen:
      seen.add(fid)
      loc, parent = frames[fid]
      out.append(locs.get(loc, ("?", "?")))
      fid = parent
    return out

  return {k: chain(k) for k in frames}


def part_of(rest: str, stacks: dict) -> str:
  """Which part of the step an op comes from (see the module docstring)."""
  m = re.search(r"stack_frame_id=(\d+)", rest)
  stack = stacks.get(int(m.group(1)), []) if m else []
  files = [f for f, _ in stack]
  if any("/shampoo_lib/" in f for f in files):
    if any(fn.split(".")[0] in ROOT_FUNCS for f, fn in stack if "/shampoo_lib/" in f):
      return "shampoo roots"
    return "shampoo step"
  if any("/optax/" in f or "/scaleopt/optim/" in f for f in files):
    return "optimizer"
  return "model" if any("/scaleopt/models/" in f for f in files) else "other"


def precision_of(rest: str) -> str:
  a = re.search(r"algorithm=([\w]+)", rest)
  if a:
    return a.group(1).replace("dot_", "")
  p = re.search(r"operand_precision=\{(\w+)", rest)
  return p.group(1) if p else "default"


def dot_stats(text: str) -> dict:
  """Dots of the unoptimized program by (part, precision): count and GFLOP."""
  stacks, shape_of, out = frame_tables(text), {}, defaultdict(float)
  lines = [split_instr(l) for l in text.splitlines()]
  for ins in lines:
    if ins:
      shape_of[ins[0]] = shapes_of(ins[1])
  for ins in lines:
    if not ins or ins[2] != "dot":
      continue
    name, type_text, _, rest = ins
    lhs = rest[4:].split(",")[0].strip().lstrip("%")
    lhs_dims = shape_of.get(lhs, [("f32", ())])[0][1]
    cdims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
    k = math.prod(lhs_dims[int(i)] for i in cdims.group(1).split(",") if i) if cdims else 1
    flops = 2 * math.prod(shapes_of(type_text)[0][1]) * k
    key = f"{part_of(rest, stacks)}|{precision_of(rest)}"
    out[f"dots|{key}"] += 1
    out[f"gflop|{key}"] += flops / 1e9
  return dict(out)


def compiled_stats(text: str, big_mib: float) -> dict:
  """Collectives, fusions and big transposes / copies of the compiled program, by part."""
  stacks, out = frame_tables(text), defaultdict(float)
  fused = set(re.findall(r"calls=%?([\w.\-]+)", text))
  comp = None
  for line in text.splitlines():
    head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if head and not line.startswith(" "):
      comp = head.group(1)
      continue
    ins = split_instr(line) if comp else None
    if not ins:
      continue
    _, type_text, op, rest = ins
    in_fusion = comp in fused
    part = part_of(rest, stacks)
    base = op[:-6] if op.endswith("-start") else op
    if base in COLLECTIVES and not in_fusion:
      b = nbytes(type_text)
      if op.endswith("-start"):  # async result tuples carry the operand too: the largest
        b = max((BYTES.get(t, 1) * math.prod(d) for t, d in shapes_of(type_text)), default=0)
      out[f"{base}|{part}"] += 1
      out[f"{base} MiB|{part}"] += b / MIB
    elif op == "fusion" and not in_fusion:
      out[f"fusions|{part}"] += 1
      out[f"fusion out MiB|{part}"] += nbytes(type_text) / MIB
    elif op in ("transpose", "copy") and nbytes(type_text) >= big_mib * MIB:
      out[f"big {op}|{part}"] += 1
      out[f"big {op} MiB|{part}"] += nbytes(type_text) / MIB
  return dict(out)


# ----------------------------------------------------------------------------- one configuration

def lowered_step(c: dict):
  """The train step of configuration ``c`` lowered on its mesh (``scaleopt.train.loop``'s
  jit, shardings and donation), the setup and the jitted functions."""
  from scaleopt.train import loop
  s = loop.setup(mt.train_config(c))
  fns = loop.compile_fns(s)
  return fns.train_step.lower(*mt.step_inputs(s, fns)), s, fns


def run_one(c: dict) -> dict:
  import time
  import jax
  t0 = time.time()
  low, s, fns = lowered_step(c)
  pre = low.as_text(dialect="hlo", debug_info=True)
  t1 = time.time()
  compiled = low.compile()
  t2 = time.time()
  n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(fns.state_shape.params))
  tokens = s.spec.num_groups * s.cfg.data.batch_size * s.cfg.data.seq_len
  return dict(name=c["name"], devices=jax.device_count(), card=jax.devices()[0].device_kind,
              jax=jax.__version__, params_m=n_params / 1e6, model_gflop=6e-9 * n_params * tokens,
              lower_s=t1 - t0, compile_s=t2 - t1, **dot_stats(pre),
              **compiled_stats(compiled.as_text(), c["big"]))


# ----------------------------------------------------------------------------- table

def _cell(r: dict, a: str, b: str, part: str, fmt: str) -> str:
  n, v = r.get(f"{a}|{part}", 0), r.get(f"{b}|{part}", 0)
  return "-" if not n else fmt.format(n=n, v=v)


def table(rows: list[dict]) -> str:
  """One column per configuration: dots (count / GFLOP) by part and precision, collectives
  (count / MiB), fusions (count / MiB written), big transposes and copies (count / MiB)."""
  ok = [r for r in rows if "error" not in r]

  def line(label, f):
    cells = [f(r) if "error" not in r else r["error"][:60] for r in rows]
    return f"| {label} | " + " | ".join(cells) + " |"

  out = ["| | " + " | ".join(r["name"] for r in rows) + " |", "|---|" + "---|" * len(rows),
         line("devices; card", lambda r: f"{r['devices']}; {r['card']}"),
         line("model fwd+bwd GFLOP (6 N T)", lambda r: f"{r['model_gflop']:,.0f}")]
  keys = sorted({k for r in ok for k in r if "|" in k})
  dot_keys = sorted({k.split("|", 1)[1] for k in keys if k.startswith("dots|")},
                    key=lambda k: (PARTS.index(k.split("|")[0]), k))
  for k in dot_keys:
    part, prec = k.split("|")
    out.append(line(f"dots {part}, {prec}: count / GFLOP",
                    lambda r: _cell(r, "dots", "gflop", k, "{n:.0f} / {v:,.1f}")))
  step = lambda r: sum(v for k, v in r.items() if k.startswith("gflop|shampoo step|"))
  out.append(line("shampoo step dot GFLOP / model fwd+bwd",
                  lambda r: f"{100 * step(r) / r['model_gflop']:.2f}%" if step(r) else "-"))
  kinds = [k for k in COLLECTIVES + ("fusions", "big transpose", "big copy")
           if any(x.startswith(k + "|") for x in keys)]
  for kind in kinds:
    unit = "fusion out MiB" if kind == "fusions" else f"{kind} MiB"
    for part in PARTS:
      if any(f"{kind}|{part}" in r for r in ok):
        out.append(line(f"{kind}, {part}: count / MiB",
                        lambda r: _cell(r, kind, unit, part, "{n:.0f} / {v:,.1f}")))
  out.append(line("lower + compile s", lambda r: f"{r['lower_s'] + r['compile_s']:.0f}"))
  return "\n".join(out)


# ----------------------------------------------------------------------------- driver

def spawn(c: dict, platform: str, timeout: int) -> dict:
  """Runs one configuration in a fresh process on ``c["n"]`` devices; its result row."""
  env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
  if platform == "cpu":
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={c['n']}"
  else:
    env["CUDA_VISIBLE_DEVICES"] = mt.visible_gpus(list(range(c["n"])))
    env.setdefault("XLA_FLAGS", mt.GPU_FLAGS)
  try:
    p = subprocess.run([sys.executable, __file__, "--one", json.dumps(c)], env=env,
                       capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return dict(name=c["name"], error="timeout")
  rows = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
  if rows:
    return rows[-1]
  tail = (p.stderr.strip().splitlines() or ["?"])[-1]
  return dict(name=c["name"], error=f"rc {p.returncode}: {tail[:200]}")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--one", help=argparse.SUPPRESS)
  ap.add_argument("--configs", default=DEFAULT_CONFIGS)
  ap.add_argument("--preset", default="gpt2-small")
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--seq", type=int, default=1024)
  ap.add_argument("--micro", type=int, default=1)
  ap.add_argument("--unroll", type=int, default=0,
                  help="model scan_unroll (0: all layers, no loop)")
  ap.add_argument("--platform", choices=("auto", "cpu", "gpu"), default="auto")
  ap.add_argument("--big", type=float, default=1.0, help="MiB: smallest transpose/copy counted")
  ap.add_argument("--timeout", type=int, default=900, help="seconds per configuration")
  ap.add_argument("--quick", action="store_true", help="tiny model, 64 tokens, 8 sequences")
  ap.add_argument("--csv", help="write the rows here")
  args = ap.parse_args(argv)
  if args.one:
    print(json.dumps(run_one(json.loads(args.one))), flush=True)
    return 0
  if args.quick:
    args.preset, args.seq, args.batch, args.unroll = "tiny", 64, 8, 1
  platform = args.platform
  if platform == "auto":
    platform = "gpu" if subprocess.run("command -v nvidia-smi", shell=True,
                                       capture_output=True).returncode == 0 else "cpu"
  defaults = dict(preset=args.preset, batch=args.batch, seq=args.seq, micro=args.micro,
                  unroll=args.unroll, steps=100, platform=platform, fit_probe=[8, 16],
                  dtype="float32" if args.quick else "bfloat16", big=args.big)
  configs = [mt.parse(n, defaults) for n in args.configs.split(",")]
  rows = []
  for c in configs:
    r = spawn(c, platform, args.timeout)
    print(f"# {c['name']}: " + (r["error"] if "error" in r else
                                f"compiled in {r['lower_s'] + r['compile_s']:.0f} s"),
          flush=True)
    rows.append(r)
  print(f"\n{args.preset}, {args.batch} x {args.seq} tokens per step, {args.micro} "
        f"microbatch(es), {platform}; static op counts (see the module docstring)\n")
  print(table(rows))
  if args.csv:
    keys = sorted({k for r in rows for k in r})
    with open(args.csv, "w", newline="") as f:
      w = csv.DictWriter(f, fieldnames=keys)
      w.writeheader()
      w.writerows(rows)
  return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
