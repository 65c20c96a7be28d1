"""Optax transforms for bias-corrected preconditioned optimizers (no Flax imports).

Building blocks follow optax: ``scale_by_*`` transforms with NamedTuple states, plus
convenience aliases (``adamw_bc``). Per-microbatch statistics come from ``collect``.
"""

from scaleopt.optim.collect import (BCStats, CollectorSpec, GroupStats, LOOStats, collect,
                                    value_and_grad_fn)
from scaleopt.optim.adam_bc import (ScaleByAdamBCState, adam_bc_spec, adamw_bc,
                                    find_adam_bc_state, loo_fold_fn, scale_by_adam_bc)
from scaleopt.optim import delta

__all__ = [
    "BCStats", "CollectorSpec", "GroupStats", "LOOStats", "collect", "value_and_grad_fn",
    "ScaleByAdamBCState", "adam_bc_spec", "adamw_bc", "find_adam_bc_state", "loo_fold_fn",
    "scale_by_adam_bc", "delta",
]
