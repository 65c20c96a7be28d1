"""Kernels from tokamax (Google DeepMind's Pallas kernel library), an optional dependency.

Three model settings pick a tokamax implementation by name (``ModelConfig``):

* ``attention_impl``: ``tokamax_mosaic`` (Mosaic GPU flash attention with its own backward
  kernels; Hopper and newer), ``tokamax_triton`` (Pallas Triton flash attention),
  ``tokamax_xla`` (tokamax's XLA reference: any device). Causal, grouped-query heads.
* ``glu_kernel``: ``silu(n W_gate) * (n W_up)`` of the dense SwiGLU MLP as one fused kernel
  (``tokamax_mosaic``: Hopper and newer; ``tokamax_triton``; ``tokamax_xla``); the down
  projection stays an XLA matmul.
* ``norm_kernel``: ``tokamax_triton`` / ``tokamax_xla``: the RMS norm of each residual add
  (``s = x + h`` by XLA, then tokamax's ``layer_norm(s, subtract_mean=False)``).

Under a mesh (:func:`scaleopt.models.sharding.constraints`) each op runs per device on its own
rows (``shard_map`` over the batch axes); attention also splits its heads over ``tensor``
when both the query and key/value head counts divide it, and the GLU takes its kernels split
over ``tensor`` on the hidden axis (each device computes its own hidden columns).

:func:`check` says in one line why a chosen implementation cannot run on a device (tokamax
not installed, no GPU, a GPU older than Hopper for Mosaic).
"""

from __future__ import annotations

import functools
import importlib.util

import jax
from jax.sharding import PartitionSpec as P

from scaleopt.models import sharding

PREFIX = "tokamax_"
ATTENTION = ("tokamax_mosaic", "tokamax_triton", "tokamax_xla")
GLU = ("tokamax_mosaic", "tokamax_triton", "tokamax_xla")
NORM = ("tokamax_triton", "tokamax_xla")


def installed() -> bool:
  return importlib.util.find_spec("tokamax") is not None


def _tokamax():
  """The tokamax module. Its options are absl flags that it would otherwise parse from
  ``sys.argv`` on first use (failing on any other program's arguments): they are marked
  parsed, so they keep their defaults."""
  import tokamax  # pylint: disable=import-outside-toplevel
  from absl import flags  # pylint: disable=import-outside-toplevel
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  return tokamax


def _release(version: str) -> tuple[int, ...]:
  """``"0.11.2"`` -> ``(0, 11, 2)`` (a suffix such as ``.dev1`` or ``rc1`` is dropped)."""
  out = []
  for part in version.split(".")[:3]:
    digits = "".join(c for c in part if c.isdigit()) if part[:1].isdigit() else ""
    if not digits:
      break
    out.append(int(digits))
  return tuple(out)


def runs_on_this_jax(key: str, impl: str, tokamax_version: str, jax_version: str) -> bool:
  """Whether tokamax's ``impl`` kernel for ``key`` runs with this jax. Releases up to 0.0.12
  build their Mosaic GPU kernels with ``plgpu.kernel(out_shape=...)`` and their Triton
  attention and GLU with ``pl.dot`` and ``jax.core.DropVar``, which jax 0.11 removed; their
  Triton norm and XLA references use neither."""
  if impl == "xla" or (impl == "triton" and key == "norm_kernel"):
    return True
  return not (_release(tokamax_version) <= (0, 0, 12) and _release(jax_version) >= (0, 11))


def implementation(setting: str) -> str:
  """tokamax's name of the implementation a setting names (``tokamax_mosaic`` -> ``mosaic``)."""
  return setting[len(PREFIX):]


