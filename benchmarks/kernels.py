"""Per-op times of today's kernels and tokamax's, forward + backward, at the models' shapes.

  PYTHONPATH=. python benchmarks/kernels.py [--shapes gpt2-small,qwen2.5-0.5b] \
      [--jsonl OUT.jsonl] [--reps 20]
  PYTHONPATH=. python benchmarks/kernels.py --quick        # tiny shapes, CPU (XLA forms only)

One process, one card: every row of a shape is timed in the same process as its baseline
(the first row of each op, today's path). Ops (bfloat16, gradients of a fixed random
cotangent with respect to every input):

* ``attention``: causal attention ``[B, T, heads, d_head]``: ``cudnn`` (today's ``auto`` on
  GPU), ``tokamax_mosaic``, ``tokamax_triton`` (``model.attention_impl``).
* ``glu``: ``silu(n W_gate) * (n W_up)`` on ``[B T, d]``: ``xla`` (today: one matmul on the
  concatenated kernels, then the split and the product), ``tokamax_mosaic``,
  ``tokamax_triton`` (``model.glu_kernel``).
* ``norm``: residual add + RMS norm: ``pallas`` (today's ``auto`` on GPU), ``xla``,
  ``tokamax_triton`` (``model.norm_kernel``).
* ``loss``: LM head + mean cross-entropy: ``pallas`` (today's fused head with the Pallas rows),
  ``xla`` (the fused head in XLA), ``tokamax_xla`` (tokamax's
  ``linear_softmax_cross_entropy_loss``; tokamax has no GPU kernel for it, only its XLA
  reference and a TPU one).

Shapes: gpt2-small at 64 x 1024 tokens; qwen2.5-0.5b at 16 x 1024 (its microbatch of 8 at the
paper's step is the same op at half the rows). Each row is printed and appended to --jsonl as
it finishes (a row that fails records its error's first line); a markdown table ends the run.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import re
import time

import jax
import jax.numpy as jnp

from scaleopt import models
from scaleopt.models import kernels, layers, loss, tokamax_ops

SHAPES = {"gpt2-small": 64, "qwen2.5-0.5b": 16}  # sequences of 1024 tokens


def time_call(fn, args, reps: int) -> float:
  """Mean milliseconds of ``fn(*args)`` over ``reps`` calls after a compile and two warm-ups."""
  for _ in range(3):
    jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  for _ in range(reps):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / reps * 1e3


def fwd_bwd(f):
  """jit of (f(*args), the cotangents of every input for a cotangent of ones)."""
  def g(*args):
    out, pull = jax.vjp(f, *args)
    return out, pull(jax.tree.map(jnp.ones_like, out))
  return jax.jit(g)


def _normal(key, shape, dtype, scale=1.0):
  return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def attention_cases(cfg, b, t, dt):
  k = jax.random.split(jax.random.key(0), 3)
  q = _normal(k[0], (b, t, cfg.n_heads, cfg.d_head), dt)
  kv = [_normal(x, (b, t, cfg.n_kv_heads, cfg.d_head), dt) for x in k[1:]]
  impls = ["cudnn", "tokamax_mosaic", "tokamax_triton"] if _gpu() else ["xla", "tokamax_xla"]
  return [(i, functools.partial(layers.causal_attention, impl=i, strict=True), (q, *kv))
          for i in impls]


def glu_cases(cfg, b, t, dt):
  k = jax.random.split(jax.random.key(1), 3)
  x = _normal(k[0], (b * t, cfg.d_model), dt)
  wg, wu = (_normal(y, (cfg.d_model, cfg.d_ff), dt, 0.02) for y in k[1:])

  def xla(x, wg, wu):  # as layers.GatedMLP: one matmul on the concatenated kernels
    g, u = jnp.split(x @ jnp.concatenate([wg, wu], axis=-1), 2, axis=-1)
    return jax.nn.silu(g) * u

  def tk(setting):
    return lambda x, wg, wu: tokamax_ops.gated_linear_unit(x[None], wg, wu, setting)[0]

  impls = ["tokamax_mosaic", "tokamax_triton"] if _gpu() else ["tokamax_xla"]
  return [("xla", xla, (x, wg, wu))] + [(i, tk(i), (x, wg, wu)) for i in impls]


def norm_cases(cfg, b, t, dt):
  k = jax.random.split(jax.random.key(2), 2)
  x, h = (_normal(y, (b, t, cfg.d_model), dt) for y in k)
  eps = cfg.norm_eps
  f = lambda kernel: (lambda x, h: layers.add_rms_norm(x, h, eps, kernel))
  impls = [("pallas", True), ("xla", False), ("tokamax_triton", "tokamax_triton")]
  if not _gpu():
    impls = [("xla", False), ("tokamax_xla", "tokamax_xla")]
  return [(name, f(kernel), (x, h)) for name, kernel in impls]


def loss_cases(cfg, b, t, dt):
  k = jax.random.split(jax.random.key(3), 3)
  h = _normal(k[0], (b, t, cfg.d_model), dt)
  w = _normal(k[1], (cfg.d_model, cfg.vocab_size), dt, 0.02)
  y = jax.random.randint(k[2], (b, t), 0, cfg.vocab_size)
  ours = lambda kernel: (lambda h, w: loss.head_loss(h, w, y, kernel=kernel))

  def tk(h, w):
    import tokamax  # pylint: disable=import-outside-toplevel
    tokamax_ops._tokamax()  # noqa: SLF001 -- its flags marked parsed
    return tokamax.linear_softmax_cross_entropy_loss(
        h.reshape(-1, h.shape[-1]), y.reshape(-1), w, reduction="mean", implementation="xla")

  cases = [("pallas", ours(True), (h, w))] if _gpu() else []
  return cases + [("xla", ours(False), (h, w)), ("tokamax_xla", tk, (h, w))]


OPS = {"attention": attention_cases, "glu": glu_cases, "norm": norm_cases, "loss": loss_cases}


def _gpu() -> bool:
  return jax.default_backend() == "gpu"


def run(shapes: list[str], reps: int, jsonl: str | None, quick: bool) -> list[dict]:
  rows = []
  dt = jnp.bfloat16
  for name in shapes:
    cfg = models.get_preset(name)
    b, t = SHAPES[name], 1024
    if quick:
      name, cfg, b, t = "tiny", models.get_preset("tiny"), 2, 64
    for op, cases in OPS.items():
      for impl, f, args in cases(cfg, b, t, dt):
        row = dict(shape=name, tokens=b * t, op=op, impl=impl, device=jax.devices()[0].device_kind,
                   jax=jax.__version__, tokamax=_version())
        try:
          row["ms"] = time_call(fwd_bwd(f), args, reps)
        except Exception as e:  # noqa: BLE001 -- a kernel that cannot run is a row
          row["error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
        if jsonl:
          with open(jsonl, "a") as fh:
            fh.write(json.dumps(row) + "\n")
  return rows


def _version() -> str | None:
  try:
    import tokamax  # pylint: disable=import-outside-toplevel
    return tokamax.__version__
  except ImportError:
    return None


def table(rows: list[dict]) -> str:
  """Markdown: ms per op forward + backward and the ratio to the op's first row (today's
  path) of the same shape."""
  out = ["| shape | op | implementation | fwd+bwd ms | vs today's |", "|---|---|---|---|---|"]
  base = {}
  for r in rows:
    key = (r["shape"], r["op"])
    if key not in base and "ms" in r:
      base[key] = r["ms"]
    ms = f"{r['ms']:.3f}" if "ms" in r else r.get("error", "")[:80]
    ratio = f"{base[key] / r['ms']:.2f}x" if "ms" in r and key in base else "-"
    out.append(f"| {r['shape']} | {r['op']} | {r['impl']} | {ms} | {ratio} |")
  return "\n".join(out)


# op -> the model key that picks its implementation (the loss has no tokamax setting)
KEYS = {"attention": "attention_impl", "glu": "glu_kernel", "norm": "norm_kernel"}


def _test_outcomes(junit: str) -> tuple[list[tuple[str, str]] | None, bool]:
  """``(outcomes, from_log)``: (test name, passed | failure | error | skipped) per test of a
  pytest JUnit XML file, or, when pytest was stopped before writing it whole, of the ``-v`` log
  ``tests.log`` beside it (a test's last line counts: a pass then an error in its teardown is
  an error); outcomes None when neither can be read."""
  import xml.etree.ElementTree as ET  # pylint: disable=import-outside-toplevel
  try:
    out = []
    for case in ET.parse(junit).getroot().iter("testcase"):
      kind = next((k for k in ("failure", "error", "skipped") if case.find(k) is not None),
                  "passed")
      out.append((case.get("name", ""), kind))
    return out, False
  except (OSError, ET.ParseError):
    pass
  words = {"PASSED": "passed", "FAILED": "failure", "ERROR": "error", "SKIPPED": "skipped"}
  try:
    text = (pathlib.Path(junit).parent / "tests.log").read_text()
  except OSError:
    return None, True
  found = re.findall(r"::(test_\w+(?:\[[^\]]*\])?) (PASSED|FAILED|ERROR|SKIPPED)", text)
  last = {name: words[w] for name, w in found}
  return list(last.items()) or None, True


def failed_settings(junit: str | None) -> set[tuple[str, str]]:
  """(op, setting) pairs with a failed (or, in bfloat16, skipped) GPU equality test, or with
  no passed bfloat16 test against today's path, in a pytest JUnit XML file (or the ``-v`` log
  beside it, ``_test_outcomes``; tests/models/test_kernels_gpu.py: test_<op>_kernel_*
  [..setting..], and the model's tests with ``op=implementation`` in their ids); none without
  ``junit`` (tests not run), every tokamax setting when neither file can be read."""
  if not junit:
    return set()
  settings = {(op, s) for op in KEYS for s in tokamax_ops.ATTENTION + tokamax_ops.GLU}
  cases, _ = _test_outcomes(junit)
  if cases is None:
    return settings
  bad, passed = set(), set()
  for name, kind in cases:
    kinds = ("failure", "error") + (() if "float32" in name else ("skipped",))
    if kind in kinds:  # a kernel declining float32 may run bf16
      bad |= {(op, s) for op, s in settings
              if (name.startswith(f"test_{op}_kernel") and s in name)
              or (name.startswith("test_model_with_kernels")
                  and f"{op}={tokamax_ops.implementation(s)}" in name)}
    elif kind == "passed":
      passed |= {(op, s) for op, s in settings
                 if name.startswith(f"test_{op}_kernel_matches_today") and s in name}
  return bad | (settings - passed)  # a setting whose tests did not run counts as failed


def choose(rows: list[dict], shape: str, bad: set[tuple[str, str]]) -> dict[str, str]:
  """Per op, the fastest setting at ``shape`` whose equality tests passed, where it is faster
  than today's (the op's first row): ``{model key: setting}``."""
  out = {}
  for op, key in KEYS.items():
    timed = [r for r in rows if r["shape"] == shape and r["op"] == op and "ms" in r]
    if not timed:
      continue
    today = timed[0]
    ok = [r for r in timed[1:] if r["impl"].startswith(tokamax_ops.PREFIX)
          and (op, r["impl"]) not in bad]
    best = min(ok, key=lambda r: r["ms"], default=None)
    if best is not None and best["ms"] < today["ms"]:
      out[key] = best["impl"]
  return out


def _jsonl(path) -> list[dict]:
  try:
    return [json.loads(l) for l in open(path) if l.strip()]
  except OSError:
    return []


def tests_line(junit) -> str:
  """``N passed, N failed, N skipped`` of a pytest JUnit XML file (or the ``-v`` log beside it,
  marked ``(from the log: pytest stopped)``)."""
  cases, from_log = _test_outcomes(junit)
  if cases is None:
    return "not run"
  n = {k: sum(kind == k for _, kind in cases) for k in ("passed", "failure", "error", "skipped")}
  line = f"{n['passed']} passed, {n['failure'] + n['error']} failed, {n['skipped']} skipped"
  return line + (" (from the log: pytest stopped)" if from_log else "")


def steps_table(rows: list[dict]) -> str:
  """Markdown: the whole-step rows of benchmarks/mesh_throughput.py JSONL files, each against
  the first row of its file with today's kernels and the same optimizer (the same process)."""
  out = ["| part | optimizer | tokens/step (microbatches) | kernels | ms/step | tokens/s | MFU | "
         "vs today's |", "|---|---|---|---|---|---|---|---|"]
  base = {}
  for r in rows:
    extra = r.get("extra", {})
    opt = r.get("optimizer", "adamw") + "".join(f" {k}={v}" for k, v in extra.items())
    kern = ", ".join(f"{k}={v}" for k, v in r.get("model", {}).items()) or "today's"
    key = (r["part"], opt)
    tokens = f"{r['batch'] * r['seq']:,} ({r['micro']})"
    if "error" in r:
      out.append(f"| {r['part']} | {opt} | {tokens} | {kern} | {r['error'][:80]} | - | - | - |")
      continue
    if kern == "today's":
      base.setdefault(key, r["tokens_per_s"])
    vs = f"{r['tokens_per_s'] / base[key]:.3f}x" if key in base else "-"
    ms = 1e3 * r["batch"] * r["seq"] / r["tokens_per_s"]
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
    out.append(f"| {r['part']} | {opt} | {tokens} | {kern} | {ms:.1f} | "
               f"{r['tokens_per_s']:,.0f} | {mfu} | {vs} |")
  return "\n".join(out)


