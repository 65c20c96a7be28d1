"""Training-system throughput across meshes and GPU counts, each configuration in its own process.

  PYTHONPATH=. python benchmarks/mesh_throughput.py --configs data1,data2,fsdp2,tensor2 \
      [--preset gpt2-small --batch 64 --micro 2 --unroll 0 --steps 30 --csv OUT.csv]
  PYTHONPATH=. python benchmarks/mesh_throughput.py --quick      # CPU smoke run (2 devices)

A configuration is ``AXISN[+option...]``: AXIS one of data / fsdp / tensor, N its size (the
number of GPUs; ``data1`` is the one-GPU baseline, run on the first visible GPU).
Options: ``legacy`` (the model without its sharding constraints and with the unfused loss: the
program before the FSDP fix), ``unfused`` (plain float32-logits loss), ``mK`` (K
microbatches), ``bN`` (N sequences per step), ``pNAME`` (model preset), ``chunksK`` (fused
loss in K sequence slices), ``optNAME`` (optimizer, default adamw), ``uK`` (scan_unroll),
``seqT`` (sequence length), ``remat`` / ``dots`` (full / dots rematerialization), ``xNAME``
(an extra XLA flag from ``XLA_OPTIONS``), ``eKEY=VALUE`` (an ``optimizer.extra`` entry, e.g.
``+optadamw_bc+ecrossfit=loo``, ``+optshampoo+eroot_every=10``, ``+emu_dtype=bfloat16``),
``mKEY=VALUE`` (a ``model`` entry, e.g. ``+mattention_impl=xla``), ``rKEY=VALUE`` (a ``run``
entry, e.g. ``+rhost_phases=off``: one program with device branches),
``fitG`` (the largest batch whose compiled step fits G GiB per device, see below), ``zero``
(``mesh.shard_optimizer``: the optimizer state split over the data axis, ZeRO-1).

``fitG``: before training, the train step is compiled (not run) on the configuration's mesh at
the per-GPU microbatch sizes of ``--fit-probe`` (default 8 and 16 sequences) and
``memory_analysis()`` gives its per-device peak (arguments + outputs - donated + temporaries);
the peak is affine in the microbatch size, so the line through the two largest probes gives
the largest size under G GiB, which is compiled once more to confirm it (and lowered by the
line again if it does not fit). The configuration then trains at that size with its own
microbatch count and remat setting; the probe table is printed. The compiles go to a
persistent compilation cache of the process, so training at a probed size compiles nothing
again, and ``XLA_PYTHON_CLIENT_MEM_FRACTION`` is raised to 0.94 (the allocator must hold the
chosen peak; default 0.75) unless set.

``--same-process`` runs all configurations in one process, one after another (no second
start-up and device initialization; a fit configuration should come first, while the
device memory is unfragmented). Every configuration runs without evaluation and skips the
final checkpoint write (neither is part of the timed steps).

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
  vs adamw token      the same per executed token (tokens through forward+backward: the
                      step's groups x batch x sweeps; leave-one-out sweeps its batch once
                      (twice with ``loo_passes=2``),
                      the A/B layout draws two groups of ``batch`` sequences per step)
  same micro          per executed token over the ``adamw`` row with the same mesh, global
                      tokens per step and microbatches per sweep (same microbatch size):
                      the cost of the statistics alone, without the microbatching effect

``--cell-tokens N`` adds a table of the minutes each configuration takes to train N tokens
(training at its tokens/s plus its compile; the paper's Table 2 cell is 262144000), e.g.
``--configs data1+b512+m64+optadamw,data1+b512+m64+optadamw_bc+ecrossfit=loo``.

A multi-GPU configuration sees the first N GPUs (``CUDA_VISIBLE_DEVICES=0..N-1``), or the
first N of the caller's ``CUDA_VISIBLE_DEVICES`` when it is set; GPU numbers given on the
command line (``--single-gpu``) count within that list too.
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
    "cudnnf": "--xla_gpu_cudnn_gemm_fusion_level=2",
}


def parse(name: str, defaults: dict) -> dict:
  """``fsdp2+m4+legacy`` -> the run's settings."""
  head, *opts = name.split("+")
  m = re.fullmatch(r"(data|fsdp|tensor)(\d+)", head)
  if not m:
    _bad(f"bad configuration {name!r}: expected AXISN[+option...], AXIS in data/fsdp/tensor")
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
    elif re.fullmatch(r"fit\d+(\.\d+)?", o):
      c["fit"] = float(o[3:])
    elif o == "zero":
      c["shard_optimizer"] = True
    elif o in ("remat", "dots"):
      c["remat"] = "full" if o == "remat" else "dots"
    elif re.fullmatch(r"m[a-z][a-z_0-9]*=.+", o):
      k, v = o[1:].split("=", 1)
      c["model"] = dict(c.get("model", {}), **{k: _value(v)})
    elif re.fullmatch(r"r[a-z][a-z_0-9]*=.+", o):
      k, v = o[1:].split("=", 1)
      c["run"] = dict(c.get("run", {}), **{k: _value(v)})
    elif re.fullmatch(r"e[A-Za-z_0-9]+=.+", o):
      k, v = o[1:].split("=", 1)
      c["extra"] = dict(c.get("extra", {}), **{k: _value(v)})
    elif o.startswith("opt"):
      c["optimizer"] = o[3:]
    elif o.startswith("p"):
      c["preset"] = o[1:]
    else:
      _bad(f"bad option {o!r} in configuration {name!r}")
  return c


