"""run.deterministic on a GPU: are two runs bitwise equal, and what does the switch cost?

  PYTHONPATH=. python benchmarks/determinism.py --out DIR [--steps 16] [--optimizers adamw,loo]
      [--nondet-runs 1] [--deadline UNIX_SECONDS] [--config configs/train/gpt2-small.yaml]
      [--shape paper|config] [--data PATH] [--set KEY=VALUE ...] [--no-probe]
      [--det-attention tokamax_mosaic]

Trains each optimizer (``adamw``: the paper's AdamW baseline; ``loo``: one-pass LOO with the
Jensen term, the bc_paper_gpt2 study's ``loo`` arm) with ``scaleopt train`` in fresh
processes, one process per pass over the optimizers: ``run.deterministic=true`` twice and
``false`` ``--nondet-runs`` times, interleaved (det, nondet, det, ...), so that each
deterministic pair crosses a process boundary (another compile, another autotuning). Where the
deterministic runs resolved to other kernels than the first ``false`` run (on a GPU attention
``auto`` is XLA's under the switch and cuDNN's without), one more ``false`` process
(``nondet_same``) runs with the deterministic runs' kernels set explicitly, so that the cost
is given both against the same kernels without the switch and against the fastest ``false``
run. Every
value of every ``metrics.jsonl`` row except the timing columns is compared bit for bit
(IEEE-754 float64 bits of the JSON numbers, which hold the float32 values exactly), and the
deterministic runs' ``state_sha256`` (a digest of the final parameters and optimizer state).
ms/step: the trainer's own training time over the steps after the first quarter.

``--det-attention IMPL``: the deterministic runs set ``model.attention_impl=IMPL``, an attention
the trainer refuses under the switch until it is shown run-to-run equal (tokamax's
``tokamax_mosaic``: its Hopper backward computes dQ and dK/dV in separate kernels, each output
tile summed in a fixed order without atomics, and its block sizes come from tokamax's shipped
table or heuristics, not from timing). This benchmark lifts that refusal in its own processes:
it is the check that decides whether the trainer may allow it.

``--shape paper``: the paper's step on gpt2-small (512 x 1024 tokens as 64 microbatches of 8,
vocabulary 32,768, weight decay 0.1 on every parameter, clip 1.0, cosine with 20 warm-up steps
over the study's 500), as configs/studies/bc_paper_gpt2.yaml; ``config``: the config as given
(CPU tests use a tiny one). Data: the embedded corpus, or ``--data`` (a prepared shard folder).

Before training, each process times nothing and checks a few single operations for run-to-run
equality (``--no-probe`` skips it): cuDNN attention forward + backward, the embedding gradient
(a scatter-add), a large matmul, each run five times on the same inputs; the result says which
operations vary without the switch.

Writes DIR/determinism.md (the table), DIR/determinism.json (everything), DIR/runs/*/ (each
run's folder) and DIR/logs/*.log. Exit code 0 when every deterministic pair is bitwise equal.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import struct
import subprocess
import sys
import time

TIMING = {"tokens_per_s", "wall_s", "train_s", "timed_steps", "mfu"}
# summary.json's ``kernels`` entry -> the model setting that chooses it
KERNEL_SETTINGS = {"attention": "model.attention_impl", "loss": "model.loss_kernel",
                   "norm": "model.norm_kernel", "glu": "model.glu_kernel"}
PAPER_STEP = [
    "data.seq_len=1024", "data.batch_size=512", "data.microbatches=64", "model.vocab_size=32768",
    "model.wd_policy=all", "optimizer.weight_decay=0.1", "optimizer.clip_norm=1.0",
    "optimizer.schedule.kind=cosine", "optimizer.schedule.warmup_steps=20",
    "optimizer.schedule.min_lr_ratio=0.0", "optimizer.schedule.total_steps=500"]
OPTIMIZERS = {  # "core": the optimizer; "paper": its learning rate and schedule in the study
    "adamw": {"core": ["optimizer.name=adamw"], "paper": ["optimizer.learning_rate=6.0e-4"]},
    "loo": {"core": ["optimizer.name=adamw_bc",
                     "optimizer.extra={mode: full, crossfit: loo, sparse_lr_ratio: 0.6666667}"],
            "paper": ["optimizer.learning_rate=9.0e-4", "optimizer.schedule.min_lr_ratio=0.2"]},
}


def run_overrides(args, opt: str, deterministic: bool) -> list[str]:
  """The ``--set`` list of one run."""
  out = list(OPTIMIZERS[opt]["core"])
  if args.shape == "paper":
    out += PAPER_STEP + OPTIMIZERS[opt]["paper"]
  if args.data:
    out += ["data.source=shards", f"data.path={args.data}"]
  out += [f"run.steps={args.steps}", "run.log_every=1", "run.eval_tokens=0",
          "run.checkpoint_every=0", "run.keep_checkpoints=1", "run.progress=false",
          "run.tensorboard=false", "run.plot=false", "run.telemetry_every=0",
          f"run.deterministic={'true' if deterministic else 'false'}", *args.set]
  if deterministic and args.det_attention:
    out.append(f"model.attention_impl={args.det_attention}")
  return out


def allow_attention(determinism, impl: str) -> None:
  """Lets ``model.attention_impl=impl`` run under the switch in this process (``--det-attention``):
  ``determinism.model_config`` passes it through unchanged."""
  refuse = determinism.model_config

  def model_config(cfg, deterministic, platform):
    return cfg if cfg.attention_impl == impl else refuse(cfg, deterministic, platform)

  determinism.model_config = model_config


# ------------------------------------------------------------------------------------------
# The worker: one process, one pass over the optimizers.


def probe(reps: int = 5, attention: str | None = None) -> dict:
  """Single operations run ``reps`` times on the same inputs: how many distinct results
  (``attention``: also that ``model.attention_impl``'s forward + backward)."""
  import hashlib

  import jax
  import jax.numpy as jnp
  import numpy as np

  def digest(x):
    return hashlib.sha256(b"".join(np.asarray(jax.device_get(l)).tobytes()
                                   for l in jax.tree.leaves(x))).hexdigest()

  k = jax.random.split(jax.random.PRNGKey(0), 6)
  gpu = jax.default_backend() == "gpu"
  B, T, H, D, V, d = (8, 1024, 12, 64, 32768, 768) if gpu else (1, 128, 2, 64, 512, 64)
  M = 8192 if gpu else 256
  q, kk, v, do = (jax.random.normal(k[i], (B, T, H, D), jnp.bfloat16) for i in range(4))
  tokens = jax.random.randint(k[4], (B, T), 0, min(V, 2048))
  emb = jax.random.normal(k[5], (V, d), jnp.float32)
  g = jax.random.normal(k[0], (B, T, d), jnp.bfloat16)
  a = jax.random.normal(k[1], (M, 4 * d), jnp.bfloat16)
  b = jax.random.normal(k[2], (4 * d, d), jnp.bfloat16)
  impl = "cudnn" if gpu else "xla"

  def attn(q, kk, v, do):
    o = jax.nn.dot_product_attention(q, kk, v, is_causal=True, implementation=impl)
    return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

  def embed(e, tokens, g):
    return jnp.sum(jnp.take(e, tokens, axis=0).astype(jnp.bfloat16) * g).astype(jnp.float32)

  # every input an argument: constants would be folded at compile time
  cases = {
      f"attention fwd+bwd ({impl})": (jax.jit(jax.grad(attn, argnums=(0, 1, 2))),
                                       (q, kk, v, do)),
      "embedding gradient (scatter-add)": (jax.jit(jax.grad(embed)), (emb, tokens, g)),
      f"matmul bf16 {M}x{4 * d}x{d}": (jax.jit(lambda a, b: a @ b), (a, b)),
  }
  if attention:
    from scaleopt.models import tokamax_ops

    def other(q, kk, v, do):
      o = tokamax_ops.attention(q, kk, v, attention)
      return jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32))

    cases[f"attention fwd+bwd ({attention})"] = (jax.jit(jax.grad(other, argnums=(0, 1, 2))),
                                                  (q, kk, v, do))
  out = {}
  for name, (f, xs) in cases.items():
    try:
      out[name] = len({digest(f(*xs)) for _ in range(reps)})
    except Exception as e:  # noqa: BLE001 -- reported, the runs go on
      out[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
  return out


def worker(args) -> int:
  from scaleopt.train import checkpoint, determinism, mesh
  mesh.set_launch_xla_flags()  # what `scaleopt train` sets, before the probe starts the backend
  determinism.prepare(args.deterministic)
  if args.deterministic and args.det_attention:
    allow_attention(determinism, args.det_attention)
  checkpoint.Checkpointer.save = lambda self, *a, **k: None  # no final checkpoint write
  from scaleopt import cli
  rec = {"deterministic": args.deterministic, "xla_flags": os.environ.get("XLA_FLAGS", "")}
  if not args.no_probe:
    rec["probe"] = probe(attention=args.det_attention)
    print("probe:", json.dumps(rec["probe"]), flush=True)
  rec["runs"] = {}
  for opt in args.optimizers.split(","):
    if args.deadline and time.time() > args.deadline - 30:
      print(f"deadline: {opt} not run", flush=True)
      break
    out = pathlib.Path(args.out) / "runs" / f"{opt}_{args.tag}"
    argv = ["train", "--config", args.config, "--out", str(out)]
    for o in run_overrides(args, opt, args.deterministic):
      argv += ["--set", o]
    t0 = time.time()
    rc = cli.main(argv)
    rec["runs"][opt] = {"rc": rc, "dir": str(out), "seconds": time.time() - t0}
    print(f"{opt} {args.tag}: rc {rc} in {time.time() - t0:.0f} s", flush=True)
  (pathlib.Path(args.out) / f"worker_{args.tag}.json").write_text(json.dumps(rec, indent=1))
  return 0


# ------------------------------------------------------------------------------------------
# The parent: launch the workers, compare, tabulate.


def bits(v) -> bytes:
  if isinstance(v, float):
    return struct.pack("<d", v)
  return json.dumps(v).encode()


def read_run(d: pathlib.Path) -> dict:
  rows = [json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines() if l.strip()] \
      if (d / "metrics.jsonl").is_file() else []
  summ = json.loads((d / "summary.json").read_text()) if (d / "summary.json").is_file() else {}
  return {"rows": rows, "summary": summ}


def compare(a: dict, b: dict) -> dict:
  """Every non-timing value of two runs' metrics rows, bit for bit, and their state digests."""
  n = diff = 0
  first = None
  ra = {r["step"]: r for r in a["rows"]}
  rb = {r["step"]: r for r in b["rows"]}
  for step in sorted(set(ra) | set(rb)):
    x, y = ra.get(step, {}), rb.get(step, {})
    for key in sorted((set(x) | set(y)) - TIMING):
      n += 1
      if key not in x or key not in y or bits(x[key]) != bits(y[key]):
        diff += 1
        if first is None:
          first = {"step": step, "key": key, "a": x.get(key), "b": y.get(key)}
  sa, sb = a["summary"].get("state_sha256"), b["summary"].get("state_sha256")
  return {"values": n, "differ": diff, "first": first, "steps": len(set(ra) | set(rb)),
          "state_equal": None if sa is None or sb is None else sa == sb}


def ms_per_step(rows: list[dict]) -> float | None:
  """The trainer's training time per step over the rows after the first quarter."""
  rows = [r for r in rows if r.get("timed_steps")]
  if len(rows) < 2:
    return None
  a, b = rows[len(rows) // 4], rows[-1]
  n = b["timed_steps"] - a["timed_steps"]
  return 1e3 * (b["train_s"] - a["train_s"]) / n if n > 0 else None


def launch(args, tag: str, deterministic: bool, log: pathlib.Path, extra=()) -> int:
  cmd = [sys.executable, __file__, "--worker", "--tag", tag, "--out", args.out,
         "--steps", str(args.steps), "--optimizers", args.optimizers, "--config", args.config,
         "--shape", args.shape, "--deadline", str(args.deadline or 0)]
  cmd += ["--deterministic"] if deterministic else []
  cmd += ["--no-probe"] if args.no_probe else []
  cmd += ["--data", args.data] if args.data else []
  cmd += ["--det-attention", args.det_attention] if args.det_attention else []
  for s in [*args.set, *extra]:
    cmd += ["--set", s]
  timeout = max(30, args.deadline - time.time()) if args.deadline else None
  with open(log, "w") as f:
    try:
      return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
      return 124


def kernels_key(kernels) -> str:
  return json.dumps(kernels or {}, sort_keys=True)


def same_kernels(det_kernels, nondet_kernels) -> list[str]:
  """The ``--set`` list that gives a run without the switch the deterministic run's kernels
  (empty where the two already agree or either is unknown)."""
  if not det_kernels or not nondet_kernels:
    return []
  return [f"{KERNEL_SETTINGS[k]}={v}" for k, v in sorted(det_kernels.items())
          if k in KERNEL_SETTINGS and v != "none" and v != nondet_kernels.get(k)]


def ratios(runs: list[dict]) -> None:
  """Adds to each run ``vs_same`` (ms/step over the mean of the ``false`` runs with the same
  kernels - 1; deterministic runs) and ``vs_fastest`` (over the fastest kernel set's mean
  ``false`` ms/step - 1; every run with other kernels or the switch)."""
  groups = {}
  for r in runs:
    if not r["deterministic"] and r["ms_per_step"]:
      groups.setdefault(kernels_key(r["kernels"]), []).append(r["ms_per_step"])
  means = {k: sum(v) / len(v) for k, v in groups.items()}
  fastest = min(means, key=means.get) if means else None
  for r in runs:
    ms, key = r["ms_per_step"], kernels_key(r["kernels"])
    r["vs_same"] = ms / means[key] - 1 if ms and r["deterministic"] and key in means else None
    r["vs_fastest"] = (ms / means[fastest] - 1 if ms and fastest and
                       (r["deterministic"] or key != fastest) else None)


def _pct(x) -> str:
  return "-" if x is None else f"{x:+.1%}"


def table(res: dict, device: str) -> str:
  lines = [f"Device: {device}. {res['steps']} steps per run; ms/step over the steps after the "
           "first quarter (the trainer's training time); attention: the kernel the run ran "
           "(summary.json's `kernels`); `vs false, same kernels`: against the runs without the "
           "switch that ran the same kernels; `vs fastest false`: against the fastest kernels "
           "without the switch; `equal`: every non-timing value of every metrics row, bit for "
           "bit, against the first run of the same setting and kernels (another process); the "
           "state digest is recorded by deterministic runs.", "",
           "| optimizer | deterministic | run | attention | ms/step | vs `false`, same kernels | "
           "vs fastest `false` | compile s | values compared | bitwise equal to the setting's "
           "first run | state digest equal |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for opt, o in res["optimizers"].items():
    for r in o["runs"]:
      c = r.get("vs_first") or {}
      ms = r["ms_per_step"]
      eq = "-" if not c else ("yes" if c["differ"] == 0 else
                              f"no: {c['differ']} differ, first step {c['first']['step']} "
                              f"`{c['first']['key']}`")
      st = "-" if c.get("state_equal") is None else ("yes" if c["state_equal"] else "no")
      attention = (r.get("kernels") or {}).get("attention", "?")
      timing = (f"{ms:.1f} | {_pct(r.get('vs_same'))} | {_pct(r.get('vs_fastest'))} | "
                f"{r['compile_s'] or 0:.0f}" if ms else "- | - | - | -")
      lines.append(f"| {opt} | {str(r['deterministic']).lower()} | {r['tag']} | {attention} | "
                   f"{timing} | {c.get('values', '-')} | {eq} | {st} |")
  probes = res.get("probes") or {}
  if probes:
    lines += ["", "Single operations, five calls on the same inputs in each process: distinct "
              "results (1 = run-to-run equal).", "",
              "| operation | " + " | ".join(probes) + " |", "|---" * (len(probes) + 1) + "|"]
    names = sorted({k for p in probes.values() for k in p})
    for n in names:
      lines.append(f"| {n} | " + " | ".join(str(p.get(n, "-")) for p in probes.values()) + " |")
  return "\n".join(lines) + "\n"


def first_kernels(out: pathlib.Path, tag: str, optimizers: list[str]):
  """summary.json's ``kernels`` of the first optimizer's run in process ``tag`` (None if none
  finished)."""
  for opt in optimizers:
    k = read_run(out / "runs" / f"{opt}_{tag}")["summary"].get("kernels")
    if k:
      return k
  return None


def make_plan(nondet_runs: int) -> list[list]:
  """[tag, deterministic, extra --set list] in launch order."""
  plan = [["det1", True, []]]
  for i in range(max(nondet_runs, 0)):
    plan.append([f"nondet{i + 1}", False, []])
    if i == 0:
      plan.append(["det2", True, []])
  if nondet_runs <= 0:
    plan.append(["det2", True, []])
  return plan


def run_plan(args, out: pathlib.Path, optimizers: list[str]) -> tuple[list, dict]:
  """Launches the plan's processes while the deadline allows; after det1 and nondet1 adds
  ``nondet_same`` (fourth) where their kernels differ. Returns the plan and exit codes."""
  plan = make_plan(args.nondet_runs)
  rcs, longest, i = {}, 45.0, 0
  while i < len(plan):
    tag, d, extra = plan[i]
    # det1, nondet1 and det2 (the check and the cost) start while a minute is left; a further
    # run only where the longest process so far fits
    need = 60.0 if i < 3 else longest
    if args.deadline and time.time() + need > args.deadline:
      print(f"deadline: {tag} not started (a process took up to {longest:.0f} s)", flush=True)
    else:
      t0 = time.time()
      rcs[tag] = launch(args, tag, d, out / "logs" / f"{tag}.log", extra)
      longest = max(longest, time.time() - t0)
      print(f"{tag}: exit {rcs[tag]} in {time.time() - t0:.0f} s", flush=True)
    if {"det1", "nondet1"} <= set(rcs) and not any(p[0] == "nondet_same" for p in plan):
      sets = same_kernels(first_kernels(out, "det1", optimizers),
                          first_kernels(out, "nondet1", optimizers))
      if sets:
        plan.insert(max(i + 1, 3), ["nondet_same", False, sets])
    i += 1
  return plan, rcs


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--out", required=True)
  p.add_argument("--steps", type=int, default=16)
  p.add_argument("--optimizers", default="adamw,loo")
  p.add_argument("--nondet-runs", type=int, default=1)
  p.add_argument("--deadline", type=float, default=0.0, help="unix time to stop starting runs")
  p.add_argument("--config", default="configs/train/gpt2-small.yaml")
  p.add_argument("--shape", choices=("paper", "config"), default="paper")
  p.add_argument("--data", default=None)
  p.add_argument("--set", action="append", default=[])
  p.add_argument("--no-probe", action="store_true")
  p.add_argument("--det-attention", default=None,
                 help="the deterministic runs' model.attention_impl (see the module docstring)")
  p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  p.add_argument("--tag", default="", help=argparse.SUPPRESS)
  p.add_argument("--deterministic", action="store_true", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.worker:
    return worker(args)
  out = pathlib.Path(args.out)
  (out / "logs").mkdir(parents=True, exist_ok=True)
  optimizers = args.optimizers.split(",")
  plan, rcs = run_plan(args, out, optimizers)
  res = {"steps": args.steps, "plan": plan, "exit": rcs, "optimizers": {}, "probes": {}}
  device = "?"
  for tag, _, _ in plan:
    w = out / f"worker_{tag}.json"
    if w.is_file():
      rec = json.loads(w.read_text())
      if "probe" in rec:
        res["probes"][tag] = rec["probe"]
      res.setdefault("xla_flags", {})[tag] = rec["xla_flags"]
  ok = True
  for opt in optimizers:
    runs, first = [], {}
    for tag, d, extra in plan:
      run = read_run(out / "runs" / f"{opt}_{tag}")
      if not run["rows"]:
        continue
      prov = run["summary"].get("provenance") or {}
      device = prov.get("device_kind", device)
      kernels = run["summary"].get("kernels")
      r = {"tag": tag, "deterministic": d, "sets": extra, "kernels": kernels,
           "ms_per_step": ms_per_step(run["rows"]), "compile_s": run["summary"].get("compile_s"),
           "final_train_loss": run["summary"].get("final_train_loss"),
           "state_sha256": run["summary"].get("state_sha256"), "provenance": prov}
      setting = (d, kernels_key(kernels))
      if setting in first:  # against the first run of the same setting and kernels
        r["vs_first"] = compare(first[setting], run)
      else:
        first[setting] = run
      runs.append(r)
    ratios(runs)
    dets = [r for r in runs if r["deterministic"]]
    ok &= len(dets) >= 2 and all(r.get("vs_first", {}).get("differ", 1) == 0 and
                                 r["vs_first"].get("state_equal") for r in dets[1:])
    res["optimizers"][opt] = {"runs": runs}
  res["all_deterministic_pairs_equal"] = ok
  (out / "determinism.json").write_text(json.dumps(res, indent=1, default=str))
  md = table(res, device)
  (out / "determinism.md").write_text(md)
  print(md)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