def report(folder: str) -> str:
  """The call's tables (lab/gpu/kernels_call.sh's $OUT): card and versions, the equality
  tests, per-op times, whole steps (each row's part: its own ``part``, else its file's name)."""
  import pathlib  # pylint: disable=import-outside-toplevel
  d = pathlib.Path(folder)
  ops = _jsonl(d / "ops.jsonl")
  steps = [{"part": f.stem, **r} for f in sorted(d.glob("*.jsonl")) if f.name != "ops.jsonl"
           for r in _jsonl(f)]
  first = (ops or steps or [{}])[0]
  head = (f"card: {first.get('device', first.get('device_kind', '?'))}; jax "
          f"{first.get('jax', '?')}; tokamax {first.get('tokamax', '?')}; GPU equality tests: "
          f"{tests_line(d / 'tests.xml')}")
  return "\n\n".join([head, table(ops), steps_table(steps)])


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--choose", metavar="OPS_JSONL", help="print the mesh_throughput.py model "
                  "options (+mKEY=VALUE...) of the fastest passing setting per op at --shapes' "
                  "first shape, from rows this script wrote (nothing: today's path)")
  ap.add_argument("--junit", help="with --choose: the GPU equality tests' JUnit XML")
  ap.add_argument("--single", action="store_true", help="with --choose: one configuration "
                  "option string per chosen op, comma-separated, instead of their combination")
  ap.add_argument("--report", metavar="DIR", help="print the tables of a kernels_call.sh "
                  "output folder and exit")
  ap.add_argument("--shapes", default="gpt2-small,qwen2.5-0.5b")
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--jsonl", help="append each row here as it finishes")
  ap.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
  args = ap.parse_args(argv)
  if args.report:
    print(report(args.report))
    return 0
  shapes = args.shapes.split(",")
  for s in shapes:
    if s not in SHAPES:
      ap.error(f"--shapes: unknown shape {s!r}; choose from {tuple(SHAPES)}")
  if args.choose:
    try:
      rows = [json.loads(l) for l in open(args.choose) if l.strip()]
    except OSError:
      rows = []
    chosen = choose(rows, shapes[0], failed_settings(args.junit))
    opts = [f"+m{k}={v}" for k, v in chosen.items()]
    print(",".join(opts) if args.single else "".join(opts))
    return 0
  rows = run(shapes[:1] if args.quick else shapes, 2 if args.quick else args.reps,
             args.jsonl, args.quick)
  print()
  print(table(rows))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
