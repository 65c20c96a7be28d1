"""Cost of the microbatch statistics + adamw_bc over the gradient passes they require.

Model: a plain-JAX GPT-2-style decoder (pre-norm RMSNorm, GELU MLP, tied embeddings, layers
under lax.scan, bf16 compute, float32 parameters); the default size is GPT-2 small
(124M parameters). Each row runs one jitted step with donated parameters and optimizer state:

* baseline(P): ``optax.adamw`` after plain gradient accumulation (lax.scan, running sum)
  over P microbatch passes;
* each adamw_bc form: ``scaleopt.optim.collect`` + ``adamw_bc`` with the same P passes
  (A/B and symmetric: P = m; LOO: two sweeps over m/2 microbatches... see ROWS).

overhead = t(form) / t(baseline with the same passes) - 1, t = median per-step wall time.

    python benchmarks/collector_overhead.py            # GPU: GPT-2 small, 8 x 16 x 1024 tokens
    python benchmarks/collector_overhead.py --quick    # CPU: small model

``--loo``: the leave-one-out implementations at a fixed number of tokens per step (default
32 x 1024): the fastest AdamW step (one microbatch), AdamW over m microbatches, and adamw_bc
LOO with two passes, one pass (``loo_passes=1``) and one pass with vmapped microbatch gradients
(``vmap_microbatches=True``); per step, per executed token (passes x tokens) and the compiled
memory of each step.

    python benchmarks/collector_overhead.py --loo            # GPU: GPT-2 small, m = 8
    python benchmarks/collector_overhead.py --loo --quick    # CPU dry run
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import scaleopt.optim as so


def init_params(key, vocab, d, layers, ff):
  ks = jax.random.split(key, 5)
  n = lambda k, shape, s: (s * jax.random.normal(k, shape)).astype(jnp.float32)
  return {
      "embed": n(ks[0], (vocab, d), 0.02),
      "layers": {
          "ln1": jnp.ones((layers, d)), "ln2": jnp.ones((layers, d)),
          "qkv": n(ks[1], (layers, d, 3 * d), 0.02),
          "proj": n(ks[2], (layers, d, d), 0.02 / np.sqrt(2 * layers)),
          "up": n(ks[3], (layers, d, ff), 0.02),
          "down": n(ks[4], (layers, ff, d), 0.02 / np.sqrt(2 * layers)),
      },
      "ln_f": jnp.ones((d,)),
  }


def rms(x, g):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6) * g).astype(x.dtype)


def make_loss(heads: int, attn_impl):
  def loss_fn(params, tokens_BxT):
    p = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    x_BxTxD = p["embed"][tokens_BxT[:, :-1]]
    B, T, D = x_BxTxD.shape

    def layer(x, lp):
      h = rms(x, lp["ln1"])
      q, k, v = jnp.split(h @ lp["qkv"], 3, axis=-1)
      sh = lambda t: t.reshape(B, T, heads, D // heads)
      a = jax.nn.dot_product_attention(sh(q), sh(k), sh(v), is_causal=True,
                                       implementation=attn_impl)
      x = x + a.reshape(B, T, D) @ lp["proj"]
      h = rms(x, lp["ln2"])
      return x + jax.nn.gelu(h @ lp["up"]) @ lp["down"], None

    x_BxTxD, _ = jax.lax.scan(jax.checkpoint(layer), x_BxTxD, p["layers"])
    logits = (rms(x_BxTxD, p["ln_f"]) @ p["embed"].T).astype(jnp.float32)
    tgt = tokens_BxT[:, 1:]
    lse = jax.nn.logsumexp(logits, -1)
    ll = jnp.take_along_axis(logits, tgt[..., None], -1)[..., 0]
    return jnp.mean(lse - ll), {}
  return loss_fn


def baseline_step(loss_fn, tx):
  vg = jax.value_and_grad(loss_fn, has_aux=True)

  def step(params, opt_state, mbs):
    def body(acc, mb):
      (l, _), g = vg(params, mb)
      return (acc[0] + l, jax.tree.map(lambda s, x: s + x.astype(jnp.float32), acc[1], g)), None
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), params)
    (loss, g), _ = jax.lax.scan(body, (0.0, zeros), mbs)
    m = jax.tree.leaves(mbs)[0].shape[0]
    g = jax.tree.map(lambda x: x / m, g)
    u, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, u), opt_state, loss / m
  return step


def bc_step(loss_fn, tx):
  def step(params, opt_state, mbs):
    stats = so.collect(loss_fn, params, mbs, opt_state)
    u, opt_state = tx.update(stats.numerator, opt_state, params, bc_stats=stats)
    return optax.apply_updates(params, u), opt_state, stats.loss
  return step


def timed(step, params, opt_state, mbs, iters) -> tuple[float, float]:
  """(median seconds per step, compiled GB: arguments + outputs + temporaries, donated outputs
  counted once; NaN where the backend reports no memory analysis), one compile."""
  f = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, mbs).compile()
  ma = f.memory_analysis()
  gb = float("nan") if ma is None else (
      ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
      + ma.temp_size_in_bytes) / 1e9
  params, opt_state, loss = f(params, opt_state, mbs)
  loss.block_until_ready()
  times = []
  for _ in range(iters):  # median of per-step times: robust to a busy shared CPU
    t0 = time.perf_counter()
    params, opt_state, loss = f(params, opt_state, mbs)
    loss.block_until_ready()
    times.append(time.perf_counter() - t0)
  return float(np.median(times)), gb


def timeit(step, params, opt_state, mbs, iters):
  return timed(step, params, opt_state, mbs, iters)[0]


# (name, adamw_bc kwargs, microbatch passes relative to m)
ROWS = [
    ("adamw_bc std (collector, no stats)", dict(mode="std"), 1),
    ("adamw_bc inv (all, Welford)", dict(mode="inv", correction="post_ema"), 1),
    ("adamw_bc cf (A/B)", dict(mode="cf", crossfit="ab"), 1),
    ("adamw_bc full (A/B, post-EMA)", dict(mode="full", crossfit="ab"), 1),
    ("adamw_bc full (A/B, pre-EMA)", dict(mode="full", crossfit="ab", correction="pre_ema"), 1),
    ("adamw_bc full (symmetric)", dict(mode="full", crossfit="symmetric"), 1),
    ("adamw_bc full (LOO, 2 sweeps)", dict(mode="full", crossfit="loo"), 2),
]


def loo_rows(cfg, loss_fn, params, iters, kw):
  """The --loo table: AdamW (m = 1, m) and adamw_bc LOO two-pass / one-pass / one-pass + vmap,
  all at cfg["seqs"] sequences of cfg["seq"] tokens per step."""
  m, seqs = cfg["m"], cfg["seqs"]
  toks = jax.random.randint(jax.random.PRNGKey(1), (seqs, cfg["seq"] + 1), 0, cfg["vocab"])
  split = lambda k: toks.reshape(k, seqs // k, cfg["seq"] + 1)
  runs = [("optax.adamw, 1 microbatch", 1, 1, None),
          (f"optax.adamw, {m} microbatches", m, 1, None),
          ("adamw_bc LOO, two passes", m, 2, dict(loo_passes=2)),
          ("adamw_bc LOO, one pass (loo_passes=1)", m, 1, dict(loo_passes=1)),
          ("adamw_bc LOO, one pass + vmap_microbatches", m, 1, dict(vmap_microbatches=True))]
  out = []
  for name, k, passes, opts in runs:
    if opts is None:
      tx, make = optax.adamw(1e-4, **kw), baseline_step
    else:
      tx = optax.chain(so.collector_options(**opts), so.adamw_bc(1e-4, **kw, mode="full",
                                                                  crossfit="loo"))
      make = bc_step
    p = jax.tree.map(jnp.copy, params)
    st = tx.init(p)
    try:  # one failing row (e.g. out of memory) must not cost the others
      t, gb = timed(make(loss_fn, tx), p, st, split(k), iters)
    except Exception as e:  # noqa: BLE001 - reported, the table marks the row
      print(f"  {name}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
      t, gb = float("nan"), float("nan")
    out.append((name, k, passes, t, gb))
    print(f"  {name}: {t * 1e3:.1f} ms/step, {gb:.2f} GB", flush=True)
  t0 = out[0][3]
  tokens = seqs * cfg["seq"]
  print()
  print(f"| step ({seqs} x {cfg['seq']} tokens) | microbatches | sweeps | ms/step | vs AdamW m=1 "
        "per step | us per executed token | vs AdamW m=1 per executed token | compiled GB |")
  print("|---|---|---|---|---|---|---|---|")
  for name, k, passes, t, gb in out:
    per = t / (passes * tokens)
    print(f"| {name} | {k} | {passes} | {t * 1e3:.1f} | {t / t0:.2f}x | {per * 1e6:.3f} | "
          f"{per / (t0 / tokens):.2f}x | {gb:.2f} |")


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="small CPU configuration")
  ap.add_argument("--iters", type=int, default=None)
  ap.add_argument("--loo", action="store_true", help="LOO implementations at fixed tokens/step")
  ap.add_argument("--seqs", type=int, default=None, help="--loo: sequences per step")
  args = ap.parse_args()
  if args.quick:
    cfg = dict(vocab=512, d=128, layers=2, ff=512, heads=4, seq=64, mb=4, m=8)
  else:
    cfg = dict(vocab=50304, d=768, layers=12, ff=3072, heads=12, seq=1024, mb=16, m=8)
  iters = args.iters or (3 if args.quick else 10)
  gpu = jax.devices()[0].platform == "gpu"
  loss_fn = make_loss(cfg["heads"], "cudnn" if gpu else "xla")
  params = init_params(jax.random.PRNGKey(0), cfg["vocab"], cfg["d"], cfg["layers"], cfg["ff"])
  n_params = sum(x.size for x in jax.tree.leaves(params))
  dev = jax.devices()[0]
  kw = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
  if args.loo:
    cfg["seqs"] = args.seqs or (8 if args.quick else 32)
    if cfg["seqs"] % cfg["m"]:
      raise SystemExit(f"--seqs={cfg['seqs']} must be a multiple of m={cfg['m']}")
    print(f"device: {dev.platform} {getattr(dev, 'device_kind', '')}; params "
          f"{n_params/1e6:.1f}M; {cfg['seqs']} x {cfg['seq']} tokens per step; m={cfg['m']}; "
          f"jax {jax.__version__}", flush=True)
    return loo_rows(cfg, loss_fn, params, iters, kw)
  print(f"device: {dev.platform} {getattr(dev, 'device_kind', '')}; params {n_params/1e6:.1f}M; "
        f"microbatch {cfg['mb']}x{cfg['seq']} tokens; m={cfg['m']}; jax {jax.__version__}")

  def mbs_for(passes):
    toks = jax.random.randint(jax.random.PRNGKey(1), (passes, cfg["mb"], cfg["seq"] + 1), 0,
                              cfg["vocab"])
    return toks

  base = {}
  for mult in sorted({r[2] for r in ROWS}):
    passes = cfg["m"] * mult
    tx = optax.adamw(1e-4, **kw)
    p = jax.tree.map(jnp.copy, params)
    base[mult] = timeit(baseline_step(loss_fn, tx), p, tx.init(p), mbs_for(passes), iters)
  rows = [("optax.adamw + plain accumulation", cfg["m"], base[1], 0.0)]
  if 2 in base:
    rows.append(("optax.adamw + plain accumulation", 2 * cfg["m"], base[2], 0.0))
  for name, bc_kw, mult in ROWS:
    tx = so.adamw_bc(1e-4, **kw, **bc_kw)
    if bc_kw.get("crossfit") == "loo":  # the two-sweep form this table times
      tx = optax.chain(so.collector_options(loo_passes=2), tx)
    p = jax.tree.map(jnp.copy, params)
    m = cfg["m"]  # LOO: m microbatches, two sweeps = 2m passes
    t = timeit(bc_step(loss_fn, tx), p, tx.init(p), mbs_for(m), iters)
    rows.append((name, cfg["m"] * mult, t, t / base[mult] - 1.0))
  print()
  print("| step | gradient passes | ms/step | overhead vs adamw, same passes |")
  print("|---|---|---|---|")
  for name, passes, t, ov in rows:
    print(f"| {name} | {passes} | {t * 1e3:.1f} | {ov * 100:+.1f}% |")


if __name__ == "__main__":
  main()
