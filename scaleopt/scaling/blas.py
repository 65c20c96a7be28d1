"""Limit the threads of the LAPACK/BLAS that JAX's CPU linear algebra calls (scipy's OpenBLAS).

XLA:CPU runs `eigh` through scipy's OpenBLAS/LAPACK. OpenBLAS spins its own thread pool on top of
XLA's; on a busy machine with few cores that oversubscription makes a large float64 eigh many
times slower and can stall a sweep. `limit_blas_threads(1)` sets the
thread count through the library's own `*_set_num_threads` entry point (found in the loaded
shared objects, Linux only) and restores it on exit; elsewhere it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import re
from typing import Iterator


def _openblas_handles() -> list[tuple[ctypes.CDLL, str]]:
  out = []
  try:
    paths = {line.split()[-1] for line in open("/proc/self/maps") if "openblas" in line.lower()}
  except OSError:
    return out
  for path in sorted(paths):
    if not re.search(r"\.so(\.|$)", path):
      continue
    try:
      lib = ctypes.CDLL(path)
    except OSError:
      continue
    for suffix in ("", "64_"):
      name = f"scipy_openblas_get_num_threads{suffix}"
      if hasattr(lib, name) and hasattr(lib, f"scipy_openblas_set_num_threads{suffix}"):
        out.append((lib, suffix))
        break
  return out


@contextlib.contextmanager
def limit_blas_threads(n: int | None) -> Iterator[None]:
  """Within the block, OpenBLAS uses at most n threads (None or <= 0: leave unchanged)."""
  if not n or n <= 0:
    yield
    return
  import jax.numpy as jnp  # make sure JAX has loaded its LAPACK provider
  jnp.linalg.eigh(jnp.eye(2))
  handles = _openblas_handles()
  saved = []
  for lib, sfx in handles:
    saved.append(getattr(lib, f"scipy_openblas_get_num_threads{sfx}")())
    getattr(lib, f"scipy_openblas_set_num_threads{sfx}")(ctypes.c_int(n))
  try:
    yield
  finally:
    for (lib, sfx), old in zip(handles, saved):
      getattr(lib, f"scipy_openblas_set_num_threads{sfx}")(ctypes.c_int(old))
