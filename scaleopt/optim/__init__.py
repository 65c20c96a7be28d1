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

# Issue 3: schedules, optimizers from config, Sophia, Shampoo.
from scaleopt.optim.schedules import ScheduleConfig, make_schedule
from scaleopt.optim import gnb, shampoo, sophia
from scaleopt.optim.sophia import (ScaleBySophiaState, SophiaCurvature, scale_by_sophia,
                                   sophia_bc, sophia_collect, sophia_spec)
from scaleopt.optim.shampoo import (ScaleByShampooState, ShampooPrecond, scale_by_shampoo,
                                    shampoo_bc, shampoo_collect, shampoo_spec)
from scaleopt.optim.build import EXTRA_KEYS, NAMES, OptimizerConfig, build, collect_step

__all__ += [
    "ScheduleConfig", "make_schedule", "gnb", "shampoo", "sophia", "ScaleBySophiaState",
    "SophiaCurvature", "scale_by_sophia", "sophia_bc", "sophia_collect", "sophia_spec",
    "ScaleByShampooState", "ShampooPrecond", "scale_by_shampoo", "shampoo_bc",
    "shampoo_collect", "shampoo_spec", "EXTRA_KEYS", "NAMES", "OptimizerConfig", "build",
    "collect_step",
]
