"""Device mesh (axes data, fsdp, tensor), sharding rules, multi-host start-up, launch flags.

Parameters follow the model's logical partition rules (``scaleopt.models.partition_rules``)
mapped by ``scaleopt.models.sharding.mesh_spec``: logical ``fsdp`` -> mesh axis ``fsdp``,
``tensor`` -> ``tensor``, everything else replicated; a dimension that the mesh axis does not
divide stays replicated. Inside the step the model pins activations to the batch axes and
gathers kernels over ``fsdp`` for use (``scaleopt.models.sharding``; ``bridge.Model.mesh``). Optimizer-state leaves take
the sharding of the parameter whose path ends their own path (optax states nest the parameter
tree) when the shapes agree, else they are replicated; with ``mesh.shard_optimizer`` that
parameter sharding is further split over ``data`` (``optimizer_shardings``, ZeRO-1). Batches ``[m, b, T+1]`` are split on
the sequence axis b over ``data`` x ``fsdp`` (FSDP is data parallel for activations).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from scaleopt.models.sharding import mesh_spec
from scaleopt.optim.shampoo_lib import ShampooFactors, block_sharding
from scaleopt.train.config import ConfigError, MeshConfig

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
# XLA flags a GPU training process gets from the launcher (``scaleopt train``) unless
# XLA_FLAGS already sets them: cuBLAS instead of Triton GEMMs (gpt2-small: 46% instead of 35%
# MFU, docs/benchmarks.md) and the latency-hiding scheduler (overlaps FSDP all-gathers /
# reduce-scatters with compute). XLA ignores GPU flags on other platforms.
LAUNCH_XLA_FLAGS = ("--xla_gpu_enable_triton_gemm=false",
                    "--xla_gpu_enable_latency_hiding_scheduler=true")
_PROCESS_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
_MULTIHOST_ENV = ("JAX_COORDINATOR_ADDRESS", "COORDINATOR_ADDRESS", "SLURM_NTASKS",
                  "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS")


def launch_xla_flags(current: str) -> str:
  """``current`` XLA_FLAGS plus every ``LAUNCH_XLA_FLAGS`` entry whose flag it does not set."""
  names = {f.split("=")[0] for f in current.split()}
  extra = [f for f in LAUNCH_XLA_FLAGS if f.split("=")[0] not in names]
  return " ".join([current.strip(), *extra]).strip()


def set_launch_xla_flags(environ=os.environ) -> None:
  """Called by the launcher before JAX starts a backend; ``SCALEOPT_XLA_DEFAULTS=0`` opts out."""
  if environ.get("SCALEOPT_XLA_DEFAULTS", "1") != "0":
    environ["XLA_FLAGS"] = launch_xla_flags(environ.get("XLA_FLAGS", ""))


def _env_int(name: str, value: str, lo: int) -> int:
  try:
    v = int(value)
  except ValueError:
    v = None
  if v is None or v < lo:
    raise ConfigError(f"{name}={value!r} is not an integer >= {lo}")
  return v


def distributed_args(environ=os.environ) -> dict:
  """Keyword arguments for ``jax.distributed.initialize`` from the variables of a run started
  by hand: ``JAX_COORDINATOR_ADDRESS=HOST:PORT``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``
  (all three or none) and optionally ``JAX_LOCAL_DEVICE_IDS=0,1``. ``{}`` when neither
  ``JAX_NUM_PROCESSES`` nor ``JAX_PROCESS_ID`` is set (then a cluster manager's variables, if
  any, are detected by JAX). ConfigError for a half-set or malformed set."""
  get = lambda k: environ.get(k, "").strip()
  addr, num, pid, local = (get(k) for k in (*_PROCESS_ENV, "JAX_LOCAL_DEVICE_IDS"))
  if not (num or pid):
    return {}
  missing = [k for k, v in zip(_PROCESS_ENV, (addr, num, pid)) if not v]
  if missing:
    raise ConfigError(f"{' and '.join(missing)} not set: a multi-process launch by hand needs "
                      f"all of {', '.join(_PROCESS_ENV)}")
  host, _, port = addr.rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ConfigError(f"JAX_COORDINATOR_ADDRESS={addr!r} is not HOST:PORT (e.g. "
                      "10.0.0.1:1234, the address of process 0)")
  kw = dict(coordinator_address=addr, num_processes=_env_int("JAX_NUM_PROCESSES", num, 1),
            process_id=_env_int("JAX_PROCESS_ID", pid, 0))
  if kw["process_id"] >= kw["num_processes"]:
    raise ConfigError(f"JAX_PROCESS_ID={pid} is not below JAX_NUM_PROCESSES={num} (ids run "
                      f"from 0 to {kw['num_processes'] - 1})")
  if local:
    kw["local_device_ids"] = [_env_int("JAX_LOCAL_DEVICE_IDS", x.strip(), 0)
                              for x in local.split(",")]
  return kw


def _cluster_present(environ=os.environ) -> bool:
  """A cluster manager's variables (SLURM with several tasks, Open MPI, a multi-host TPU slice,
  a coordinator address) are present."""
  slurm = int(environ.get("SLURM_NTASKS", "1") or "1") > 1
  other = any(environ.get(k) for k in _MULTIHOST_ENV if k != "SLURM_NTASKS")
  tpu_hosts = len(environ.get("TPU_WORKER_HOSTNAMES", "").split(",")) > 1
  return slurm or tpu_hosts or (other and "TPU_WORKER_HOSTNAMES" not in environ)


def maybe_initialize_distributed(mode: str, environ=os.environ) -> bool:
  """Joins a multi-process run: ``jax.distributed.initialize`` with the arguments of
  ``distributed_args`` when the ``JAX_*`` variables are set, else without arguments (JAX
  detects SLURM, Open MPI, TPU slices and other clusters itself). ``mode='on'`` always
  initializes, ``'auto'`` only when such variables are present, ``'off'`` never (and refuses
  ``JAX_NUM_PROCESSES`` > 1). Returns whether JAX runs distributed. ConfigError (one line)
  for bad variables or when the run cannot be joined."""
  kw = distributed_args(environ)
  if mode == "off":
    if kw.get("num_processes", 1) > 1:
      raise ConfigError(f"mesh.distributed=off, but JAX_NUM_PROCESSES={kw['num_processes']} "
                        "asks for a multi-process run; unset it or use mesh.distributed=auto")
    return False
  if jax.distributed.is_initialized():
    return True
  if mode == "auto" and not (kw or _cluster_present(environ)):
    return False
  try:
    jax.distributed.initialize(**kw)
  except (ValueError, TypeError, RuntimeError) as e:  # JAX's own checks; connection failures
    why = " ".join(str(e).split())[:300].rstrip(".")
    if kw:
      how = (f"as process {kw['process_id']} of {kw['num_processes']} at "
             f"{kw['coordinator_address']}")
    elif environ.get("JAX_COORDINATOR_ADDRESS"):
      how = "from JAX_COORDINATOR_ADDRESS alone"
      why += "; set JAX_NUM_PROCESSES and JAX_PROCESS_ID too (no cluster manager supplies them)"
    else:
      how = "from the cluster's variables"
    raise ConfigError(f"cannot start the multi-process run {how}: {why}") from None
  return True


def make_mesh(cfg: MeshConfig, devices: Optional[list] = None) -> Mesh:
  devs = list(jax.devices() if devices is None else devices)
  n = len(devs)
  rest = cfg.fsdp * cfg.tensor
  data = cfg.data if cfg.data != -1 else n // rest
  if data * rest != n or data < 1:
    raise ConfigError(f"mesh data x fsdp x tensor = {cfg.data} x {cfg.fsdp} x {cfg.tensor} "
                      f"does not match the {n} available devices (set mesh.data=-1 to use "
                      "every device not taken by fsdp x tensor)")
  shape = (data, cfg.fsdp, cfg.tensor)
  try:
    from jax.experimental import mesh_utils
    arr = mesh_utils.create_device_mesh(shape, devices=devs)
  except Exception:  # CPU / unusual topologies: plain row-major order
    arr = np.asarray(devs).reshape(shape)
  return Mesh(arr, AXES)


def batch_shards(mesh: Mesh) -> int:
  return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def check_batch(mesh: Mesh, batch_size: int, microbatches: int) -> None:
  """A microbatch must split evenly over the data x fsdp devices and over processes."""
  mb = batch_size // microbatches
  n = batch_shards(mesh)
  if mb % n:
    raise ConfigError(
        f"data.batch_size / data.microbatches = {batch_size} / {microbatches} = {mb} sequences "
        f"per microbatch do not divide across the {n} batch shards (mesh data x fsdp = "
        f"{mesh.shape['data']} x {mesh.shape['fsdp']}); choose a microbatch size that is a "
        f"multiple of {n}")
  if mb % jax.process_count():
    raise ConfigError(f"microbatch size {mb} does not divide across {jax.process_count()} "
                      "processes")


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of a ``[m, b, T+1]`` token batch."""
  return NamedSharding(mesh, P(None, BATCH_AXES, None))


