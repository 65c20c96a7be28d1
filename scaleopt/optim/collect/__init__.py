"""Per-microbatch statistics for bias-corrected preconditioning, derived from the optimizer state.

Optax transforms see one gradient pytree, but every bias correction of Nayak et al.
(arXiv 2605.20756) needs more: the mean gradient of one group of microbatches (the
numerator), a preconditioner statistic from another, independent group, and the spread of
per-microbatch quantities (for the delta-method correction of the inverse). ``collect``
computes all of it inside a jitted step with ``lax.scan`` over the microbatches, in float32,
with memory that does not depend on the number of microbatches m.

One source of truth. A bias-corrected transform writes what it needs into its own state: a
``CollectorSpec`` (static, hashable, in the state's tree structure) and the numeric
hyperparameters the collector uses (``hp``, scalar arrays). ``collect(loss_fn, params,
microbatches, opt_state)`` walks the state tree (through ``chain``, ``partition``,
``multi_transform``, ``inject_hyperparams``, ``MultiSteps``), finds every registered BC state
and merges their specs; under ``inject_hyperparams`` the live values of its ``hyperparams``
override ``hp``. A user never passes ``b2``, ``mode``, ``k`` or ``damping`` twice.

Welford's algorithm (written once here, used by every optimizer) keeps (n, mean, M2):

    delta = x_j - mean_{j-1};  mean_j = mean_{j-1} + delta / j;  M2_j = M2_{j-1} + delta (x_j - mean_j)

and the variance of the group mean is Var(x_bar) = M2 / (m (m - 1)) (unbiased).

Layouts (who is numerator, who is preconditioner):

* ``all``: one group of all m microbatches; ``a`` and ``b`` are the same.
* ``ab``: the step's 2m microbatches in halves, A (numerator) and B (preconditioner).
* ``rolling_b``: A = ``microbatches``, B = ``b_microbatches`` (step t+1's A); the step's own
  data is A, so ``full``, ``loss`` and the clip norm come from A alone.
* ``symmetric``: the step's m microbatches in halves A and B, both with full statistics (same
  examples and compute as std).
* ``loo``: leave-one-out; the BC states' fold functions run on every g_r given g_full; the
  collector averages their terms and takes the variance of their denominators (from sums of
  their deviations from the denominator at g_full). One pass (the default,
  ``loo_passes=1``): the scan that accumulates g_full also stores every g_r (stacked,
  float32: m x params x 4 bytes more, ~4 GB for GPT-2 small at m = 8; ``loo_storage=
  "bfloat16"`` halves it; each stored g_r is sharded like its parameter, so FSDP over n
  devices divides it by n) and the folds scan over the stored gradients (no second
  forward/backward), 8 folds per step of that scan on GPUs and TPUs, unrolled (1 on CPU;
  ``loo_fold_chunk``). Two passes (``loo_passes=2``, for memory): pass 1 computes g_full,
  pass 2 recomputes every g_r (memory independent of m). Both give the same statistics (bit
  for bit on CPU with ``loo_fold_chunk=1``, to float32 rounding with more folds per step).

Microbatch gradients (``vmap_microbatches``): by default every group is a ``lax.scan`` of one
forward/backward per microbatch (memory of one microbatch). With ``vmap_microbatches=True`` a
group's m gradients come from one ``jax.vmap`` over the microbatch axis (one batched
forward/backward, the efficiency of one large batch; memory: the group's activations plus
m x params float32 gradients), and the same statistics (same order of accumulation) run over
the stacked gradients. LOO then always folds the stored gradients (one pass). Both options are
set with ``collector_options`` (an element of the chain, like ``clip_by_global_norm``).

Clipping (``clip_by_global_norm`` of this module): one factor c = min(1, max_norm / ||g_full||)
from the full-batch gradient norm, applied to every statistic (means by c, squares and
variances of gradients by c^2, variances of squares by c^4, LOO folds on c g_r), so the
preconditioned update is the one of the clipped gradient stream, as ``optax`` composes clip
and Adam. ``numerator_only=True`` reproduces the reference code: c = min(1, max_norm /
||numerator||) scales what enters the first moment (``BCStats.numerator_clip``) and nothing
else; every second-moment statistic (Adam's v, the g_A^2 of the alpha mix, Shampoo's factors
and its AdamW fallback's v, the LOO folds) comes from the unclipped gradients, which the
transforms read from ``bc_stats.numerator``. The one exception is the reference's leave-one-out
form, whose persistent m and v both take the clipped g_full (its buffers alias the clipped
gradient).

The package, one job a module: ``stats`` (the statistics and Welford), ``spec`` (what to
compute, read from the optimizer state; the registries), ``microbatch`` (the scans over
microbatches), ``clip`` (the global-norm clip), ``collector`` (``collect``), ``options``
(``collector_options``).
"""

# isort: off (the order is the dependency order)
from scaleopt.optim.collect.stats import (BCStats, GradFn, GroupStats, LOOStats, LossFn, PyTree,
                                          Welford, welford_add, welford_init, welford_merge,
                                          welford_of, welford_var_of_mean)
from scaleopt.optim.collect.spec import (CLIPS, CollectorSpec, Found, LAYOUTS, LOO_PASSES,
                                         LOO_STORAGE, StateHooks, Static, VAR_OF, collector_spec,
                                         estimator, find_bc_states, merge_specs,
                                         register_bc_state, register_estimator, rule_counts,
                                         schedule_count, skipped_tensors, state_hooks)
from scaleopt.optim.collect.microbatch import (MicrobatchAxis, align, fold_microbatches, halves,
                                               num_microbatches, refresh_groups, scan_group,
                                               sum0, value_and_grad_fn)
from scaleopt.optim.collect.clip import (ClipState, check_numerator, clip_by_global_norm,
                                         clip_factor, scale_group, unclipped_numerator)
from scaleopt.optim.collect.collector import collect
from scaleopt.optim.collect.options import CollectorOptionsState, collector_options