def check(key: str, setting: str, device: jax.Device | None = None) -> str | None:
  """Why ``model.<key>: <setting>`` cannot run on ``device`` (default: the first device), as
  one line; None when it can or the setting is not a tokamax one."""
  if not setting.startswith(PREFIX):
    return None
  if not installed():
    return (f"model.{key}={setting} needs the tokamax package (pip install "
            f"'scaleopt[gpu]'); it is not installed")
  impl = implementation(setting)
  if impl == "xla":
    return None
  device = device or jax.devices()[0]
  if device.platform != "gpu":
    return (f"model.{key}={setting} runs on NVIDIA GPUs only; this device is "
            f"{device.platform} (use auto, xla or tokamax_xla)")
  version = _tokamax().__version__
  if not runs_on_this_jax(key, impl, version, jax.__version__):
    return (f"model.{key}={setting}: tokamax {version}'s {impl} kernels do not run on jax "
            f"{jax.__version__} (Pallas APIs they use were removed in jax 0.11); use auto, or a "
            f"tokamax release built for this jax")
  cc = float(getattr(device, "compute_capability", 0) or 0)
  if impl == "mosaic" and cc < 9.0:
    return (f"model.{key}={setting} needs a Hopper or newer GPU (compute capability >= 9.0); "
            f"this device ({device.device_kind}) has {cc} (use tokamax_triton)")
  return None


def _require(key: str, setting: str):
  """tokamax, or ValueError with :func:`check`'s line."""
  problem = check(key, setting)
  if problem is not None:
    raise ValueError(problem)
  return _tokamax()


def _batch(mesh, n: int):
  return sharding.mesh_spec(mesh, ("batch",), (n,))[0]


def _tensor_axis(mesh, *dims: int):
  """``tensor`` when that mesh axis has size > 1 and divides every dim, else None."""
  size = int(mesh.shape["tensor"]) if "tensor" in mesh.shape else 1
  return "tensor" if size > 1 and all(d % size == 0 for d in dims) else None


def attention(q: jax.Array, k: jax.Array, v: jax.Array, setting: str) -> jax.Array:
  """Causal ``softmax(q k^T / sqrt(d_head)) v`` on ``[B, T, heads, d_head]`` arrays (k, v
  with the key/value heads, each serving ``heads / kv_heads`` query heads) by tokamax's
  ``dot_product_attention``."""
  fn = functools.partial(_require("attention_impl", setting).dot_product_attention, is_causal=True,
                         implementation=implementation(setting))
  mesh = sharding.current_mesh()
  if mesh is None:
    return fn(q, k, v)
  spec = P(_batch(mesh, q.shape[0]), None, _tensor_axis(mesh, q.shape[2], k.shape[2]), None)
  return jax.shard_map(fn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                       check_vma=False)(q, k, v)


def gated_linear_unit(x: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                      setting: str) -> jax.Array:
  """``silu(x W_gate) * (x W_up)`` for x ``[B, T, d]`` and kernels ``[d, f]`` in x's dtype
  (already gathered over ``fsdp`` for use) by tokamax's ``gated_linear_unit``."""
  glu = functools.partial(_require("glu_kernel", setting).gated_linear_unit, activation=jax.nn.silu,
                          implementation=implementation(setting))

  def local(x, wg, wu):
    b, t, d = x.shape
    return glu(x.reshape(b * t, d), (wg, wu)).reshape(b, t, -1)

  mesh = sharding.current_mesh()
  if mesh is None:
    return local(x, w_gate, w_up)
  tensor = _tensor_axis(mesh, w_gate.shape[-1])
  xs, ws = P(_batch(mesh, x.shape[0]), None, None), P(None, tensor)
  return jax.shard_map(local, mesh=mesh, in_specs=(xs, ws, ws),
                       out_specs=P(xs[0], None, tensor), check_vma=False)(x, w_gate, w_up)


def rms_norm(s: jax.Array, eps: float, setting: str) -> jax.Array:
  """``s / sqrt(mean(s^2, -1) + eps)`` (float32 arithmetic, s's dtype) by tokamax's
  ``layer_norm(..., subtract_mean=False)`` without scale or offset, per device on its rows
  under a mesh."""
  norm = functools.partial(_require("norm_kernel", setting).layer_norm, scale=None,
                           offset=None, epsilon=eps, subtract_mean=False,
                           implementation=implementation(setting))
  return sharding.on_rows(norm, s)
