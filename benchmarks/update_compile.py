"""Lowering, compile and step times of one optimizer's update alone at gpt2-small parameter
shapes (no model: the gradients are random), to tell a slow compile from slow steps.

  PYTHONPATH=. python benchmarks/update_compile.py --optimizer soap [--steps 0]

Shapes: ``optim_step_cost.py``'s GPT-2-small stand-in (``model``: tied 50304 x 768 embedding,
1024 positions, 12 stacked layers of fused qkv 768 x 2304, 768 x 768, 768 x 3072, 3072 x 768,
norm scales). Prints each time as it finishes; ``--steps 0`` stops after the compile.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import jax
import jax.numpy as jnp

from scaleopt.optim import build

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import optim_step_cost  # noqa: E402


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--optimizer", default="soap", help="a registered optimizer name")
  ap.add_argument("--steps", type=int, default=0, help="steps to run after the compile")
  a = ap.parse_args(argv)
  tx, _ = build({"name": a.optimizer, "learning_rate": 1e-3, "schedule": {"kind": "constant"}})
  init = optim_step_cost.model(50304, 768, 12, 12, 1024)[0]
  shapes = jax.eval_shape(init, jax.random.PRNGKey(0))
  params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  keys = iter(jax.random.split(jax.random.PRNGKey(1), len(jax.tree.leaves(shapes))))
  grads = jax.tree.map(lambda s: jax.random.normal(next(keys), s.shape, s.dtype), shapes)
  state = jax.jit(tx.init)(params)
  print(f"device: {jax.devices()[0].device_kind}; optimizer {a.optimizer}", flush=True)
  t0 = time.perf_counter()
  lowered = jax.jit(tx.update).lower(grads, state, params)
  t1 = time.perf_counter()
  print(f"lower {t1 - t0:.1f} s; StableHLO {len(lowered.as_text()) / 1e6:.2f} MB", flush=True)
  step = lowered.compile()
  print(f"compile {time.perf_counter() - t1:.1f} s", flush=True)
  for i in range(a.steps):
    t = time.perf_counter()
    u, state = step(grads, state, params)
    jax.block_until_ready(u)
    print(f"step {i}: {time.perf_counter() - t:.2f} s", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
