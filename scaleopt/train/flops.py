"""The trainer's FLOP accounting: executed model FLOPs per token and the devices' peak, for
MFU. Model FLOPs per token are ``scaleopt.models.flops_per_token`` (closed form); a step runs
``CollectorSpec.passes_per_step`` forward+backward passes over its distinct examples."""

from __future__ import annotations

from typing import Optional

import jax

from scaleopt import models

# Dense bf16 peak FLOP/s per TPU chip, matched against ``device_kind`` (GPUs:
# ``scaleopt.models.PEAK_FLOPS``).
TPU_PEAK_FLOPS = {"v4": 275e12, "v5 lite": 197e12, "v5e": 197e12, "v5p": 459e12,
                  "v6": 918e12}


def peak_flops(device, override: Optional[float]) -> Optional[float]:
  """Peak FLOP/s of one device: ``override`` (``run.peak_flops``), else looked up from its
  ``device_kind``; None when unknown (no MFU is reported)."""
  if override:
    return float(override)
  kind = getattr(device, "device_kind", "")
  for name, f in models.PEAK_FLOPS.items():
    if name in kind:
      return f
  for name, f in TPU_PEAK_FLOPS.items():
    if name in kind.lower():
      return f
  return None


def run_flops(model_cfg: models.ModelConfig, seq_len: int, passes_per_step: float,
              override: Optional[float]) -> tuple[float, Optional[float]]:
  """(executed model FLOPs per distinct token, peak FLOP/s of all devices or None)."""
  per_token = models.flops_per_token(model_cfg, seq_len) * passes_per_step
  peak = peak_flops(jax.devices()[0], override)
  return per_token, (peak * jax.device_count() if peak else None)
