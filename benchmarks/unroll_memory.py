"""Compiled memory of the layer scan at each unroll: temporaries of ``jit(grad(loss))``.

  PYTHONPATH=. python benchmarks/unroll_memory.py [--layers 8 --unrolls 1,2,4,0]

A gpt2-small-like model scaled down (d_model 256, 4 heads, d_ff 1024, vocab 4096, XLA
attention, float32 parameters, bf16 compute), 4 sequences of 512 tokens; ``--unrolls`` are
``scan_unroll`` values (0: every layer unrolled). Compiles only (no step runs), on whatever
backend JAX picks; prints one row per unroll with the compiler's temporary and argument bytes.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

from scaleopt.models import functional, functional_loss, get_preset


def temporaries(layers: int, unroll: int, batch: int = 4, seq: int = 512) -> tuple[float, float]:
  """(temporary MiB, argument MiB) of the compiled gradient at ``scan_unroll=unroll``."""
  cfg = get_preset("gpt2-small").replace(n_layers=layers, d_model=256, n_heads=4, n_kv_heads=4,
                                         d_ff=1024, vocab_size=4096, scan_unroll=unroll,
                                         attention_impl="xla")
  init, _ = functional(cfg)
  loss = functional_loss(cfg)
  params = jax.eval_shape(init, jax.random.key(0))
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  grad = jax.jit(jax.grad(lambda p, t: loss(p, t, t)[0]))
  m = grad.lower(params, tokens).compile().memory_analysis()
  return m.temp_size_in_bytes / 2**20, m.argument_size_in_bytes / 2**20


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--unrolls", default="1,2,4,0", help="comma-separated scan_unroll values")
  args = ap.parse_args(argv)
  try:
    unrolls = [int(u) for u in args.unrolls.split(",")]
  except ValueError:
    print(f"unroll_memory: --unrolls={args.unrolls!r}: expected integers, e.g. 1,2,4,0",
          file=sys.stderr)
    return 2
  print(f"# {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
        f"{args.layers} layers")
  print("| scan_unroll | layers per loop iteration | temporaries MiB | arguments MiB |")
  print("|---|---|---|---|")
  for u in unrolls:
    try:
      temp, arg = temporaries(args.layers, u)
    except ValueError as e:
      print(f"unroll_memory: {e}", file=sys.stderr)
      return 2
    print(f"| {u} | {u or args.layers} | {temp:,.1f} | {arg:,.1f} |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
