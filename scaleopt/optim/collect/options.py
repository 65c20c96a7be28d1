"""``collector_options``: the chain element that sets how the collector computes microbatch
gradients (one or two leave-one-out passes, their storage, ``vmap``)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import optax

from scaleopt.optim.collect.spec import CollectorSpec, Static, register_bc_state


class CollectorOptionsState(NamedTuple):
  """State of ``collector_options``: a spec with only the microbatching options set."""
  spec: Static
  hp: dict


register_bc_state(CollectorOptionsState)


def collector_options(*, loo_passes: Optional[int] = None,
                      vmap_microbatches: Optional[bool] = None,
                      loo_storage: Optional[str] = None,
                      loo_fold_chunk: Optional[int] = None
                      ) -> optax.GradientTransformationExtraArgs:
  """How ``collect`` computes the per-microbatch gradients (an identity transform whose state
  carries the choice; chain it with a bias-corrected optimizer).

  Args:
    loo_passes: 1 (default): the first sweep stores the m gradients (m x params x 4 bytes
      more) and the leave-one-out folds run on them (half the forward/backward work of two
      passes); 2: the folds recompute every g_r in a second sweep (memory independent of m).
    vmap_microbatches: True: each group's m gradients from one ``jax.vmap`` over the
      microbatch axis (memory: the whole group's activations plus m x params x 4 bytes);
      False (default): a ``lax.scan``, one microbatch at a time.
    loo_storage: dtype of the gradients one-pass LOO stores: ``"float32"`` (default; the
      statistics equal the two-pass form's) or ``"bfloat16"`` (half the memory; each stored
      g_r is rounded to bfloat16, relative error <= 2^-8, before the float32 folds).
    loo_fold_chunk: one-pass LOO folds this many stored gradients per step of its scan over
      the folds, unrolled, so that XLA can fuse them with the running sums (fewer, larger
      kernels per fold; docs/benchmarks.md has the step times). The folds run in the
      same order; the statistics are the same up to float32 rounding (XLA's fusion of the
      arithmetic). Default 8 (at most m) on GPUs and TPUs, 1 on CPU (where unrolling
      lengthens the step's compile); 1 folds one stored gradient at a time. It does not
      apply to vmapped microbatches split over devices (folded where they lie).

  None leaves a setting to the default (or to another element of the chain).
  """
  spec = CollectorSpec(layout=None, loo_passes=loo_passes, vmap_microbatches=vmap_microbatches,
                       loo_storage=loo_storage, loo_fold_chunk=loo_fold_chunk)

  def init_fn(params):
    del params
    return CollectorOptionsState(Static(spec), {})

  def update_fn(updates, state, params=None, **_):
    del params
    return updates, state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
