"""The fused loss's row work: the Pallas kernel against XLA's passes, on the LM head's logits.

  PYTHONPATH=. python benchmarks/loss_kernel.py [--tokens 32768,65536 --vocab 50304 --reps 20]
  PYTHONPATH=. python benchmarks/loss_kernel.py --quick     # small shapes (CPU: interpreter)

For bf16 h ``[N, d]`` and W ``[d, V]``, each row is timed on the logits z = h W of the same
jitted function (the matmul is in every row, so the kernel writes d over z as it does in
training):

* ``xla``: lse and nll (two reductions over z), then d = softmax - onehot (one pass that
  writes d): what ``model.loss_kernel: xla`` computes, forward and backward together;
* ``pallas bB lL wW``: :func:`scaleopt.models.kernels.xent_rows` with blocks of B columns as
  L lanes and W warps (the default is marked; one lane: a block-wide max and sum per load);
* ``matmul``: z alone (its time is in every row);
* ``head + loss fwd+bwd``: ``jax.grad`` of ``loss.head_loss`` in h and W, XLA against the
  kernel (the training step's whole head and loss).

Errors against float64 numpy on the first 64 rows, max abs over the rows of nll and over every
coordinate of d. Baseline in the same run: ``xla``.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

sys.path.insert(0, os.path.dirname(__file__))
from loss_lse import time_ms  # noqa: E402  (the benchmarks' timer)

from scaleopt.models import kernels, loss  # noqa: E402

f32 = jnp.float32
# (columns per load, lanes, warps); one lane: a block-wide max and sum per load
CONFIGS = ((2048, 16, 8), (2048, 16, 4), (1024, 8, 4), (4096, 32, 8), (8192, 64, 16),
           (8192, 1, 16))


def _xla_rows(z, y):
  lse, nll = loss._lse_nll(z, y)
  return nll, loss._dlogits(z, lse, y, jnp.ones_like(lse))


def _errors(nll, d, z, y):
  zf, yy = np.asarray(z[:64], np.float64), np.asarray(y[:64])
  m = zf.max(-1, keepdims=True)
  lse = np.log(np.exp(zf - m).sum(-1)) + m[:, 0]
  p = np.exp(zf - lse[:, None])
  p[np.arange(len(yy)), yy] -= 1.0
  e_nll = np.abs(np.asarray(nll[:64], np.float64) - (lse - zf[np.arange(len(yy)), yy])).max()
  return e_nll, np.abs(np.asarray(d[:64], np.float64) - p).max()


def run(n, v, d, reps, interpret, configs):
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
  h = jax.random.normal(k1, (n, d), f32).astype(jnp.bfloat16)
  w = (jax.random.normal(k2, (d, v), f32) * 0.1).astype(jnp.bfloat16)
  y = jax.random.randint(k3, (n,), 0, v)
  z = h @ w
  rows = [("matmul", jax.jit(lambda h, w, y: h @ w))]
  rows.append(("xla", jax.jit(lambda h, w, y: _xla_rows(h @ w, y))))
  default = (min(kernels.BLOCK, pl.next_power_of_2(v)), kernels.LANES, kernels.NUM_WARPS)
  for b, ln, nw in dict.fromkeys((min(b, pl.next_power_of_2(v)), ln, nw)
                                 for b, ln, nw in configs):
    mark = " (default)" if (b, ln, nw) == default else ""
    rows.append((f"pallas b{b} l{ln} w{nw}{mark}", jax.jit(
        lambda h, w, y, b=b, ln=ln, nw=nw: kernels.xent_rows(
            h @ w, y, block=b, lanes=ln, num_warps=nw, interpret=interpret))))
  out = []
  for name, fn in rows:
    ms = time_ms(fn, h, w, y, reps=reps)
    err = "" if name == "matmul" else "%.1e / %.1e" % _errors(*fn(h, w, y), z, y)
    out.append([name, ms, err])
    print(f"  {name}: {ms:.3f} ms", flush=True)
  base = out[0][1]
  table = [f"| N={n} V={v} | ms | ms beyond the matmul | error nll / d vs float64 |",
           "|---|---|---|---|"]
  table += [f"| {a} | {ms:.3f} | {ms - base:.3f} | {e} |" for a, ms, e in out]
  h3, y3 = h[None], y[None]
  for name, kern in (("xla", False), ("pallas", True)):
    g = jax.jit(jax.grad(lambda h, w, k=kern: loss.head_loss(h, w, y3, kernel=k),
                         argnums=(0, 1)))
    table.append(f"| head + loss fwd+bwd, {name} | {time_ms(g, h3, w, reps=reps):.3f} | | |")
  return table


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--tokens", default="32768,65536")
  ap.add_argument("--vocab", type=int, default=50304)
  ap.add_argument("--d", type=int, default=768)
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--quick", action="store_true")
  a = ap.parse_args(argv)
  configs = list(CONFIGS)
  if a.quick:
    a.tokens, a.vocab, a.d, a.reps = "64", 1000, 32, 2
    configs = [(256, 16, 4), (1024, 8, 8), (1024, 1, 8)]
  dev = jax.devices()[0]
  interpret = dev.platform != "gpu"
  print(f"# {dev.device_kind} ({dev.platform}), jax {jax.__version__}, V={a.vocab} d={a.d}, "
        f"bf16, {a.reps} reps" + (" (Pallas interpreter)" if interpret else ""))
  for n in (int(t) for t in a.tokens.split(",")):
    print("\n".join(run(n, a.vocab, a.d, a.reps, interpret, configs)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
