"""The residual add + RMS norm: the Pallas kernels against XLA's passes, forward and backward.

  PYTHONPATH=. python benchmarks/norm_kernel.py [--tokens 65536 --d 768,896 --reps 50]
  PYTHONPATH=. python benchmarks/norm_kernel.py --quick     # small shapes (CPU: interpreter)

For bf16 x, h ``[N, d]`` (the residual stream and a branch output) each row times one jitted
function of ``layers.add_rms_norm`` (s = x + h, n = Norm(s)):

* ``fwd``: (s, n), what the forward pass computes;
* ``fwd+bwd``: the cotangent of x for random cotangents of s and n (``jax.vjp``), the forward
  and backward work of one add + norm in training;

``xla`` is ``model.norm_kernel: xla`` (the baseline in the same run), ``pallas rR wW`` the
kernels with R rows per program and W warps (the default is marked). ``ideal`` is the bytes
the kernels must move (fwd: read x, h, write s, n; bwd: read g_s, g_n, s, write g) over
``--gbps``. Errors against float64 numpy on the first 64 rows, max abs over every coordinate
of n and of the cotangent.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from loss_lse import time_ms  # noqa: E402  (the benchmarks' timer)

from scaleopt.models import kernels, layers  # noqa: E402

f32 = jnp.float32
CONFIGS = ((4, 4), (1, 1), (1, 2), (2, 2), (4, 8), (8, 4), (8, 8), (16, 8))  # (rows, warps)


def _reference(x, h, gs, gn, eps):
  """(n, cotangent of x) in float64 numpy, from s = bf16(x + h) as stored."""
  s = np.asarray((x.astype(f32) + h.astype(f32)).astype(x.dtype), np.float64)
  r = 1.0 / np.sqrt((s * s).mean(-1, keepdims=True) + eps)
  gs, gn = np.asarray(gs, np.float64), np.asarray(gn, np.float64)
  return s * r, gs + r * gn - s * r ** 3 * (gn * s).mean(-1, keepdims=True)


def _fns(kernel, eps, rows=kernels.ROWS, warps=kernels.NORM_WARPS):
  if kernel:
    fwd_k = functools.partial(kernels.add_rms_norm_fwd, eps=eps, rows=rows, num_warps=warps,
                              interpret=kernels.interpret())
    bwd_k = functools.partial(kernels.add_rms_norm_bwd, rows=rows, num_warps=warps,
                              interpret=kernels.interpret())
    fwd = jax.jit(lambda x, h: fwd_k(x, h)[:2])

    def both(x, h, gs, gn):
      s, n, r = fwd_k(x, h)
      return n, bwd_k(gs, gn, s, r)
  else:
    fwd = jax.jit(lambda x, h: layers.add_rms_norm(x, h, eps))

    def both(x, h, gs, gn):
      (s, n), vjp = jax.vjp(lambda x: layers.add_rms_norm(x, h, eps), x)
      return n, vjp((gs, gn))[0]
  return fwd, jax.jit(both)


def run(n, d, reps, gbps, configs, eps=1e-5):
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  x, h, gs, gn = (jax.random.normal(k, (n, d), f32).astype(jnp.bfloat16) for k in ks)
  rows = [("xla", False, None)]
  for r, w in configs:
    mark = " (default)" if (r, w) == (kernels.ROWS, kernels.NORM_WARPS) else ""
    rows.append((f"pallas r{r} w{w}{mark}", True, (r, w)))
  ref_n, ref_g = _reference(x[:64], h[:64], gs[:64], gn[:64], eps)
  table = [f"| N={n} d={d} bf16 | fwd ms | fwd+bwd ms | error n / g vs float64 |",
           "|---|---|---|---|"]
  for name, kernel, cfg in rows:
    fwd, both = _fns(kernel, eps, *(cfg or ()))
    t_f, t_b = time_ms(fwd, x, h, reps=reps), time_ms(both, x, h, gs, gn, reps=reps)
    out_n, out_g = both(x, h, gs, gn)
    e_n = np.abs(np.asarray(out_n[:64], np.float64) - ref_n).max()
    e_g = np.abs(np.asarray(out_g[:64], np.float64) - ref_g).max()
    table.append(f"| {name} | {t_f:.3f} | {t_b:.3f} | {e_n:.1e} / {e_g:.1e} |")
    print(f"  {table[-1]}", flush=True)
  row_bytes = n * d * 2
  table.append(f"| ideal at {gbps:.0f} GB/s | {4 * row_bytes / gbps / 1e6:.3f} | "
               f"{8 * row_bytes / gbps / 1e6:.3f} | |")
  return table


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--tokens", default="65536")
  ap.add_argument("--d", default="768,896")
  ap.add_argument("--reps", type=int, default=50)
  ap.add_argument("--gbps", type=float, default=3000.0, help="bandwidth for the ideal row")
  ap.add_argument("--quick", action="store_true")
  a = ap.parse_args(argv)
  configs = list(CONFIGS)
  if a.quick:
    a.tokens, a.d, a.reps, configs = "37", "48", 2, [(4, 4), (1, 1)]
  dev = jax.devices()[0]
  print(f"# {dev.device_kind} ({dev.platform}), jax {jax.__version__}, {a.reps} reps"
        + (" (Pallas interpreter)" if dev.platform != "gpu" else ""))
  for n in (int(t) for t in a.tokens.split(",")):
    for d in (int(t) for t in a.d.split(",")):
      print("\n".join(run(n, d, a.reps, a.gbps, configs)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
