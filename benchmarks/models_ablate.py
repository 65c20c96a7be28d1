"""Where does a GPT-2-small fwd+bwd step spend its time? Ablations of the plain-JAX reference.

  PYTHONPATH=. python benchmarks/models_ablate.py [--quick]

Times jit(value_and_grad(loss)) for variants of ``models_throughput.ref_apply`` (head in fp32 or
bf16, no head, chunked head+loss, XLA attention) and a bare matmul at the MLP shape, so that
optimizations of ``scaleopt.models`` are chosen from measurements.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import models_throughput as mt  # noqa: E402

from scaleopt import models  # noqa: E402

f32, bf16 = jnp.float32, jnp.bfloat16


def trunk(cfg, impl, params, tokens):
  """Reference model up to the final norm (hidden states, bf16)."""
  p = dict(params)
  b, t = tokens.shape
  h, kv, dh, eps = cfg.n_heads, cfg.n_kv_heads, cfg.d_head, cfg.norm_eps
  inv = cfg.rope_theta ** (-jnp.arange(0, dh, 2, dtype=f32) / dh)
  ang = jnp.arange(t, dtype=f32)[:, None] * inv
  sin, cos = jnp.sin(ang), jnp.cos(ang)
  x = p["embed"][tokens].astype(bf16)

  def layer(x, q):
    qkv = mt._rms(x, q["n1"], eps) @ q["wqkv"].astype(bf16)
    qq, k, v = jnp.split(qkv, [h * dh, (h + kv) * dh], -1)
    qq = mt._rope(qq.reshape(b, t, h, dh), sin, cos)
    k = mt._rope(k.reshape(b, t, kv, dh), sin, cos)
    o = jax.nn.dot_product_attention(qq, k, v.reshape(b, t, kv, dh), is_causal=True,
                                     implementation=impl)
    x = x + o.reshape(b, t, h * dh) @ q["wo"].astype(bf16)
    g, u = jnp.split(mt._rms(x, q["n2"], eps) @ q["wgu"].astype(bf16), 2, -1)
    return x + (jax.nn.silu(g) * u) @ q["wd"].astype(bf16), None

  layers = {k: p[k] for k in ("wqkv", "wo", "wgu", "wd", "n1", "n2")}
  x, _ = jax.lax.scan(layer, x, layers)
  return mt._rms(x, p["nf"], eps)


def loss_variant(cfg, impl, head, params, tokens):
  inp, tgt = tokens[:, :-1], tokens[:, 1:]
  x = trunk(cfg, impl, params, inp)
  w = params["embed"].astype(bf16)
  if head == "none":
    return jnp.mean(jnp.square(x.astype(f32)))
  if head in ("f32", "bf16"):
    z = jnp.einsum("btd,vd->btv", x, w, preferred_element_type=f32 if head == "f32" else bf16)
    return models.lm_loss(z, tgt)
  if head.startswith("chunk"):  # scan over token chunks, recompute logits in the backward
    n = int(head[5:])
    xs = x.reshape(-1, n, x.shape[-1])
    ts = tgt.reshape(-1, n)

    @jax.checkpoint
    def chunk(xc, tc):
      z = jnp.einsum("nd,vd->nv", xc, w, preferred_element_type=f32)
      return jnp.sum(jax.nn.logsumexp(z, -1) - jnp.take_along_axis(z, tc[:, None], -1)[:, 0])

    tot, _ = jax.lax.scan(lambda c, a: (c + chunk(*a), None), jnp.zeros((), f32), (xs, ts))
    return tot / tgt.size
  raise ValueError(head)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--steps", type=int, default=10)
  args = ap.parse_args()
  name, b, t = ("tiny", 4, 64) if args.quick else ("gpt2-small", 32, 1024)
  cfg = models.get_preset(name)
  gpu = jax.devices()[0].platform == "gpu"
  impl = "cudnn" if gpu else "xla"
  print(f"# {jax.devices()[0].device_kind}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  params = mt.ref_init(cfg, jax.random.key(0))
  tokens = jax.random.randint(jax.random.key(1), (b, t + 1), 0, cfg.vocab_size)
  chunk = "chunk" + str(min(b * t, 4096))
  for head, att in (("f32", impl), ("bf16", impl), ("none", impl), (chunk, impl),
                    ("none", "xla")):
    f = jax.jit(jax.value_and_grad(functools.partial(loss_variant, cfg, att, head)))
    first, dt = mt.time_fn(lambda: f(params, tokens), args.steps, 2)
    print(f"| head={head:10s} attn={att:6s} | {1e3 * dt:7.1f} ms | {b * t / dt:10,.0f} tok/s |")
  m, k, n = b * t, cfg.d_model, 2 * cfg.d_ff
  xa = jnp.ones((m, k), bf16)
  wa = jnp.ones((k, n), bf16)
  mm = jax.jit(lambda x, w: x @ w)
  _, dt = mt.time_fn(lambda: mm(xa, wa), 20, 2)
  tflops = 2 * m * k * n / dt / 1e12
  print(f"| matmul {m}x{k}x{n} bf16 | {1e3 * dt:7.3f} ms | {tflops:.0f} TFLOP/s |")


if __name__ == "__main__":
  main()
