"""Bitwise-reproducible runs: ``run.deterministic``.

Two runs of one config on the same card, device count and software give bitwise-identical
losses and parameters at every step when every source of run-to-run variation is fixed:

* the data order: ``numpy.random.default_rng([data seed, epoch])`` (``train.data.Batches``),
  made by one background thread in order (``prefetch.Prefetch``); the held-out windows by a fixed
  seed. No other host random numbers enter a step. (Deterministic with or without the switch.)
* initialization and per-step keys: ``jax.random`` from ``run.seed`` (also without it).
* XLA's GPU programs: ``DETERMINISTIC_XLA_FLAGS``, XLA's deterministic mode
  (``--xla_gpu_deterministic_ops``). It makes XLA (a) compile scatter (the token embedding's
  gradient) without atomics, (b) run cuBLAS without atomic split-K reductions, (c) pick the
  first valid kernel configuration instead of timing candidates (autotuning by timing picks
  different GEMM kernels in different processes, hence different roundings) and (d) ask cuDNN
  for its deterministic kernels.
* Attention by XLA on a GPU (``model_config``): ``model.attention_impl: auto`` resolves to
  ``xla`` while the deterministic mode is on; ``cudnn`` and tokamax's attentions are refused
  (XLA's deterministic mode does not run the training step with cuDNN attention in this jax
  version; tokamax's kernels are not checked for run-to-run equality).
* The repository's Pallas kernels (loss rows, residual add + RMS norm) give each row to one
  program and use no atomics; XLA's reductions on GPU are deterministic.

XLA reads ``XLA_FLAGS`` once, when JAX starts its first backend. ``scaleopt train`` and
``scaleopt study`` call ``prepare`` before that; a program that trains through the library
calls ``prepare(True)`` before its first JAX computation. ``prepare`` refuses, in one line,
a GPU backend already started without the flags.

Not guaranteed: equality across cards (another SM count or architecture picks other kernels),
across device counts or mesh shapes (other reduction trees), across versions of JAX, XLA,
CUDA, cuBLAS or cuDNN, and across CPU thread counts. CPU programs are deterministic for a fixed
thread count with or without the flags (XLA ignores GPU flags there).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any, Optional

import numpy as np

from scaleopt.config import ConfigError

DETERMINISTIC_XLA_FLAGS = ("--xla_gpu_deterministic_ops=true",)


def _flag_values(flags: str) -> dict:
  """``--name=value`` (or ``--name``) entries of an XLA_FLAGS string: name -> value."""
  out = {}
  for f in flags.split():
    name, _, value = f.partition("=")
    out[name] = value if value else "true"
  return out


def missing_flags(current: str) -> list[str]:
  """The entries of ``DETERMINISTIC_XLA_FLAGS`` that ``current`` (an XLA_FLAGS string) does not
  set to their value."""
  have = _flag_values(current)
  want = _flag_values(" ".join(DETERMINISTIC_XLA_FLAGS))
  return [f"{k}={v}" for k, v in want.items() if have.get(k, "").lower() != v]


def with_flags(current: str) -> str:
  """``current`` XLA_FLAGS plus ``DETERMINISTIC_XLA_FLAGS``; ConfigError when ``current`` sets
  one of them to another value (the switch and the environment would disagree)."""
  have = _flag_values(current)
  for f in missing_flags(current):
    name = f.split("=")[0]
    if name in have:
      raise ConfigError(f"run.deterministic=true needs {f}, but XLA_FLAGS sets "
                        f"{name}={have[name]}; remove it from XLA_FLAGS")
  return " ".join([current.strip(), *missing_flags(current)]).strip()


def backend_started() -> bool:
  """Whether JAX has started a backend (after which XLA_FLAGS is no longer read). JAX has no
  public query for this; its internal one is used where it exists, and a JAX without it
  answers False (the flags are then set, not checked)."""
  try:
    from jax._src import xla_bridge  # the one private JAX name scaleopt uses (test_packaging)
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):
    return False


def prepare(deterministic: bool, environ=os.environ, started: Optional[bool] = None,
            platform: Optional[str] = None) -> None:
  """Makes the process's XLA programs deterministic when ``deterministic``: adds
  ``DETERMINISTIC_XLA_FLAGS`` to ``environ['XLA_FLAGS']`` before JAX starts a backend. Once
  a backend has started (``started``; default: asked of JAX) the flags must already be there
  on a GPU (``platform``; default: JAX's default backend), else ConfigError in one line. CPU
  and TPU programs need no flags."""
  if not deterministic:
    return
  started = backend_started() if started is None else started
  if not started:
    environ["XLA_FLAGS"] = with_flags(environ.get("XLA_FLAGS", ""))
    return
  if platform is None:
    import jax
    platform = jax.default_backend()
  missing = missing_flags(environ.get("XLA_FLAGS", ""))
  if platform == "gpu" and missing:
    raise ConfigError(
        "run.deterministic=true, but JAX started its GPU backend without "
        f"{' '.join(missing)} in XLA_FLAGS (XLA reads them once, at start-up); start "
        "through `scaleopt train` / `scaleopt study`, or export XLA_FLAGS with them first")


def xla_deterministic(environ=os.environ) -> bool:
  """Whether this process's XLA_FLAGS turn XLA's deterministic mode on (``prepare`` put
  them there, or the environment did: a study sets them for all its cells)."""
  return not missing_flags(environ.get("XLA_FLAGS", ""))


def model_config(cfg: Any, deterministic: bool, platform: str) -> Any:
  """The ``ModelConfig`` a run builds from ``cfg``: unchanged unless ``deterministic`` (XLA's
  deterministic mode is on) and ``platform`` is ``gpu``; then attention runs by XLA:
  ``attention_impl: auto`` becomes ``xla``, and ``cudnn`` or a tokamax attention is a
  ConfigError in one line."""
  impl = cfg.attention_impl
  if not deterministic or platform != "gpu" or impl == "xla":
    return cfg
  if impl == "auto":
    return cfg.replace(attention_impl="xla")
  why = ("XLA's deterministic mode does not run the training step with cuDNN attention in this "
         "jax version" if impl == "cudnn" else
         "tokamax's attention is not checked for run-to-run equality")
  raise ConfigError(f"model.attention_impl={impl} under XLA's deterministic mode on a GPU "
                    f"(run.deterministic=true): {why}; "
                    "set model.attention_impl to auto or xla")


def model_spec(cfg: Any, platform: Optional[str] = None, environ=os.environ) -> Any:
  """The model section (``ModelSpec``) a training config ``cfg`` builds: under XLA's
  deterministic mode (``cfg.run.deterministic``, or the process's XLA_FLAGS) its model config
  from ``model_config`` on ``platform`` (default: JAX's default backend). ``cfg``, which the
  run records and resumes with, is not changed."""
  if not (cfg.run.deterministic or xla_deterministic(environ)):
    return cfg.model
  if platform is None:
    import jax
    platform = jax.default_backend()
  model_cfg = model_config(cfg.model.config, True, platform)
  return cfg.model if model_cfg is cfg.model.config else dataclasses.replace(cfg.model,
                                                                              config=model_cfg)


def wanted(raw: Any) -> bool:
  """``run.deterministic`` of a raw training mapping (before validation; anything but a
  literal true is false here, the validation reports bad values later)."""
  run = raw.get("run") if isinstance(raw, dict) else None
  return isinstance(run, dict) and run.get("deterministic") is True


def state_digest(tree: Any) -> str:
  """SHA-256 over every leaf of a pytree of arrays, in tree order: dtype, shape and bytes.
  Equal digests mean bitwise-equal trees. Leaves are fetched one at a time; each must be
  fully addressable by this process."""
  import jax
  h = hashlib.sha256()
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    a = np.asarray(jax.device_get(leaf))
    h.update(f"{jax.tree_util.keystr(path)}|{a.dtype}|{a.shape}|".encode())
    h.update(np.ascontiguousarray(a).tobytes())
  return h.hexdigest()