def _bad(msg: str):
  """A bad command line: one line on stderr, exit status 2."""
  print(msg, file=sys.stderr)
  raise SystemExit(2)


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


GIB = 2 ** 30


def train_config(c: dict, batch: int | None = None):
  """The TrainConfig of configuration ``c`` (``batch`` sequences per step instead of its own);
  no evaluation: only training steps are timed."""
  from scaleopt.train import config as C
  mesh = {"data": 1, "fsdp": 1, "tensor": 1, c["axis"]: c["n"],
          "shard_optimizer": c.get("shard_optimizer", False)}
  raw = {
      "run": {"steps": c["steps"], "log_every": 10, "eval_every": 0, "eval_tokens": 0,
              "checkpoint_every": 0, "async_checkpoint": False, "progress": False,
              "plot": False, "tensorboard": False, "seed": 0, **c.get("run", {})},
      "model": {"preset": c["preset"], "dtype": c["dtype"], "max_seq_len": c["seq"],
                "scan_unroll": c["unroll"], "fused_loss": c["fused"],
                "loss_chunks": c.get("chunks", 1), "remat": c.get("remat", "none"),
                **c.get("model", {})},
      "data": {"source": "embedded", "seq_len": c["seq"], "batch_size": batch or c["batch"],
               "microbatches": c["micro"]},
      "optimizer": {"name": c.get("optimizer", "adamw"), "learning_rate": 6e-4,
                    "extra": c.get("extra", {}),
                    "schedule": {"kind": "cosine", "warmup_steps": 2}},
      "mesh": mesh,
  }
  return C.from_dict(raw)


def step_inputs(s, fns) -> tuple:
  """Abstract (state, batch) of setup ``s``'s train step with their shardings: what
  ``fns.train_step.lower`` compiles without running."""
  import jax
  import jax.numpy as jnp
  st = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                    fns.state_shape, fns.state_sh)
  d = s.cfg.data
  shape = (d.microbatches * s.spec.num_groups, d.batch_size // d.microbatches, d.seq_len + 1)
  batch = {"tokens": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=fns.batch_sh)}
  if s.spec.layout == "rolling_b":
    batch["b_tokens"] = batch["tokens"]
  return st, batch