def replicated(mesh: Mesh) -> NamedSharding:
  """Every device holds the whole array (small outputs the host reads, e.g. eval losses)."""
  return NamedSharding(mesh, P())


def param_shardings(mesh: Mesh, params_shape: Any, rules: Callable) -> Any:
  """NamedSharding per parameter from ``rules(path, shape) -> logical axes``."""
  return jax.tree_util.tree_map_with_path(
      lambda p, x: NamedSharding(mesh, mesh_spec(mesh, rules(p, x.shape), x.shape)),
      params_shape)


def _with_data(mesh: Mesh, sh: NamedSharding, shape: tuple, axis: str = "data") -> NamedSharding:
  """``sh`` further split over ``axis`` (``data``): on the first dimension no axis splits that
  ``axis`` divides, else the first split one whose shard ``axis`` divides; unchanged when none
  does (or ``sh`` already uses ``axis``)."""
  n = int(mesh.shape[axis])
  spec = list(sh.spec) + [None] * (len(shape) - len(sh.spec))
  used = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
  if n == 1 or any(axis in u for u in used):
    return sh
  for i in sorted(range(len(shape)), key=lambda i: bool(used[i])):  # unsplit dimensions first
    if shape[i] % (n * int(np.prod([mesh.shape[a] for a in used[i]]))) == 0:
      spec[i] = (*used[i], axis) if used[i] else axis
      return NamedSharding(mesh, P(*spec))
  return sh


