"""Residual add + RMS norm (models/layers.py add_rms_norm, models/kernels.py): the Pallas
kernels against float64 numpy and plain autodiff, in the model and under meshes. The kernels
run through the Pallas interpreter on CPU."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaleopt import models
from scaleopt.models import kernels, layers, loss, transformer

from models_testlib import tiny, tiny_moe, tokens

ROOT = pathlib.Path(__file__).resolve().parents[2]
EPS = 1e-5
INTERPRET = jax.default_backend() != "gpu"


def _inputs(dtype, n=7, d=48, seed=0):
  # 7 rows: a partial program of 4; 48 columns in a block of 64; rows of very different sizes
  # (the norm must not depend on them) and one row where h cancels x.
  k = jax.random.split(jax.random.key(seed), 4)
  size = jnp.array([1.0, 1e-2, 30.0, 1.0, 3.0, 1.0, 0.5])[:n, None]
  x = (size * jax.random.normal(k[0], (n, d))).astype(dtype)
  h = (size * jax.random.normal(k[1], (n, d))).astype(dtype)
  h = h.at[3].set(-x[3] + (0.25 * jax.random.normal(k[2], (d,))).astype(dtype))
  gs, gn = (jax.random.normal(kk, (n, d)).astype(dtype) for kk in jax.random.split(k[3]))
  return x, h, gs, gn


def _stored_sum(x, h):
  return np.asarray((x.astype(jnp.float32) + h.astype(jnp.float32)).astype(x.dtype), np.float64)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_kernel_against_float64(dtype):
  x, h, _, _ = _inputs(dtype)
  s, n, r = jax.jit(lambda x, h: kernels.add_rms_norm_fwd(x, h, eps=EPS, interpret=INTERPRET))(
      x, h)
  want_s = _stored_sum(x, h)
  want_r = 1.0 / np.sqrt((want_s ** 2).mean(-1) + EPS)
  want_n = want_s * want_r[:, None]
  assert s.dtype == n.dtype == dtype and r.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(s, np.float64), want_s)
  np.testing.assert_allclose(r, want_r, rtol=2e-6)
  n = np.asarray(n, np.float64)
  if dtype == jnp.float32:
    np.testing.assert_allclose(n, want_n, rtol=2e-6, atol=1e-12)
  else:  # n rounded once to bf16: at most half an ulp (2^-8 relative) plus float32 error
    assert np.all(np.abs(n - want_n) <= (2.0**-8 + 1e-5) * np.abs(want_n) + 1e-30)


def _numeric_vjp(x, h, gs, gn):
  """Cotangent of x for (s, n) = (x + h, Norm(x + h)) by central differences in float64."""
  x, h = np.asarray(x, np.float64), np.asarray(h, np.float64)
  gs, gn = np.asarray(gs, np.float64), np.asarray(gn, np.float64)

  def f(x):  # <g_s, s> + <g_n, n> per row
    s = x + h
    n = s / np.sqrt((s ** 2).mean(-1, keepdims=True) + EPS)
    return (gs * s).sum(-1) + (gn * n).sum(-1)

  out = np.zeros_like(x)
  for j in range(x.shape[1]):
    step = 1e-6 * np.maximum(np.abs(x[:, j]), 1e-3)
    e = np.zeros_like(x)
    e[:, j] = step
    out[:, j] = (f(x + e) - f(x - e)) / (2 * step)
  return out


def test_backward_kernel_against_finite_differences():
  x, h, gs, gn = _inputs(jnp.float32)
  s, _, r = kernels.add_rms_norm_fwd(x, h, eps=EPS, interpret=INTERPRET)
  g = jax.jit(lambda *a: kernels.add_rms_norm_bwd(*a, interpret=INTERPRET))(gs, gn, s, r)
  np.testing.assert_allclose(g, _numeric_vjp(x, h, gs, gn), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_vjp_with_kernel_equals_plain_autodiff(dtype):
  x, h, gs, gn = _inputs(dtype, seed=1)
  outs = {}
  for kernel in (False, True):
    (s, n), vjp = jax.vjp(lambda x, h, k=kernel: layers.add_rms_norm(x, h, EPS, k), x, h)
    outs[kernel] = (s, n, *vjp((gs, gn)))
  names = ("s", "n", "g_x", "g_h")
  for name, a, b in zip(names, outs[True], outs[False]):
    assert a.dtype == b.dtype == dtype, name
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if dtype == jnp.float32:
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-5 * np.abs(b).max(), err_msg=name)
    else:  # both round once to bf16 from float32 work that differs in order
      assert np.all(np.abs(a - b) <= 2.0**-7 * np.abs(b) + 2e-3 * np.abs(b).max()), name


@pytest.mark.parametrize("cfg", [
    tiny(), pytest.param(tiny_moe(post_norm=True, qkv_bias=True), marks=pytest.mark.integration)],
                         ids=["dense", "moe_post_norm"])
def test_model_loss_and_gradients_with_kernel(cfg):
  params = models.functional(cfg)[0](jax.random.key(0))
  tok = tokens(cfg, b=2, t=16)
  x, tgt = tok[:, :-1], tok[:, 1:]
  out = {}
  for k in ("xla", "pallas"):
    f = lambda p, k=k: models.functional_loss(cfg.replace(norm_kernel=k))(p, x, tgt)[0]
    if k == "pallas":
      jaxpr = str(jax.make_jaxpr(jax.grad(f))(params))
      assert "add_rms_norm_fwd" in jaxpr and "add_rms_norm_bwd" in jaxpr
    out[k] = jax.jit(jax.value_and_grad(f))(params)
  np.testing.assert_allclose(out["pallas"][0], out["xla"][0], rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4,
                                                       atol=1e-6 * np.abs(b).max()),
               out["pallas"][1], out["xla"][1])


def test_use_norm_kernel_settings():
  assert not transformer.use_norm_kernel("auto", jnp.bfloat16, backend="cpu")  # XLA's ops
  assert not transformer.use_norm_kernel("auto", jnp.bfloat16, backend="tpu")
  assert transformer.use_norm_kernel("auto", jnp.bfloat16, backend="gpu")
  assert transformer.use_norm_kernel("auto", jnp.float16, backend="gpu")
  assert not transformer.use_norm_kernel("auto", jnp.float32, backend="gpu")
  assert transformer.use_norm_kernel("pallas", jnp.float32)
  assert not transformer.use_norm_kernel("xla", jnp.bfloat16, backend="gpu")
  with pytest.raises(ValueError, match="norm_kernel"):
    models.ModelConfig(norm_kernel="triton")


def test_without_the_triton_backend_auto_is_xla(monkeypatch):
  monkeypatch.setattr(kernels, "plgpu", None)  # a JAX without jax.experimental.pallas.triton
  assert not transformer.use_norm_kernel("auto", jnp.bfloat16, backend="gpu")
  assert not loss.use_kernel("auto", jnp.bfloat16, backend="gpu")
  x = jnp.ones((4, 8), jnp.bfloat16)
  with pytest.raises(RuntimeError, match="norm_kernel to xla or auto"):
    kernels.add_rms_norm_fwd(x, x, eps=EPS, interpret=True)


MESH_SCRIPT = r"""
import json, os, re
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"  # 4 simulated devices, also on a GPU machine
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
from scaleopt.models import layers, sharding

