"""Shampoo (Gupta et al. 2018; Anil et al. 2020) with the bias corrections of Nayak et al.

For every eligible matrix W (2-D, or a stack of matrices along leading axes as in scanned
models; min(d1, d2) >= ``min_dim``, max(d1, d2) <= ``max_dim``, not excluded) cut into blocks G_b of at most ``block_size`` x ``block_size`` (dims are split into
equal blocks, padded with zeros when needed, so every block of a tensor has one shape):

    L_b <- b2 L_b + (1 - b2) G_b G_b^T,   R_b <- b2 R_b + (1 - b2) G_b^T G_b   (every stats_every)
    L_b + lambda I = Q diag(lam) Q^T,  lam <- max(lam, eig_floor_ratio * lambda)  (every root_every)
    P_L = Q diag(lam^{-1/4}) Q^T  (P_R alike; cached between root steps)
    M <- b1 M + (1 - b1) g;   U_b = P_L M_b P_R;   theta <- theta (1 - lr wd) - lr U

All blocks of one factor size, across all tensors, are stacked and their roots computed in one
batched call on root steps (``phases.cond``): by ``jnp.linalg.eigh`` in float32
(``root_method="eigh"``) or by coupled Newton iterations (``"newton"``: batched matmuls at
``newton_precision``, ``"high"`` by default: TF32 on NVIDIA GPUs, whose root error grows with
the factor's condition number; ``"highest"`` for float32 roots; docs/optim.md). The default
``"auto"`` takes Newton on accelerators (batched matmuls instead of cuSOLVER's ``eigh``;
docs/optim.md, Shampoo root solvers), and ``eigh`` on CPU (LAPACK) and for the ``inv``/``full``
modes (their correction needs the eigenvalues). Other tensors (1-D, embeddings, too large)
take AdamW (b1 or ``adam_b1``, b2 or ``adam_b2``, eps; bias-corrected moments).
``graft="adam"`` (the default, as in distributed Shampoo) rescales each block of U to the
Frobenius norm of the Adam direction m_hat / (sqrt(v_hat) + eps) of that block, so Shampoo takes
AdamW's learning rate. ``graft="none"`` is the paper's ungrafted form: its per-block update norm
is set by the factors alone and needs its own learning rate (docs/optim_sophia_shampoo.md).

Bias correction (``mode``; statistics on root steps only, from ``shampoo_collect``):

* ``cf``: M from group A's gradient; S^L_B = (1/m) sum_{j in B} G_j G_j^T (and S^R_B) enter L, R.
* ``inv`` / ``full``: additionally the eigenvalue-variance correction with the eigenbasis Q of
  the new L held fixed (first-order eigenvalue perturbation):

      ell_{j,k} = b2 q_k^T L_{t-1} q_k + (1 - b2) ||(Q^T G_j)_{k,:}||^2 + lambda
      Var_k = Var_j(ell_{j,k}) / m = (1 - b2)^2 Var_j(||(Q^T G_j)_{k,:}||^2) / m
      d_k = max(0, lam_k^{-1/4} - (5/32) lam_k^{-9/4} Var_k)   (optionally d_k <= d_max)
      P_L = Q diag(d) Q^T

  The variance needs the *new* Q, so ``shampoo_collect`` uses the paper's two-pass form: pass 1
  over B accumulates S^L_B, S^R_B; the new L, R are decomposed; pass 2 over B recomputes each
  G_j and projects it on the new bases (Welford). ``inv`` uses all microbatches as one group.

On steps without a root computation an ``ab`` layout feeds M with all microbatches
(``ab_numerator="a"``: group A on every step, as the authors' code).

Parts (one job each): ``options`` (option values, validation, ``resolve_root_method``),
``state`` (the optimizer state and the collector's ``ShampooPrecond``), ``blocking`` (blocks of
a matrix and back), ``roots`` (``eigh`` and coupled-Newton inverse roots), ``placement``
(mesh and host-memory placement, roots batched by size and divided among devices),
``statistics`` (Shampoo-BC's estimator), ``factors`` (statistics EMAs and root refreshes) and
``transform`` (``scale_by_shampoo``, ``shampoo``, ``shampoo_bc``). SOAP reuses the blocking
(``blocking``, ``to_blocks``, ``from_blocks``, ``major_dims``), the placement (``on_owner``,
``batched_by_size``) and ``eigh_damped`` through this package's names.
"""

from scaleopt.optim.shampoo_lib.blocking import (MAJORS, Blocking, block_norms, blocking,
                                                 from_blocks, major_dims, to_blocks)
from scaleopt.optim.shampoo_lib.options import (AB_NUMERATORS, CROSSFITS, EIGH_IMPLEMENTATIONS,
                                                GRAFTS, MODES, PRECISIONS, ROOT_METHODS, STACKED,
                                                resolve_root_method)
from scaleopt.optim.shampoo_lib.placement import (batched_by_size, block_axes, block_sharding,
                                                  in_host_memory, on_owner)
from scaleopt.optim.shampoo_lib.roots import eigh_damped, newton_inverse_root, root_from_eig
from scaleopt.optim.shampoo_lib.state import (RULES, ScaleByShampooState, ShampooFactors,
                                              ShampooPrecond)
from scaleopt.optim.shampoo_lib.statistics import shampoo_collect, shampoo_collector_spec
from scaleopt.optim.shampoo_lib.transform import scale_by_shampoo, shampoo, shampoo_bc

__all__ = [
    "AB_NUMERATORS", "CROSSFITS", "EIGH_IMPLEMENTATIONS", "GRAFTS", "MAJORS", "MODES",
    "PRECISIONS", "ROOT_METHODS", "RULES", "STACKED", "Blocking", "ScaleByShampooState",
    "ShampooFactors", "ShampooPrecond", "batched_by_size", "block_axes", "block_norms",
    "block_sharding", "blocking", "eigh_damped", "from_blocks", "in_host_memory", "major_dims",
    "newton_inverse_root", "on_owner", "resolve_root_method", "root_from_eig",
    "scale_by_shampoo", "shampoo", "shampoo_bc", "shampoo_collect", "shampoo_collector_spec",
    "to_blocks",
]
