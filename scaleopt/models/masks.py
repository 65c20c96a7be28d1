"""Parameter roles from parameter paths: weight-decay masks and logical sharding specs.

Every parameter path carries its role in its names (see :mod:`scaleopt.models.layers`):

=====================  =====================================================  ================
role                   path contains                                          decayed under
=====================  =====================================================  ================
``output_norm_scale``  ``out_scale`` (QK-norm, sandwich, DNP on q/k/gate,     ``all``
                       tied final scale with ``final_scale_role=output``)
``row_scale``          ``row_scale`` (DP output-side scales)                  ``iwd``, ``all``
``input_norm_scale``   ``in_scale`` (pre-attn/MLP/MoE/final scales, HG        ``iwd``, ``all``
                       copies, DNP on v/up)
``embedding``          leaf ``embedding``                                     every policy
``head``               ``head/kernel`` (untied LM head)                       every policy
``router``             ``router/kernel``                                      every policy
``matrix``             leaf ``kernel`` elsewhere (incl. stacked experts)      every policy
``bias``               leaf ``bias``                                          ``all``
=====================  =====================================================  ================

OR factors (``beta``, ``alpha``) inherit the role of the scale they belong to. Roles never rely
on ``ndim``: stacked layers make every scale vector 2-D, and the "no decay on 1-D" rule would
contradict IWD anyway.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax

from scaleopt.models.config import ModelConfig

ROLES = ("output_norm_scale", "row_scale", "input_norm_scale", "embedding", "head", "router",
         "matrix", "bias")
POLICIES = ("iwd", "all", "matrices-only")
_MATRIX_ROLES = frozenset({"matrix", "router", "embedding", "head"})
_DECAYED = {
    "all": frozenset(ROLES),
    "matrices-only": _MATRIX_ROLES,
    "iwd": _MATRIX_ROLES | {"input_norm_scale", "row_scale"},
}


def _key_str(k: Any) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(k, attr):
      return str(getattr(k, attr))
  return str(k)


def path_names(path: Sequence[Any] | str) -> tuple[str, ...]:
  """A jax key path, a tuple of names or a ``"a/b/c"`` string as a tuple of strings."""
  if isinstance(path, str):
    return tuple(path.split("/"))
  return tuple(_key_str(k) for k in path)


def role_of(path: Sequence[Any] | str) -> str:
  """The role of one parameter (table in the module docstring)."""
  names = path_names(path)
  joined = "/".join(names)
  for token, role in (("out_scale", "output_norm_scale"), ("row_scale", "row_scale"),
                      ("in_scale", "input_norm_scale")):
    if any(token in n for n in names):
      return role
  leaf = names[-1]
  if leaf == "embedding":
    return "embedding"
  if leaf == "kernel" and "head" in names:
    return "head"
  if leaf == "kernel" and "router" in names:
    return "router"
  if leaf == "kernel":
    return "matrix"
  if leaf == "bias":
    return "bias"
  raise ValueError(f"cannot infer the role of parameter {joined!r}")


def is_embedding(path: Sequence[Any] | str) -> bool:
  """True for the token embedding (also the tied LM head) and an untied LM head: the
  parameters that Muon-style optimizers keep on AdamW."""
  return role_of(path) in ("embedding", "head")


def param_roles(params: Any) -> Any:
  """A pytree like ``params`` holding each parameter's role string."""
  return jax.tree_util.tree_map_with_path(lambda p, _: role_of(p), params)


def weight_decay_mask(params: Any, policy: str = "iwd") -> Any:
  """A pytree of bools like ``params``: True where weight decay applies.

  * ``iwd``            matrices, embeddings, Input-Norm and DP row scales; never Output-Norm
                       scales, never biases (the paper's Input-Norm Weight Decay).
  * ``all``            every parameter.
  * ``matrices-only``  matrices and embeddings only (the common "no decay on 1-D" rule).

  Use with ``optax.add_decayed_weights(wd, mask=...)`` or ``optax.adamw(..., mask=...)``.
  """
  if policy not in _DECAYED:
    raise ValueError(f"weight-decay policy={policy!r}; choose one of {POLICIES}")
  decayed = _DECAYED[policy]
  return jax.tree_util.tree_map_with_path(lambda p, _: role_of(p) in decayed, params)


# ---------------------------------------------------------------------------------------------
# Logical sharding.

LogicalSpec = tuple[str | None, ...]


def partition_rules(cfg: ModelConfig) -> Callable[[Any, tuple[int, ...]], LogicalSpec]:
  """``spec(path, shape) -> logical axes`` (one entry per array dim; None = replicated).

  Logical axes: ``fsdp`` (the model dimension d of every matrix), ``tensor`` (heads / hidden /
  vocab), ``expert`` (the expert axis). Leading stacked-layer axes are None. Column-parallel
  maps (q, k, v, gate, up, head, embedding rows are vocab) put ``tensor`` on their output,
  row-parallel maps (o, down) on their input. Scale vectors and biases are replicated (tiny).
  The trainer maps logical names to mesh axes (names without a mesh axis mean replicated).
  """
  del cfg  # The rules depend on the path only; cfg is kept for future per-model rules.

  def spec(path: Any, shape: tuple[int, ...]) -> LogicalSpec:
    names, nd = path_names(path), len(shape)
    role = role_of(names)
    if role == "embedding":  # [V, d]
      core: LogicalSpec = ("tensor", "fsdp")
    elif role == "head":  # [d, V]
      core = ("fsdp", "tensor")
    elif role == "router":  # [d, E]: tiny, experts not split
      core = ("fsdp", None)
    elif role == "matrix":
      row_parallel = any(n in ("wo", "wdown") for n in names)
      core = ("tensor", "fsdp") if row_parallel else ("fsdp", "tensor")
      if "experts" in names:  # [E, in, out]
        core = ("expert", *core)
    else:
      core = ()
    return (None,) * (nd - len(core)) + core

  return spec


def logical_specs(cfg: ModelConfig, params: Any) -> Any:
  """The pytree of logical axis tuples for ``params`` (arrays or ShapeDtypeStructs)."""
  spec = partition_rules(cfg)
  return jax.tree_util.tree_map_with_path(lambda p, x: spec(p, x.shape), params)


def fsdp_dims(params: Any) -> Any:
  """Per tensor the dim that the ``fsdp`` logical axis (the model dimension d) splits, as a
  negative index, or None (a tree of ints and Nones shaped like ``params``). Shampoo orders its
  blocks by it (``scaleopt.optim.shampoo_lib.Blocking``)."""
  spec = partition_rules(None)

  def dim(path, x):
    s = spec(path, x.shape)
    return s.index("fsdp") - len(s) if "fsdp" in s else None

  return jax.tree_util.tree_map_with_path(dim, params)
