"""Probe: causal attention kernels available in the installed JAX, timed forward + backward.

gpt2-small's attention at the MFU benchmark's step: (B, T, H, D) = (64, 1024, 12, 64), bf16.
Prints one line per kernel: ms per forward + backward, and the max abs error of the output and
dq against XLA's float32 attention on the first 2 sequences. Not part of the package.
"""
import importlib
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp

B, T, H, D = (int(x) for x in os.environ.get("SHAPE", "64,1024,12,64").split(","))
REPS = int(os.environ.get("REPS", "20"))


def ref_attn(q, k, v):
  return jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                      v.astype(jnp.float32), is_causal=True, implementation="xla")


def _ms_per_call(f, args, warm):
  """(ms per call over REPS calls, the last output, seconds of the first call) after the
  first call and ``warm`` more."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(f(*args))
  first_s = time.perf_counter() - t0
  for _ in range(warm):
    jax.block_until_ready(f(*args))
  t0 = time.perf_counter()
  for _ in range(REPS):
    out = f(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / REPS * 1e3, out, first_s


def timed(name, attn):
  key = jax.random.PRNGKey(0)
  kq, kk, kv, kd = jax.random.split(key, 4)
  q, k, v, do = (jax.random.normal(kx, (B, T, H, D), jnp.bfloat16) for kx in (kq, kk, kv, kd))

  def loss(q, k, v):
    return jnp.sum(attn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  try:
    ms, out, compile_s = _ms_per_call(step, (q, k, v), warm=3)
    fwd_ms, o, _ = _ms_per_call(jax.jit(attn), (q, k, v), warm=0)
    s = slice(0, 2)
    o_ref = ref_attn(q[s], k[s], v[s])
    err_o = float(jnp.max(jnp.abs(o[s].astype(jnp.float32) - o_ref)))
    g_ref = jax.grad(lambda q: jnp.sum(ref_attn(q, k[s], v[s]) * do[s].astype(jnp.float32)))(
        q[s].astype(jnp.float32))
    err_dq = float(jnp.max(jnp.abs(out[1][0][s].astype(jnp.float32) - g_ref)))
    # useful (causal) FLOPs: forward 2 matmuls x 2 flops x T^2/2 x D, backward 2.5x forward
    flops = 3.5 * 4 * B * H * T * T * D / 2
    print(f"{name:32s} fwd+bwd {ms:8.2f} ms  fwd {fwd_ms:7.2f} ms  "
          f"{flops / ms / 1e9:6.1f} TFLOP/s (causal)  compile {compile_s:5.1f} s  "
          f"err_o {err_o:.2e} err_dq {err_dq:.2e}", flush=True)
  except Exception as e:  # noqa: BLE001
    msg = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()
    print(f"{name:32s} FAILED: {' | '.join(msg)[:400]}", flush=True)


def main():
  print("jax", jax.__version__, jax.devices()[0].device_kind, (B, T, H, D), flush=True)
  import jax.experimental.pallas.ops.gpu as ops
  print("ops/gpu:", sorted(os.listdir(os.path.dirname(ops.__file__))), flush=True)
  scale = D ** -0.5
  timed("cudnn", lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="cudnn"))
  timed("xla bf16", lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="xla"))
  try:
    from jax.experimental.pallas.ops.gpu import attention as tri
    for bq, bk in ((128, 64), (64, 64), (128, 128)):
      bs = tri.BlockSizes(block_q=bq, block_k=bk, block_q_dkv=bk, block_kv_dkv=bq,
                          block_q_dq=bq, block_kv_dq=bk)
      timed(f"pallas triton {bq}x{bk}", lambda q, k, v, bs=bs: tri.mha(
          q, k, v, None, sm_scale=scale, causal=True, block_sizes=bs))
  except Exception as e:  # noqa: BLE001
    print("triton mha import failed:", e)
  try:
    mg = importlib.import_module("jax.experimental.pallas.ops.gpu.attention_mgpu")
    fields = mg.TuningConfig.__dataclass_fields__
    print("attention_mgpu TuningConfig fields:", list(fields), flush=True)
    for bq, bkv, wgs in ((64, 64, 2), (128, 64, 2), (64, 128, 2)):
      kw = dict(block_q=bq, block_kv=bkv, max_concurrent_steps=2, causal=True)
      if "compute_wgs_bwd" in fields:
        kw.update(compute_wgs_bwd=wgs, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64,
                  block_kv_dq=64)
      cfg = mg.TuningConfig(**kw)
      # Its kernels stage tiles in float16 shared memory, so the inputs go in as float16.
      f16 = lambda x: x.astype(jnp.float16)
      timed(f"mgpu {bq}x{bkv} (float16 in)", lambda q, k, v, cfg=cfg: mg.attention(
          f16(q * scale), f16(k), f16(v), cfg).astype(jnp.bfloat16))
  except Exception as e:  # noqa: BLE001
    print("attention_mgpu:", type(e).__name__, e, flush=True)
  for mod in ("jax.experimental.pallas.ops.gpu.splash_attention",
              "jax.experimental.pallas.ops.gpu.splash_attention.hopper_splash_attention"):
    try:
      m = importlib.import_module(mod)
      print(mod, "has", [n for n in dir(m) if not n.startswith("_")], flush=True)
    except Exception as e:  # noqa: BLE001
      print(mod, "missing:", type(e).__name__, e, flush=True)


if __name__ == "__main__":
  sys.exit(main())
