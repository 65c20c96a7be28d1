"""Amortized train-step time of Shampoo and Sophia (std and BC) relative to AdamW.

A GPT-2-small-shaped stand-in (pure JAX: tied 50304 x 768 embedding, 1024 positions, 12 scanned
layers with fused qkv 768 x 2304, 768 x 768 output, 768 x 3072 / 3072 x 768 MLP, bf16 compute,
float32 parameters and optimizer state), batch 32 x 1024 tokens per step as 4 microbatches of
8 sequences (BC forms with rolling-B get 4 more microbatches as group B). Every optimizer goes
through ``build`` + ``collect`` inside one jitted step, exactly as the trainer runs it.
Each step is timed individually (block_until_ready) over ``--steps`` steps after two warm-up
steps; roots (Shampoo) / Hessian refreshes (Sophia) / bases (SOAP) every 10 steps, so the mean
is the amortized cost. The first call (compile + step 0, which builds Shampoo's first roots and
SOAP's first eigenbases) and step 1 are timed apart and printed as they finish; ``--aot`` runs
the ahead-of-time executable instead (compile timed apart from step 0; such executables of
steps with cuDNN attention can fail on a GPU where the jitted call runs).

  python benchmarks/optim_step_cost.py            # GPU
  python benchmarks/optim_step_cost.py --quick    # tiny model on CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "--quick" in sys.argv:  # CPU: OpenBLAS may deadlock on concurrent large eigh calls
  os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax
import jax.numpy as jnp
import numpy as np
import optax

from scaleopt.optim import build, collect

# The Shampoo rows keep the form of the recorded tables (eigh roots, float32 matmuls; Newton
# at float32) unless named otherwise; "shampoo_default" is the optimizer's defaults.
F32 = dict(matmul_precision="highest", stats_precision="highest")
CONFIGS = {
    "adamw": dict(name="adamw"),
    "shampoo": dict(name="shampoo", extra=dict(block_size=1024, root_every=10,
                                               root_method="eigh", **F32)),
    "shampoo_newton": dict(name="shampoo", extra=dict(block_size=1024, root_every=10,
                                                      root_method="newton",
                                                      newton_precision="highest", **F32)),
    "shampoo_b512": dict(name="shampoo", extra=dict(block_size=512, root_every=10,
                                                    root_method="eigh", **F32)),
    "shampoo_default": dict(name="shampoo", extra=dict(root_every=10)),
    # the defaults with float32 Newton iterations (the default is TF32 Newton roots)
    "shampoo_f32_roots": dict(name="shampoo", extra=dict(root_every=10,
                                                         newton_precision="highest")),
    "shampoo_bc_cf": dict(name="shampoo_bc", extra=dict(block_size=1024, root_every=10,
                                                        mode="cf", rolling_b=True,
                                                        root_method="eigh", **F32)),
    "shampoo_bc": dict(name="shampoo_bc", extra=dict(block_size=1024, root_every=10,
                                                     mode="full", rolling_b=True, **F32)),
    "sophia": dict(name="sophia", extra=dict(k=10)),
    "sophia_bc": dict(name="sophia_bc", extra=dict(k=10, mode="full", rolling_b=True)),
    # SOAP: the paper's form (bases every 10 steps, float32 rotations); SOAP-BC: leave-one-out
    # over the 4 microbatches with the Jensen correction
    "soap": dict(name="soap"),
    "soap_high": dict(name="soap", extra=dict(matmul_precision="high")),
    # Shampoo's blocks of 512: eigh / QR of 512 x 512 blocks instead of up to 3072 x 3072
    "soap_b512": dict(name="soap", extra=dict(block_size=512)),
    "soap_bc": dict(name="soap_bc"),
    # not in the default run: cross-fitting alone (no Jensen term), and AdamW's leave-one-out
    # forms beside them
    "soap_bc_cf": dict(name="soap_bc", extra=dict(mode="cf")),
    "adamw_bc": dict(name="adamw_bc", extra=dict(mode="full", crossfit="loo")),
    "adamw_bc_cf": dict(name="adamw_bc", extra=dict(mode="cf", crossfit="loo")),
}

EXTRA = ("soap_bc_cf", "adamw_bc", "adamw_bc_cf")  # by name only (--configs)


def model(vocab, d, layers, heads, seq):
  """Init and (logits_fn, loss_fn) of a GPT-2-shaped decoder (pre-norm, no biases)."""

  def init(key):
    ks = jax.random.split(key, 6)
    n = lambda k, s, std=0.02: std * jax.random.normal(k, s, jnp.float32)
    return {"wte": n(ks[0], (vocab, d)), "wpe": n(ks[1], (seq, d)),
            "blocks": {"ln1": jnp.ones((layers, d)), "ln2": jnp.ones((layers, d)),
                       "qkv": n(ks[2], (layers, d, 3 * d)), "proj": n(ks[3], (layers, d, d)),
                       "fc": n(ks[4], (layers, d, 4 * d)), "out": n(ks[5], (layers, 4 * d, d))},
            "lnf": jnp.ones((d,))}

  def norm(x, g):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * g).astype(
        jnp.bfloat16)

  def logits_fn(p, mb):
    tok = mb["tokens"]
    b, t = tok.shape
    bf = lambda x: x.astype(jnp.bfloat16)
    x = bf(p["wte"][tok] + p["wpe"][:t])

    def layer(x, w):
      h = norm(x, w["ln1"])
      q, k, v = jnp.split(h @ bf(w["qkv"]), 3, axis=-1)
      sh = lambda z: z.reshape(b, t, heads, d // heads)
      a = jax.nn.dot_product_attention(sh(q), sh(k), sh(v), is_causal=True).reshape(b, t, d)
      x = x + a @ bf(w["proj"])
      h = norm(x, w["ln2"])
      return x + jax.nn.gelu(h @ bf(w["fc"])) @ bf(w["out"]), None

    x, _ = jax.lax.scan(jax.checkpoint(layer), x, p["blocks"])
    logits = (norm(x, p["lnf"]) @ bf(p["wte"]).T).astype(jnp.float32)
    return logits, mb["mask"]

  def loss_fn(p, mb):
    logits, mask = logits_fn(p, mb)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), mb["targets"][..., None], -1)[..., 0]
    return (nll * mask).sum() / mask.sum(), {}

  return init, logits_fn, loss_fn


def bench(name, cfg, params, loss_fn, logits_fn, mbs, b_mbs, steps, print_steps=False,
          aot=False):
  cfg = dict(cfg, learning_rate=1e-4, schedule={"kind": "constant"})
  tx, spec = build(cfg)
  st = jax.jit(tx.init)(params)
  b = b_mbs if spec.layout == "rolling_b" else None

  @jax.jit
  def step(p, st, key):
    stats = collect(loss_fn, p, mbs, st, key=key, logits_fn=logits_fn, b_microbatches=b)
    u, st = tx.update(stats.numerator, st, p, bc_stats=stats)
    return optax.apply_updates(p, u), st, stats.loss

  def timed(what, fn):  # printed as it finishes: a call that runs out of time still tells
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(out)
    dt = time.perf_counter() - t0
    print(f"  {name}: {what} {dt:.2f} s", flush=True)
    return out, dt

  key0 = jax.random.PRNGKey(0)
  if aot:  # the ahead-of-time executable: compile and step 0 timed apart
    step, compile_s = timed("compile", lambda: step.lower(params, st, key0).compile())
    (p, st, loss), first_s = timed("step 0 (first root / basis step)",
                                   lambda: step(params, st, key0))
  else:  # the jitted call, as the trainer runs its steps: it compiles at its first call
    (p, st, loss), first_s = timed("compile + step 0 (first root / basis step)",
                                   lambda: step(params, st, key0))
    compile_s = None
  (p, st, loss), _ = timed("step 1", lambda: step(p, st, jax.random.PRNGKey(1)))
  # align so that the timed window holds exactly steps/10 root steps: start at count 10
  for i in range(8):
    if print_steps:  # one line per step: a step that hangs is named
      (p, st, loss), _ = timed(f"step {2 + i}", lambda: step(p, st, jax.random.PRNGKey(2 + i)))
    else:
      p, st, loss = step(p, st, jax.random.PRNGKey(2 + i))
  jax.block_until_ready(loss)
  times = []
  for i in range(steps):
    t0 = time.perf_counter()
    p, st, loss = step(p, st, jax.random.PRNGKey(100 + i))
    jax.block_until_ready(loss)
    times.append(time.perf_counter() - t0)
    if print_steps:
      print(f"  {name}: step {10 + i} {times[-1]:.3f} s", flush=True)
  times = np.array(times)
  root = times[::10]
  other = np.delete(times, np.arange(0, steps, 10))
  return dict(name=name, mean_ms=1e3 * times.mean(), root_ms=1e3 * root.mean(),
              other_ms=1e3 * other.mean(), aot=aot, compile_s=compile_s,
              first_step_s=first_s,  # with aot=False: compile + step 0
              loss=float(loss))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="tiny model for CPU")
  ap.add_argument("--steps", type=int, default=100)
  ap.add_argument("--configs", default=",".join(k for k in CONFIGS if k not in EXTRA))
  ap.add_argument("--json", default=None, help="write results here")
  ap.add_argument("--print-steps", action="store_true",
                  help="print every step's time as it finishes (find a step that hangs)")
  ap.add_argument("--aot", action="store_true",
                  help="run the ahead-of-time executable (compile timed apart from step 0) "
                       "instead of the jitted call")
  args = ap.parse_args()
  if args.quick:
    vocab, d, layers, heads, seq, mb_seqs, m = 512, 64, 2, 4, 64, 2, 4
    args.steps = min(args.steps, 20)
  else:
    vocab, d, layers, heads, seq, mb_seqs, m = 50304, 768, 12, 12, 1024, 8, 4
  init, logits_fn, loss_fn = model(vocab, d, layers, heads, seq)
  params = jax.jit(init)(jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  mk = lambda: {"tokens": jnp.asarray(rng.integers(0, vocab, (m, mb_seqs, seq)), jnp.int32),
                "targets": jnp.asarray(rng.integers(0, vocab, (m, mb_seqs, seq)), jnp.int32),
                "mask": jnp.ones((m, mb_seqs, seq), jnp.float32)}
  mbs, b_mbs = mk(), mk()
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind} ({dev.platform}); params "
        f"{sum(x.size for x in jax.tree.leaves(params)) / 1e6:.1f}M; tokens/step "
        f"{m * mb_seqs * seq}; steps {args.steps}", flush=True)
  results = []
  for name in args.configs.split(","):
    try:
      r = bench(name, CONFIGS[name], params, loss_fn, logits_fn, mbs, b_mbs, args.steps,
                args.print_steps, args.aot)
    except Exception as e:  # keep going: one failing config must not hide the others
      print(f"{name}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    results.append(r)
    base = next((x["mean_ms"] for x in results if x["name"] == "adamw"), None)
    rel = f"{r['mean_ms'] / base:.3f}x" if base else "-"
    print(f"{name:16s} amortized {r['mean_ms']:8.2f} ms  ({rel} adamw)  root/refresh step "
          f"{r['root_ms']:8.2f} ms  other {r['other_ms']:8.2f} ms  "
          + (f"compile {r['compile_s']:.0f} s  step 0 {r['first_step_s']:.1f} s" if args.aot
             else f"compile + step 0 {r['first_step_s']:.0f} s"),
          flush=True)
  base = next((x["mean_ms"] for x in results if x["name"] == "adamw"), None)
  print("\n| optimizer | amortized ms/step | vs adamw | root/refresh step ms | other steps ms | "
        "last step's loss |")
  print("|---|---|---|---|---|---|")
  for r in results:
    rel = f"{r['mean_ms'] / base:.2f}x" if base else "-"
    print(f"| {r['name']} | {r['mean_ms']:.1f} | {rel} | {r['root_ms']:.1f} | "
          f"{r['other_ms']:.1f} | {r['loss']:.3f} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(device=dev.device_kind, results=results), f, indent=1)


if __name__ == "__main__":
  main()