def compiled_peak(c: dict, per_gpu: int) -> dict:
  """Per-device bytes of configuration ``c``'s train step at ``per_gpu`` sequences per GPU and
  microbatch, compiled (not run) on its mesh: arguments, temporaries and the peak
  (arguments + outputs - donated + temporaries)."""
  from scaleopt.train import loop, mesh as mesh_lib
  shards = c["n"] if c["axis"] in ("data", "fsdp") else 1
  s = loop.setup(train_config(c, per_gpu * shards * c["micro"]))
  assert mesh_lib.batch_shards(s.mesh) == shards
  fns = loop.compile_fns(s)
  st, batch = step_inputs(s, fns)
  d = s.cfg.data
  t0 = time.time()
  ma = fns.train_step.lower(st, batch).compile().memory_analysis()
  peak = (ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
          + ma.temp_size_in_bytes)
  return dict(per_gpu=per_gpu, batch=d.batch_size, args=ma.argument_size_in_bytes,
              temp=ma.temp_size_in_bytes, peak=peak, compile_s=time.time() - t0)


def fit_choice(points: list[tuple[int, float]], limit: float) -> int:
  """Largest microbatch size b with peak(b) <= limit on the line through the two probes of
  largest b (peak is affine in b: fixed state plus per-sequence activations)."""
  (b1, p1), (b2, p2) = sorted(points)[-2:]
  slope = (p2 - p1) / (b2 - b1)
  if slope <= 0:
    raise ValueError(f"compiled peak does not grow with the batch ({b1}: {p1:.0f} B, "
                     f"{b2}: {p2:.0f} B); cannot extrapolate")
  return b2 + int((limit - p2) // slope)


def fit_batch(c: dict) -> dict:
  """``batch`` (sequences per step) for configuration ``c`` with ``c["fit"]`` GiB per device,
  and the probe rows (``fit_rows``) behind it; see the module docstring."""
  import jax
  limit = c["fit"] * GIB
  stats = jax.devices()[0].memory_stats() or {}
  if stats.get("bytes_limit"):  # the allocator's own limit, less 1 GiB for what else it holds
    limit = min(limit, stats["bytes_limit"] - GIB)
  rows = {b: compiled_peak(c, b) for b in c["fit_probe"]}
  b = fit_choice([(k, r["peak"]) for k, r in rows.items()], limit)
  for _ in range(4):  # confirm the choice; a miss lowers it along the refitted line
    if b < 1:
      raise ValueError(f"no per-GPU microbatch fits {limit / GIB:.2f} GiB")
    if b not in rows:
      rows[b] = compiled_peak(c, b)
    if rows[b]["peak"] <= limit:
      break
    b = min(b - 1, fit_choice([(k, r["peak"]) for k, r in rows.items() if k <= b], limit))
  else:
    raise ValueError(f"no confirmed per-GPU microbatch under {limit / GIB:.2f} GiB")
  (b1, p1), (b2, p2) = [(k, rows[k]["peak"]) for k in c["fit_probe"][-2:]]
  line = lambda k: p2 + (k - b2) * (p2 - p1) / (b2 - b1)  # the probes' line, for the table
  out = [dict(r, chosen=k == b, line=line(k)) for k, r in sorted(rows.items())]
  alloc = f"{stats['bytes_limit'] / GIB:.2f} GiB" if stats.get("bytes_limit") else "n/a"
  print(f"# {c['name']}: per-device limit {limit / GIB:.2f} GiB (allocator limit {alloc}); "
        "compiled train step per device:", flush=True)
  print("\n".join("# " + l for l in fit_table(c, out).splitlines()), flush=True)
  return dict(batch=rows[b]["batch"], fit_per_gpu=b, fit_limit=limit, fit_rows=out)


def fit_table(c: dict, rows: list[dict]) -> str:
  out = ["| sequences per GPU and microbatch | global batch | arguments GiB | temporaries GiB | "
         "peak GiB | probes' line GiB | compile s | chosen |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    out.append(f"| {r['per_gpu']} | {r['batch']} | {r['args'] / GIB:.3f} | "
               f"{r['temp'] / GIB:.3f} | {r['peak'] / GIB:.3f} | {r['line'] / GIB:.3f} | "
               f"{r['compile_s']:.1f} | {'yes' if r['chosen'] else ''} |")
  return "\n".join(out)


def _no_final_checkpoint():
  """The loop always writes the final state (GBs for qwen2.5-0.5b): not part of the timed
  steps, skipped in benchmark processes."""
  from scaleopt.train import checkpoint
  checkpoint.Checkpointer.save = lambda self, *a, **k: None


def _compile_cache(path: str) -> None:
  """Persistent compilation cache of this process: a probed size trains without compiling."""
  import jax
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def run_one(c: dict) -> dict:
  """Trains one configuration in this process; returns the summary plus settings."""
  import jax
  from scaleopt.train import loop
  t0 = time.time()
  if c.get("fit"):
    c = dict(c, **fit_batch(c))
  cfg = train_config(c)
  s = loop.setup(cfg)
  if c["legacy"]:
    s.model = s.model.with_mesh(None)
  with tempfile.TemporaryDirectory() as tmp:
    out = loop.train(cfg, pathlib.Path(tmp) / "run", s=s)
  return dict(c, tokens_per_s=out["tokens_per_s"], mfu=out["mfu"], compile_s=out["compile_s"],
              final_loss=out["final_train_loss"], devices=jax.device_count(),
              sweeps=out.get("sweeps_per_step", 1.0), groups=s.spec.num_groups,
              device_kind=jax.devices()[0].device_kind, jax=jax.__version__,
              wall_s=time.time() - t0)


def run_group(cs: list[dict], stop_at: float) -> None:
  """Runs configurations one after another in this process, one JSON line each; a failure
  (or the time budget ``stop_at``, epoch seconds) is recorded and the next one goes on."""
  _no_final_checkpoint()
  with tempfile.TemporaryDirectory() as cache:
    if any(c.get("fit") for c in cs):
      _compile_cache(cache)
    for c in cs:
      if time.time() > stop_at:
        r = dict(c, error="skipped")
      else:
        try:
          r = run_one(c)
        except Exception as e:  # one failed configuration (e.g. out of memory) is a row
          r = dict(c, error=f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
      print(json.dumps(r), flush=True)


def visible_gpus(positions: list[int]) -> str:
  """CUDA_VISIBLE_DEVICES for the GPUs at ``positions`` among those this process may use: the
  caller's CUDA_VISIBLE_DEVICES when set (``CUDA_VISIBLE_DEVICES=2,3`` runs ``data1`` on GPU 2
  and ``fsdp2`` on 2 and 3), else all GPUs in order."""
  mine = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
  if mine and max(positions) >= len(mine):
    raise SystemExit(f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']} has "
                     f"{len(mine)} GPU(s); the configuration needs {max(positions) + 1}")
  return ",".join(mine[i] if mine else str(i) for i in positions)


def _spawn(cs: list[dict], gpu: str | None, timeout: int, stop_at: float,
           kill_at: float = float("inf")) -> tuple[subprocess.Popen, float]:
  c = cs[0]
  env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
  if gpu is not None:
    env["CUDA_VISIBLE_DEVICES"] = visible_gpus([int(gpu)])
  elif c["platform"] != "cpu":
    env["CUDA_VISIBLE_DEVICES"] = visible_gpus(list(range(max(x["n"] for x in cs))))
  if c["platform"] == "cpu":
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={max(x['n'] for x in cs)}"
  else:
    xla = " ".join(x["xla"] for x in cs if x.get("xla"))
    if xla:
      env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " " + xla
    if any(x.get("fit") for x in cs):
      env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
  payload = json.dumps({"configs": cs, "stop_at": stop_at})
  p = subprocess.Popen([sys.executable, __file__, "--one", payload], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  return p, min(time.time() + timeout * len(cs), kill_at)


def _collect(p: subprocess.Popen, deadline: float, cs: list[dict]) -> list[dict]:
  try:
    out, err = p.communicate(timeout=max(1.0, deadline - time.time()))
    why = f"rc {p.returncode}"
  except subprocess.TimeoutExpired:
    p.kill()
    out, err = p.communicate()
    why = "timeout"
  got = {}
  for line in out.splitlines():
    if line.startswith("{"):
      r = json.loads(line)
      got[r["name"]] = r
    elif line.startswith("#"):
      print(line, flush=True)
  rows = []
  for c in cs:
    r = got.get(c["name"], dict(c, error=why))
    if "error" in r:
      tail = f"\n{err[-2000:]}" if r["error"] == why else ""
      print(f"# {c['name']}: {r['error']}{tail}", flush=True)
    else:
      print(f"# {c['name']}: {r['tokens_per_s']:,.0f} tokens/s on {r['devices']} x "
            f"{r['device_kind']}, batch {r['batch']}, compile {r['compile_s']:.1f}s, "
            f"{r['wall_s']:.0f}s in all, loss {_loss(r['final_loss'])}", flush=True)
    rows.append(r)
  return rows


def _loss(v) -> str:
  """A final train loss, or ``-`` when the run logged none (fewer steps than ``log_every``)."""
  return "-" if v is None else f"{v:.3f}"


def run_all(configs: list[dict], timeout: int, pair_single, budget: float,
            single_gpu: str = "0", same_process: bool = False,
            deadline: float = float("inf")) -> list[dict]:
  """Runs in the given order (up to ``pair_single`` consecutive one-GPU configurations at a
  time, one per GPU; True means 2; ``same_process``: all in one process); configurations that
  would start after ``budget`` seconds are skipped, what still runs after ``deadline``
  seconds is killed (the rows finished before are kept)."""
  width = 2 if pair_single is True else int(pair_single or 1)
  t0, results, i = time.time(), {}, 0
  gpu = configs[0]["platform"] != "cpu"
  if same_process:
    p, dl = _spawn(configs, None, timeout, t0 + budget, t0 + deadline)
    return _collect(p, dl, configs)
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
    procs = [(c, *_spawn([c], (ids[j] if gpu else None) if c["n"] == 1 else None, timeout,
                         t0 + budget, t0 + deadline)) for j, c in enumerate(group)]
    for c, p, dl in procs:
      results[c["name"]] = _collect(p, dl, [c])[0]
  return [results[c["name"]] for c in configs]


def _tokens(r: dict) -> int:
  """Distinct tokens per step (the A/B layout draws two groups of ``batch`` sequences)."""
  return r.get("groups", 1) * r["batch"] * r["seq"]


def _ms(r: dict) -> float:
  return 1e3 * _tokens(r) / r["tokens_per_s"]


def _ms_token(r: dict) -> float:
  """Milliseconds per million executed tokens (tokens through forward + backward)."""
  return 1e6 * _ms(r) / (_tokens(r) * r.get("sweeps", 1))


def _bases(rows: list[dict]) -> tuple:
  """One-GPU tokens/s by (preset, batch, seq, micro, optimizer, extra), the fastest adamw
  row by (GPUs, preset, seq, tokens per step) and the adamw row by (mesh, preset, seq, tokens
  per step, microbatches per sweep)."""
  key = lambda r: (r["preset"], r["batch"], r["seq"], r["micro"], r.get("optimizer", "adamw"),
                   str(r.get("extra", {})))
  same = lambda r: (r["axis"], r["n"], r["preset"], r["seq"], _tokens(r),
                    r["micro"] * r.get("groups", 1))
  one, fast, micro = {}, {}, {}
  for r in rows:
    if "error" in r:
      continue
    if r["axis"] == "data" and r["n"] == 1:
      one.setdefault(key(r), r["tokens_per_s"])
    if r.get("optimizer", "adamw") == "adamw" and not r.get("extra"):
      k = (r["n"], r["preset"], r["seq"], _tokens(r))
      if k not in fast or _ms(r) < _ms(fast[k]):
        fast[k] = r
      micro.setdefault(same(r), r)
  return one, fast, micro, key, same


def header(rows: list[dict]) -> str:
  """Card, device count and JAX version of the rows (one line per distinct combination)."""
  seen = sorted({(r.get("device_kind", "?"), r.get("devices", "?"), r.get("jax", "?"))
                 for r in rows if "error" not in r}, key=str)
  return "\n".join(f"card: {k}; devices in the row's process: {n}; jax {v}" for k, n, v in seen)


def cell_table(rows: list[dict], cell_tokens: int, fast: dict) -> str:
  """Time to train ``cell_tokens`` tokens (a study cell, e.g. the paper's Table 2 run of
  262,144,000): minutes of training at the row's tokens/s plus its compile, and the ratio to
  the fastest adamw row of the same GPUs, preset, seq and tokens per step."""
  out = [f"Time to a cell of {cell_tokens:,} tokens (training at the measured tokens/s, plus "
         "the compile; evaluation not included):", "",
         "| configuration | GPUs | preset | tokens/step | tokens/s | steps | minutes | "
         "vs adamw |", "|---|---|---|---|---|---|---|---|"]
  minutes = lambda r: (cell_tokens / r["tokens_per_s"] + r.get("compile_s", 0.0)) / 60
  for r in rows:
    if "error" in r:
      continue
    f = fast.get((r["n"], r["preset"], r["seq"], _tokens(r)))
    vs = f"{minutes(r) / minutes(f):.2f}x" if f else "-"
    out.append(f"| {r['name']} | {r['n']} | {r['preset']} | {_tokens(r)} | "
               f"{r['tokens_per_s']:,.0f} | {-(-cell_tokens // _tokens(r))} | {minutes(r):.1f} | "
               f"{vs} |")
  return "\n".join(out)


def table(rows: list[dict], cell_tokens: int = 0) -> str:
  one, fast, micro, key, same = _bases(rows)
  out = [header(rows), "",
         "| configuration | mesh | GPUs | preset | tokens/step | microbatches | sweeps | ms/step |"
         " tokens/s | vs one GPU | vs 1 GPU/GPU-batch | vs adamw step | vs adamw token | "
         "same micro | MFU | final train loss |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    mesh = f"{r['axis']} {r['n']}"
    m = r["micro"] * r.get("groups", 1)
    if "error" in r:
      out.append(f"| {r['name']} | {mesh} | {r['n']} | {r['preset']} | "
                 f"{r['batch'] * r['seq']} | {m} | - | - | {r['error']} | - | - | - | - | - |"
                 f" - | - |")
      continue
    b = one.get(key(r))
    rel = f"{r['tokens_per_s'] / b:.2f}x" if b else "-"
    weak = one.get(key(dict(r, batch=r["batch"] // r["n"])))
    weak = f"{r['tokens_per_s'] / weak:.2f}x" if weak and r["n"] > 1 else "-"
    f = fast.get((r["n"], r["preset"], r["seq"], _tokens(r)))
    step = f"{_ms(r) / _ms(f):.2f}x" if f else "-"
    per_tok = f"{_ms_token(r) / _ms_token(f):.2f}x" if f else "-"
    s = micro.get(same(r))
    same_tok = f"{_ms_token(r) / _ms_token(s):.2f}x" if s else "-"
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
    out.append(f"| {r['name']} | {mesh} | {r['devices']} | {r['preset']} | {_tokens(r)} | "
               f"{m} | {r.get('sweeps', 1):g} | {_ms(r):.1f} | {r['tokens_per_s']:,.0f} | "
               f"{rel} | {weak} | {step} | {per_tok} | {same_tok} | {mfu} | "
               f"{_loss(r['final_loss'])} |")
  if cell_tokens:
    out += ["", cell_table(rows, cell_tokens, fast)]
  fits = [r for r in rows if r.get("fit_rows")]
  for r in fits:
    out += ["", f"{r['name']}: largest per-GPU microbatch under {r['fit_limit'] / GIB:.2f} GiB "
            f"per device = {r['fit_per_gpu']} (compiled, not run):", fit_table(r, r["fit_rows"])]
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
  ap.add_argument("--unroll", type=int, default=0,
                  help="model scan_unroll (0: all layers, no loop)")
  ap.add_argument("--steps", type=int, default=None, help="default 30 (--quick: 6)")
  ap.add_argument("--timeout", type=int, default=240, help="seconds per configuration")
  ap.add_argument("--pair-single", action="store_true",
                  help="run one-GPU configurations two at a time, one per GPU")
  ap.add_argument("--parallel-single", type=int, default=0,
                  help="run up to K consecutive one-GPU configurations at a time, one per GPU")
  ap.add_argument("--single-gpu", default="0", help="GPU for unpaired one-GPU configurations "
                  "(a position in CUDA_VISIBLE_DEVICES when set)")
  ap.add_argument("--same-process", action="store_true",
                  help="run all configurations one after another in one process (it sees "
                  "as many GPUs as the largest configuration: give configurations of one size)")
  ap.add_argument("--fit-probe", default=None,
                  help="per-GPU microbatch sizes the fitG option compiles first (default 8,16; "
                  "--quick: 1,2)")
  ap.add_argument("--budget", type=float, default=1e9,
                  help="start no configuration after this many seconds")
  ap.add_argument("--deadline", type=float, default=float("inf"),
                  help="kill what still runs after this many seconds (finished rows are kept)")
  ap.add_argument("--cell-tokens", type=int, default=0,
                  help="also print the minutes each configuration takes to train this many "
                  "tokens (the paper's Table 2 cell: 262144000)")
  ap.add_argument("--csv", help="write the rows here")
  ap.add_argument("--jsonl", help="append the rows here (one JSON object per line)")
  ap.add_argument("--table-from", help="print one table (and --csv) of the rows of these "
                  "comma-separated JSONL files, several runs on one machine together")
  args = ap.parse_args(argv)
  if args.one:
    job = json.loads(args.one)
    run_group(job["configs"], job["stop_at"])
    return 0
  if args.table_from:
    rows = [json.loads(l) for f in args.table_from.split(",") if os.path.exists(f)
            for l in open(f) if l.strip()]
    print(table(rows, args.cell_tokens))
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
  probe = args.fit_probe or ("1,2" if args.quick else "8,16")
  try:
    probe = sorted({int(x) for x in probe.split(",")})
  except ValueError:
    probe = []
  if len(probe) < 2 or probe[0] < 1:
    ap.error(f"--fit-probe {args.fit_probe!r}: expected two or more sizes >= 1, e.g. 8,16")
  defaults = dict(preset=args.preset, batch=args.batch, seq=args.seq, micro=args.micro,
                  unroll=args.unroll, steps=args.steps, dtype=dtype, platform=platform,
                  fit_probe=probe)
  configs = [parse(n, defaults) for n in args.configs.split(",")]
  if args.quick:  # every configuration tiny (plumbing check of a GPU suite on CPU)
    for c in configs:
      c.update(preset="tiny", seq=64, unroll=1, remat=c.get("remat", "none"))
  print(f"# XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; {len(configs)} configurations, "
        f"{args.steps} steps each", flush=True)
  width = args.parallel_single or (2 if args.pair_single else 1)
  rows = run_all(configs, args.timeout, width, args.budget, args.single_gpu,
                 args.same_process, args.deadline)
  print()
  print(table(rows, args.cell_tokens))
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
