"""Shampoo's option values, their validation and the root method ``auto`` resolves to."""

from __future__ import annotations

from typing import Optional

import jax

from scaleopt.optim.tree_utils import check_choice


MODES = ("std", "cf", "inv", "full")
CROSSFITS = ("ab", "rolling_b")
ROOT_METHODS = ("auto", "eigh", "newton")
GRAFTS = ("none", "adam")
AB_NUMERATORS = ("all_off_refresh", "a")
STACKED = ("auto", "none")


# ``eigh_implementation``: the solver of jax.lax.linalg.eigh; None: the backend's default (on
# GPU cuSOLVER syevd, Jacobi for n <= 32), "jacobi" (GPU: cuSOLVER syevj for every size; not
# on CPU), "qr" (syevd / LAPACK).
EIGH_IMPLEMENTATIONS = (None, "jacobi", "qr")


# Precisions of the per-step matmuls (``matmul_precision``, ``stats_precision``): a
# ``jax.lax.Precision`` level (backend-dependent: on recent NVIDIA GPUs "default" and "high" are
# TF32 passes, on TPU bfloat16 passes) or an exact ``jax.lax.DotAlgorithmPreset``.
PRECISIONS = ("highest", "high", "default", "F32_F32_F32", "TF32_TF32_F32", "BF16_BF16_F32",
              "BF16_BF16_F32_X3", "BF16_BF16_F32_X6")


def _check_int(name, v, lo=1):
  if not isinstance(v, int) or isinstance(v, bool) or v < lo:
    raise ValueError(f"{name}={v!r} must be an integer >= {lo}")


def validate_options(*, root_method, graft, stacked, block_size, stats_every, root_every, max_dim,
              newton_iters, mode, damping, matmul_precision, stats_precision,
              eigh_implementation, newton_precision, block_major, block_shards,
              offload_statistics):
  check_choice("root_method", root_method, ROOT_METHODS)
  check_choice("matmul_precision", matmul_precision, PRECISIONS)
  check_choice("newton_precision", newton_precision, PRECISIONS)
  check_choice("stats_precision", stats_precision, PRECISIONS)
  check_choice("eigh_implementation", eigh_implementation, EIGH_IMPLEMENTATIONS)
  if eigh_implementation == "jacobi" and jax.default_backend() == "cpu":
    raise ValueError("eigh_implementation='jacobi' needs a GPU (no Jacobi eigh on CPU)")
  check_choice("graft", graft, GRAFTS)
  check_choice("stacked", stacked, STACKED)
  for n, v in (("block_size", block_size), ("stats_every", stats_every),
               ("root_every", root_every), ("max_dim", max_dim), ("newton_iters", newton_iters)):
    _check_int(n, v)
  if mode in ("inv", "full") and root_method == "newton":
    raise ValueError(f"mode={mode!r} corrects eigenvalues; root_method must be 'eigh'")
  if isinstance(damping, (int, float)) and not damping > 0:
    raise ValueError(f"damping={damping!r} must be > 0")
  if not (block_major is None or block_major == "layers" or callable(block_major)):
    raise ValueError(f"block_major={block_major!r} must be None, 'layers' or a callable "
                     "params -> pytree of dims")
  if not isinstance(block_shards, int) or isinstance(block_shards, bool) or block_shards < 1:
    raise ValueError(f"block_shards={block_shards!r} must be an integer >= 1 (in a training "
                     "config, 'fsdp': mesh.fsdp)")
  if block_shards > 1 and block_major == "layers":
    raise ValueError(f"block_shards={block_shards} cuts each tensor's block_major dim into "
                     "shards; block_major='layers' has none (remove one of the two)")
  if not isinstance(offload_statistics, bool):
    raise ValueError(f"offload_statistics={offload_statistics!r} must be true or false")
  if offload_statistics and not hasattr(getattr(jax, "memory", None), "Space"):
    raise ValueError(f"offload_statistics=True needs jax.memory.Space (jax {jax.__version__} "
                     "has none)")


def resolve_root_method(root_method: str, mode: str = "std", backend: Optional[str] = None,
                        d_max: float = 0.0, eigh_implementation: Optional[str] = None) -> str:
  """``auto`` -> ``eigh`` for the eigenvalue-correcting modes (inv, full), with ``d_max`` or
  ``eigh_implementation`` set (options of the eigh path) and on CPU, else ``newton``; other
  values unchanged. ``backend``: default ``jax.default_backend()``, read when the first step
  is traced (not when the transform is built: a multi-process run initializes JAX's
  distributed runtime after building its optimizer)."""
  if root_method != "auto":
    return root_method
  if mode in ("inv", "full") or d_max > 0 or eigh_implementation is not None:
    return "eigh"
  return "eigh" if (backend or jax.default_backend()) == "cpu" else "newton"