k = jax.random.split(jax.random.key(0), 4)
x, h, gs, gn = (jax.random.normal(kk, (4, 12, 32)) for kk in k)
devs = np.array(jax.devices())

def fn(kernel, mesh=None, micro=False):
  def one(x, h, gs, gn):
    (s, n), vjp = jax.vjp(lambda x, h: layers.add_rms_norm(x, h, 1e-5, kernel), x, h)
    return (s, n) + vjp((gs, gn))
  def f(*a):
    with sharding.constraints(mesh):
      a = [sharding.constrain(t, ("batch", None, None)) for t in a]  # the model's layout
      if not micro:
        return one(*a)
      with sharding.microbatch_axis("data"):  # each data shard one microbatch
        split = lambda a: a.reshape(2, 2, *a.shape[1:])
        out = jax.vmap(one, spmd_axis_name="data")(*map(split, a))
      return tuple(o.reshape(x.shape) for o in out)
  return jax.jit(f).lower(x, h, gs, gn).compile()

ref = fn(False)(x, h, gs, gn)
res = {}
for name, mesh, micro in (("one", None, False),
                          ("data_fsdp", Mesh(devs.reshape(2, 2), ("data", "fsdp")), False),
                          ("micro", Mesh(devs.reshape(2, 2), ("data", "fsdp")), True),
                          ("tensor", Mesh(devs.reshape(2, 2), ("data", "tensor")), False)):
  c = fn(True, mesh, micro)
  out, hlo = c(x, h, gs, gn), c.as_text()
  res[name] = [max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(out, ref)),
               "add_rms_norm_bwd" in hlo,  # the kernels (interpreted) are in the program
               # and no collective: each device works on its own rows
               len(re.findall(r"(?:all-gather|all-reduce|collective-permute|all-to-all|"
                              r"reduce-scatter)(?:-start)?\(", hlo))]
print("RESULT " + json.dumps(res))
"""


@pytest.mark.integration
def test_kernels_under_meshes():
  """On 4 simulated devices: the kernels per device on their rows (data x fsdp, microbatches
  vmapped over the data axis, data x tensor) give XLA's values and cotangents without any
  collective."""
  out = subprocess.run([sys.executable, "-c", MESH_SCRIPT], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": ""})
  assert out.returncode == 0, out.stderr[-3000:]
  res = json.loads(out.stdout.split("RESULT ")[-1])
  for name, (diff, has_kernel, collectives) in res.items():
    assert diff < 1e-5 and has_kernel and collectives == 0, (name, res)