def optimizer_shardings(mesh: Mesh, params_shape: Any, param_sh: Any, shard: bool) -> Any:
  """Per parameter, the layout of its optimizer-state leaves and of its update in the step.

  ``shard=False``: the parameter's own sharding (under pure data parallelism every device
  holds all of the state). ``shard=True`` (``mesh.shard_optimizer``, ZeRO-1): additionally split
  over ``data`` (``_with_data``), so each of the n data-parallel devices keeps 1/n of the
  state, updates only its slice of the parameters, and the step all-gathers the new
  parameters back to ``param_sh``."""
  if not shard:
    return param_sh
  return jax.tree.map(lambda x, sh: _with_data(mesh, sh, tuple(x.shape)), params_shape, param_sh)


def spread_stacked(tree: Any, params: Any, param_sh: Any, mesh: Mesh, axis: str = "data") -> Any:
  """Inside jit: stacked per-microbatch outputs ``[m, ...]`` (the microbatch axis split over
  ``axis``) resharded so that each device holds all m microbatches of one slice of every leaf:
  a leaf mirroring a parameter takes that parameter's layout split over ``axis`` too
  (``_with_data``: for ``data`` the ZeRO-1 layout, for ``fsdp`` the parameter's own; the
  optimizer then updates its slice in place), any other leaf its first dimension that
  ``axis`` divides. One all-to-all per leaf that splits; a leaf with no such dimension
  (scalars: losses, counts) is all-gathered whole, all m of it on every device."""
  pick = _mirror(params, param_sh)
  replicated = NamedSharding(mesh, P())

  def one(path, x):
    shape = tuple(x.shape[1:])
    base = pick(path, jax.ShapeDtypeStruct(shape, x.dtype)) or replicated
    spec = _with_data(mesh, base, shape, axis).spec
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, *spec)))

  return jax.tree_util.tree_map_with_path(one, tree)


