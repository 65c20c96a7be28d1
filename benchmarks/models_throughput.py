"""Forward+backward and AdamW-step throughput / MFU of scaleopt.models vs a plain-JAX model.

  PYTHONPATH=. python benchmarks/models_throughput.py            # gpt2-small, 32 x 1024, GPU
  PYTHONPATH=. python benchmarks/models_throughput.py --quick    # tiny shapes, CPU smoke run
  ... --fused-loss    # the scaleopt rows with the fused LM head + cross-entropy

Both models have the same shapes (RMSNorm, RoPE, SwiGLU, tied embeddings, bf16 compute, fp32
parameters, fp32 logits and loss) and use ``jax.nn.dot_product_attention`` (cuDNN on GPU).
MFU = tokens/s * flops_per_token / peak, flops_per_token = 6 N + 12 L T H h (PaLM convention,
``scaleopt.models.flops_per_token``), peak = 989 TFLOP/s bf16 dense for H100 SXM and H200.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import optax

from scaleopt import models

f32, bf16 = jnp.float32, jnp.bfloat16


# ---------------------------------------------------------------------------------------------
# Plain-JAX reference (no Flax): fused QKV and gate/up kernels, scanned layers.


def ref_init(cfg: models.ModelConfig, key: jax.Array) -> dict:
  d, l, f, v = cfg.d_model, cfg.n_layers, cfg.d_ff, cfg.vocab_size
  hd = cfg.n_heads * cfg.d_head
  kvd = cfg.n_kv_heads * cfg.d_head
  ks = jax.random.split(key, 5)
  std, std_o = cfg.init_std, cfg.init_std / (2 * l) ** 0.5
  nrm = lambda k, s, sd: sd * jax.random.normal(k, s, f32)
  return dict(
      embed=nrm(ks[0], (v, d), std),
      wqkv=nrm(ks[1], (l, d, hd + 2 * kvd), std), wo=nrm(ks[2], (l, hd, d), std_o),
      wgu=nrm(ks[3], (l, d, 2 * f), std), wd=nrm(ks[4], (l, f, d), std_o),
      n1=jnp.ones((l, d), f32), n2=jnp.ones((l, d), f32), nf=jnp.ones((d,), f32))


def _rms(x, g, eps):
  x32 = x.astype(f32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * g).astype(bf16)


def _rope(x, sin, cos):
  x1, x2 = jnp.split(x.astype(f32), 2, -1)
  s, c = sin[:, None], cos[:, None]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1).astype(x.dtype)


def ref_apply(cfg: models.ModelConfig, impl: str, params: dict, tokens: jax.Array):
  b, t = tokens.shape
  h, kv, dh, eps = cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.norm_eps
  inv = cfg.rope_theta ** (-jnp.arange(0, dh, 2, dtype=f32) / dh)
  ang = jnp.arange(t, dtype=f32)[:, None] * inv
  sin, cos = jnp.sin(ang), jnp.cos(ang)
  x = params["embed"][tokens].astype(bf16)

  def layer(x, p):
    qkv = _rms(x, p["n1"], eps) @ p["wqkv"].astype(bf16)
    q, k, v = jnp.split(qkv, [h * dh, (h + kv) * dh], -1)
    q = _rope(q.reshape(b, t, h, dh), sin, cos)
    k = _rope(k.reshape(b, t, kv, dh), sin, cos)
    o = jax.nn.dot_product_attention(q, k, v.reshape(b, t, kv, dh), is_causal=True,
                                     implementation=impl)
    x = x + o.reshape(b, t, h * dh) @ p["wo"].astype(bf16)
    g, u = jnp.split(_rms(x, p["n2"], eps) @ p["wgu"].astype(bf16), 2, -1)
    return x + (jax.nn.silu(g) * u) @ p["wd"].astype(bf16), None

  layers = {k: params[k] for k in ("wqkv", "wo", "wgu", "wd", "n1", "n2")}
  x, _ = jax.lax.scan(layer, x, layers)
  logits = jnp.einsum("btd,vd->btv", _rms(x, params["nf"], eps), params["embed"].astype(bf16),
                      preferred_element_type=f32 if cfg.logits_dot_in_fp32 else bf16)
  return logits.astype(f32), {}


# ---------------------------------------------------------------------------------------------
# Timing.


def make_fns(apply_fn, head_loss_fn=None):
  """``head_loss_fn(params, inputs, targets) -> (loss, aux)`` replaces ``lm_loss(apply_fn)``
  (e.g. ``models.functional_loss(cfg)``, the fused head + cross-entropy)."""
  def loss_fn(params, tokens):
    if head_loss_fn is not None:
      return head_loss_fn(params, tokens[:, :-1], tokens[:, 1:])[0]
    logits, aux = apply_fn(params, tokens[:, :-1])
    return models.lm_loss(logits, tokens[:, 1:])

  fwd_bwd = jax.jit(jax.value_and_grad(loss_fn))
  tx = optax.adamw(3e-4, weight_decay=0.1)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return fwd_bwd, tx, step


def time_fn(run, steps: int, warmup: int) -> tuple[float, float]:
  """(compile+first-call seconds, seconds per step)."""
  t0 = time.perf_counter()
  jax.block_until_ready(run())
  first = time.perf_counter() - t0
  for _ in range(warmup):
    out = run()
  jax.block_until_ready(out)
  t0 = time.perf_counter()
  for _ in range(steps):
    out = run()
  jax.block_until_ready(out)
  return first, (time.perf_counter() - t0) / steps


def bench_model(name, init_fn, apply_fn, tokens, steps, warmup, modes, head_loss_fn=None):
  fwd_bwd, tx, step = make_fns(apply_fn, head_loss_fn)
  rows = []
  params = jax.jit(init_fn)(jax.random.key(0))
  if "fwd+bwd" in modes:
    first, dt = time_fn(lambda: fwd_bwd(params, tokens), steps, warmup)
    rows.append((name, "fwd+bwd", first, dt))
  if "adamw" in modes:
    state = {"p": params, "o": tx.init(params)}
    del params

    def run():
      state["p"], state["o"], loss = step(state["p"], state["o"], tokens)
      return loss

    first, dt = time_fn(run, steps, warmup)
    rows.append((name, "adamw step", first, dt))
  return rows


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="tiny shapes on CPU (smoke run)")
  ap.add_argument("--preset", default="gpt2-small")
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--seq", type=int, default=1024)
  ap.add_argument("--steps", type=int, default=20)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--variants", default="standard,unified",
                  help="comma-separated scale variants of the Flax model to time")
  ap.add_argument("--remat", default="none")
  ap.add_argument("--unroll", type=int, default=1, help="scan_unroll of the Flax model")
  ap.add_argument("--logits-fp32", action="store_true",
                  help="float32 LM-head dot output in both models (default: bf16 dot, then f32)")
  ap.add_argument("--no-ref", action="store_true", help="skip the plain-JAX reference")
  ap.add_argument("--fused-loss", action="store_true",
                  help="scaleopt rows use the fused head + cross-entropy (models.functional_loss)")
  ap.add_argument("--check", action="store_true", help="compare cuDNN and XLA attention logits")
  args = ap.parse_args()
  if args.quick:
    args.preset, args.batch, args.seq, args.steps, args.warmup = "tiny", 4, 64, 5, 1

  cfg = models.get_preset(args.preset).replace(max_seq_len=args.seq, remat=args.remat,
                                                  scan_unroll=args.unroll,
                                                  logits_dot_in_fp32=args.logits_fp32)
  dev = jax.devices()[0]
  kind = dev.device_kind
  peak = next((v for k, v in models.PEAK_FLOPS.items() if k in kind), None)
  t = args.seq
  tokens = jax.random.randint(jax.random.key(1), (args.batch, t + 1), 0, cfg.vocab_size)
  impl = "cudnn" if dev.platform == "gpu" else "xla"
  print(f"# device: {kind} ({dev.platform}), jax {jax.__version__}, preset {args.preset}, "
        f"logits_dot_in_fp32={args.logits_fp32}, unroll={args.unroll}, "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, "
        f"batch {args.batch} x {t}, params {models.count_params(cfg) / 1e6:.1f}M, "
        f"flops/token {models.flops_per_token(cfg, t) / 1e6:.1f}M, peak "
        f"{peak / 1e12 if peak else float('nan'):.0f} TFLOP/s")

  if args.check:
    small = tokens[:2, :t]
    init, _ = models.functional(cfg)
    p = jax.jit(init)(jax.random.key(0))
    outs = [jax.jit(models.functional(cfg.replace(attention_impl=i))[1])(p, small)[0]
            for i in ("xla", impl)]
    diff = float(jnp.abs(outs[0] - outs[1]).max())
    print(f"# check: max |logits_xla - logits_{impl}| = {diff:.3g}"
          f" (max |logits| {float(jnp.abs(outs[0]).max()):.3g})")

  rows = []
  if not args.no_ref:
    rows += bench_model("plain-JAX reference", lambda k: ref_init(cfg, k),
                        functools.partial(ref_apply, cfg, impl), tokens, args.steps,
                        args.warmup, ("fwd+bwd", "adamw"))
  for v in args.variants.split(","):
    vcfg = cfg.with_variant(v)
    init, apply = models.functional(vcfg)
    modes = ("fwd+bwd", "adamw") if v == "standard" else ("adamw",)
    fused = models.functional_loss(vcfg) if args.fused_loss else None
    rows += bench_model(f"scaleopt {v}" + (" (fused loss)" if fused else ""), init, apply,
                        tokens, args.steps, args.warmup, modes, head_loss_fn=fused)

  ntok = args.batch * t
  fpt = models.flops_per_token(cfg, t)
  print("| model | step | compile+1st (s) | ms/step | tokens/s | MFU |")
  print("|---|---|---|---|---|---|")
  for name, mode, first, dt in rows:
    tps = ntok / dt
    m = f"{100 * tps * fpt / peak:.1f}%" if peak else "n/a"
    print(f"| {name} | {mode} | {first:.1f} | {1e3 * dt:.1f} | {tps:,.0f} | {m} |")


if __name__ == "__main__":
  main()
