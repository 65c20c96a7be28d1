"""Optax transforms for bias-corrected preconditioned optimizers (no Flax imports).

Aliases in optax style (``adamw_bc``, ``sophia``, ``sophia_bc``, ``shampoo``, ``shampoo_bc``,
``soap``, ``soap_bc``, ``muon``; optax's Lion, Adafactor and schedule-free AdamW through ``build``),
their ``scale_by_*`` blocks, and ``collect``, which derives the per-microbatch statistics a
chain needs from its optimizer state. ``build(config)`` makes a chain from a config through a
registry (``register_optimizer``).
"""

from scaleopt.optim import delta, gnb
from scaleopt.optim.collect import (BCStats, CollectorSpec, GroupStats, LOOStats,
                                    MicrobatchAxis, Static,
                                    StateHooks, clip_by_global_norm, collect, collector_options,
                                    collector_spec,
                                    find_bc_states, register_bc_state, register_estimator,
                                    rule_counts, schedule_count, skipped_tensors,
                                    value_and_grad_fn)
from scaleopt.optim.adam_bc import ScaleByAdamBCState, adamw_bc, scale_by_adam_bc
from scaleopt.optim.sophia_lib import (ScaleBySophiaState, SophiaCurvature, scale_by_sophia,
                                       sophia, sophia_bc)
from scaleopt.optim.shampoo_lib import (ScaleByShampooState, ShampooPrecond, in_host_memory,
                                        scale_by_shampoo, shampoo, shampoo_bc)
from scaleopt.optim.baselines import eval_params
from scaleopt.optim.soap_lib import ScaleBySoapState, scale_by_soap, soap, soap_bc
from scaleopt.optim.schedules import ScheduleConfig, make_schedule
from scaleopt.optim.muon import muon
from scaleopt.optim.build import (OptimizerConfig, Recommended, build, config_class,
                                  extra_config, finite_updates, names, recommended,
                                  register_optimizer, resolved_numerics, unregister_optimizer,
                                  with_recommended)

__all__ = [
    "BCStats", "CollectorSpec", "GroupStats", "LOOStats", "MicrobatchAxis", "Static",
    "StateHooks", "clip_by_global_norm", "collect", "collector_options", "collector_spec",
    "find_bc_states", "register_bc_state", "register_estimator", "rule_counts",
    "schedule_count", "skipped_tensors", "value_and_grad_fn",
    "ScaleByAdamBCState", "adamw_bc", "scale_by_adam_bc",
    "ScaleBySophiaState", "SophiaCurvature", "scale_by_sophia", "sophia", "sophia_bc",
    "ScaleByShampooState", "ShampooPrecond", "in_host_memory", "scale_by_shampoo", "shampoo",
    "shampoo_bc",
    "ScaleBySoapState", "scale_by_soap", "soap", "soap_bc",
    "ScheduleConfig", "make_schedule", "OptimizerConfig", "Recommended", "build",
    "config_class", "extra_config", "finite_updates", "names", "recommended",
    "register_optimizer", "resolved_numerics", "unregister_optimizer", "with_recommended",
    "muon", "delta", "gnb", "eval_params",
]