def _mirror(params_shape: Any, param_sh: Any) -> Callable:
  """``pick(path, x)``: the sharding of the parameter whose path ends ``path`` (optax states
  and the collector's statistics nest the parameter tree) and whose shape is ``x``'s; None if
  there is none."""
  flat = jax.tree_util.tree_flatten_with_path(params_shape)[0]
  table = {tuple(str(k) for k in path): (tuple(x.shape), sh)
           for (path, x), sh in zip(flat, jax.tree.leaves(param_sh))}
  depth = max((len(k) for k in table), default=0)

  def pick(path, x):
    keys = tuple(str(k) for k in path)
    for n in range(min(depth, len(keys)), 0, -1):
      hit = table.get(keys[-n:])
      if hit is not None and hit[0] == tuple(getattr(x, "shape", ())):
        return hit[1]
    return None

  return pick


def pin_to_params(tree: Any, params: Any, param_sh: Any) -> Any:
  """Inside jit: every leaf of ``tree`` that mirrors a parameter of ``params`` (arrays or
  shapes) constrained to that parameter's sharding; other leaves untouched."""
  pick = _mirror(params, param_sh)

  def pin(path, x):
    sh = pick(path, x)
    return x if sh is None else jax.lax.with_sharding_constraint(x, sh)

  return jax.tree_util.tree_map_with_path(pin, tree)


def state_shardings(mesh: Mesh, tree_shape: Any, params_shape: Any, param_sh: Any) -> Any:
  """Shardings for any tree (optimizer state) whose leaves mirror parameters by path suffix
  (``_mirror``; replicated where none does); Shampoo's block-stacked factors
  ``[n_blocks, b, b]`` (L, R and the roots) are split on the block axis over the mesh
  (``shampoo_lib.block_sharding``), which matches no parameter."""
  pick = _mirror(params_shape, param_sh)
  replicated = NamedSharding(mesh, P())

  def pick_node(path, x):
    if isinstance(x, ShampooFactors):
      return ShampooFactors(*(block_sharding(mesh, f.shape) for f in x))
    return pick(path, x) or replicated

  return jax.tree_util.tree_map_with_path(pick_node, tree_shape,
                                          is_leaf=lambda x: isinstance(x, ShampooFactors))


def host_resident(fn: Callable, args: tuple) -> list:
  """Per output leaf of ``fn(*args)``, whether ``fn`` puts it in host memory
  (``jax.device_put(x, jax.memory.Space.Host)``, e.g. Shampoo's ``offload_statistics``), read
  from the traced output types; all False on JAX without memory spaces."""
  space = getattr(getattr(jax, "memory", None), "Space", None)
  avals = jax.make_jaxpr(fn)(*args).out_avals
  return [space is not None and getattr(a, "memory_space", None) == space.Host for a in avals]


def in_memory_of(fn: Callable, args: tuple, shardings: Any) -> Any:
  """``shardings`` (a tree matching ``fn(*args)``'s output) with ``memory_kind="pinned_host"``
  on the leaves that ``fn`` puts in host memory (``host_resident``): a jit with these out/in
  shardings keeps them there between steps."""
  host = host_resident(fn, args)
  leaves, treedef = jax.tree.flatten(shardings)
  if len(leaves) != len(host):
    raise ValueError(f"in_memory_of: {len(leaves)} shardings for {len(host)} outputs")
  return treedef.unflatten([s.with_memory_kind("pinned_host") if h else s
                            for s, h in zip(leaves, host)])


def put_global(sharding, local: np.ndarray, global_shape: tuple) -> jax.Array:
  """One global array from each process's rows ``local`` (its part of ``global_shape``)."""
  return jax.make_array_from_process_local_data(sharding, local, global_shape)
