"""tokamax's ops (models/tokamax_ops.py) against today's path, per coordinate, on the CPU: its
XLA reference implementations (``tokamax_xla``) for attention, the SwiGLU gate and the RMS
norm, forward and gradients, alone and inside the model, on one device and under the FSDP and
tensor meshes of simulated devices; the settings' checks. The GPU kernels (Mosaic, Triton)
are compared in tests/models/test_kernels_gpu.py."""

import json
import pathlib
import subprocess
import types
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaleopt import models
from scaleopt.models import layers, tokamax_ops

from models_testlib import tiny, tokens, rel_err, vjp_random

pytest.importorskip("tokamax")  # a dev dependency: absent only where the dev extra is not
ROOT = pathlib.Path(__file__).resolve().parents[2]




# float32: both paths do the same arithmetic up to reordering; bfloat16: inputs in bf16, each
# path rounds its outputs and intermediates to bf16 (8 bits) in its own places.
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 3e-2}


def _assert_close(got, dgot, want, dwant, tol):
  """The output and every input's cotangent within ``tol`` relative error."""
  assert rel_err(got, want) < tol
  for a, b in zip(dgot, dwant):
    assert rel_err(a, b) < tol


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_attention_matches_xla(dtype):
  k = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(k[0], (2, 24, 4, 16)).astype(dtype)  # 4 query heads on 2 kv heads
  kk = jax.random.normal(k[1], (2, 24, 2, 16)).astype(dtype)
  v = jax.random.normal(k[2], (2, 24, 2, 16)).astype(dtype)
  got, dgot = vjp_random(lambda *a: tokamax_ops.attention(*a, "tokamax_xla"), q, kk, v)
  want, dwant = vjp_random(lambda *a: layers.causal_attention(*a, "xla"), q, kk, v)
  assert got.dtype == dtype
  _assert_close(got, dgot, want, dwant, TOL[dtype])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_glu_matches_xla(dtype):
  k = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(k[0], (2, 12, 32)).astype(dtype)
  wg = (0.2 * jax.random.normal(k[1], (32, 48))).astype(dtype)
  wu = (0.2 * jax.random.normal(k[2], (32, 48))).astype(dtype)
  got, dgot = vjp_random(lambda *a: tokamax_ops.gated_linear_unit(*a, "tokamax_xla"), x, wg, wu)
  want, dwant = vjp_random(lambda x, g, u: jax.nn.silu(x @ g) * (x @ u), x, wg, wu)
  assert got.shape == (2, 12, 48) and got.dtype == dtype
  _assert_close(got, dgot, want, dwant, TOL[dtype])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_add_norm_matches_xla(dtype):
  k = jax.random.split(jax.random.key(2), 2)
  x = (3 * jax.random.normal(k[0], (2, 12, 64))).astype(dtype)
  h = jax.random.normal(k[1], (2, 12, 64)).astype(dtype)
  f = lambda kernel: (lambda x, h: layers.add_rms_norm(x, h, 1e-6, kernel)[1])
  got, dgot = vjp_random(f("tokamax_xla"), x, h)
  want, dwant = vjp_random(f(False), x, h)
  assert got.dtype == dtype
  _assert_close(got, dgot, want, dwant, TOL[dtype])


ALL_TOKAMAX = dict(attention_impl="tokamax_xla", glu_kernel="tokamax_xla",
                   norm_kernel="tokamax_xla")


@pytest.mark.parametrize("variant", ["standard", "hg"])
def test_model_loss_and_gradients_match(variant):
  """The tiny model (float32, GQA) with every tokamax op against today's XLA path: the loss
  and every parameter's gradient per coordinate."""
  base = tiny(norm_kernel="xla").with_variant(variant)
  init, _ = models.functional(base)
  params = init(jax.random.key(0))
  toks = tokens(base, b=2, t=16)
  tgt = jnp.roll(toks, -1, axis=1)

  def grads(cfg):
    fn = models.functional_loss(cfg)
    return jax.jit(jax.value_and_grad(lambda p: fn(p, toks, tgt)[0]))(params)

  (l_got, g_got), (l_want, g_want) = grads(base.replace(**ALL_TOKAMAX)), grads(base)
  assert abs(float(l_got - l_want)) < 1e-5
  for path, a in jax.tree_util.tree_leaves_with_path(g_got):
    b = _leaf(g_want, path)
    assert rel_err(a, b) < 1e-4, jax.tree_util.keystr(path)


def _leaf(tree, path):
  for p in path:
    tree = tree[p.key]
  return tree


def test_settings_and_checks_on_cpu():
  cfg = models.ModelConfig(**ALL_TOKAMAX)
  assert models.kernel_problem(cfg) is None  # the XLA references run anywhere
  assert models.kernel_choices(cfg) == {"attention": "tokamax_xla", "loss": "xla",
                                        "norm": "tokamax_xla", "glu": "tokamax_xla"}
  assert models.kernel_choices(models.ModelConfig(dtype="float32")) == {
      "attention": "xla", "loss": "xla", "norm": "xla", "glu": "xla"}  # today's path on CPU
  for key in ("attention_impl", "glu_kernel"):
    problem = models.kernel_problem(models.ModelConfig(**{key: "tokamax_mosaic"}))
    assert problem.startswith(f"model.{key}=tokamax_mosaic runs on NVIDIA GPUs only")
    assert "\n" not in problem
  with pytest.raises(ValueError, match="glu_kernel"):
    models.ModelConfig(glu_kernel="mosaic")
  with pytest.raises(ValueError, match="norm_kernel"):
    models.ModelConfig(norm_kernel="tokamax_mosaic")  # tokamax has no Mosaic norm
  with pytest.raises(ValueError, match="dual='dnp' normalizes gate and up"):
    models.ModelConfig(glu_kernel="tokamax_xla").with_variant("dnp")
  models.ModelConfig(glu_kernel="tokamax_xla", dual="dnp", dual_targets=("q", "k", "v"))
  with pytest.raises(ValueError, match="model.attention_impl=tokamax_triton runs on NVIDIA"):
    tokamax_ops.attention(*(jnp.zeros((1, 8, 2, 8)),) * 3, "tokamax_triton")


def test_missing_tokamax_is_one_line(monkeypatch):
  monkeypatch.setattr(tokamax_ops, "installed", lambda: False)
  problem = models.kernel_problem(models.ModelConfig(norm_kernel="tokamax_xla"))
  assert problem.startswith("model.norm_kernel=tokamax_xla needs the tokamax package")
  assert models.kernel_problem(models.ModelConfig()) is None  # today's path needs none


def test_kernels_that_do_not_run_on_the_installed_jax_are_refused(monkeypatch):
  """On jax 0.11, tokamax 0.0.12's Mosaic kernels and Triton attention / GLU fail while they
  trace (removed Pallas APIs); its Triton norm and XLA references run. A GPU device is stood in
  by an object with the attributes ``check`` reads."""
  run = tokamax_ops.runs_on_this_jax
  assert not run("attention_impl", "mosaic", "0.0.12", "0.11.2")
  assert not run("attention_impl", "triton", "0.0.12", "0.11.0rc1")
  assert not run("glu_kernel", "triton", "0.0.11", "0.12.0")
  assert run("norm_kernel", "triton", "0.0.12", "0.11.2")
  assert run("attention_impl", "xla", "0.0.12", "0.11.2")
  assert run("attention_impl", "mosaic", "0.0.12", "0.10.2")
  assert run("attention_impl", "mosaic", "0.0.13", "0.11.2")
  gpu = types.SimpleNamespace(platform="gpu", compute_capability="9.0", device_kind="H100")
  monkeypatch.setattr(tokamax_ops.jax, "__version__", "0.11.2")
  problem = tokamax_ops.check("attention_impl", "tokamax_mosaic", gpu)
  assert problem.startswith("model.attention_impl=tokamax_mosaic: tokamax ")
  assert "do not run on jax 0.11.2" in problem and "\n" not in problem
  assert tokamax_ops.check("norm_kernel", "tokamax_triton", gpu) is None


@pytest.mark.integration
def test_cli_refuses_a_kernel_the_device_lacks(tmp_path):
  """`scaleopt train` with a GPU-only kernel on the CPU: exit 2, one line naming the key."""
  out = subprocess.run(
      [sys.executable, "-m", "scaleopt.cli", "train", "--config", "tiny", "--out",
       str(tmp_path / "run"), "--set", "model.attention_impl=tokamax_mosaic",
       "--set", "run.steps=1"], cwd=ROOT, capture_output=True, text=True, timeout=300,
      env={"PYTHONPATH": str(ROOT), "PATH": "", "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 2, out.stderr[-2000:]
  lines = [l for l in out.stderr.splitlines() if l.strip() and not l.startswith("note:")]
  assert len(lines) == 1 and "model.attention_impl=tokamax_mosaic" in lines[0], lines
  assert not (tmp_path / "run" / "checkpoints").exists()


MESH_SCRIPT = r"""
import json, os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"  # 4 simulated devices, also on a GPU machine
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
from scaleopt import models
from scaleopt.models import sharding

base = models.get_preset("tiny").replace(dtype="float32", attention_impl="xla",
                                         norm_kernel="xla", n_heads=4, n_kv_heads=2)
tk = base.replace(attention_impl="tokamax_xla", glu_kernel="tokamax_xla",
                  norm_kernel="tokamax_xla")
params = models.functional(base)[0](jax.random.key(0))
toks = jax.random.randint(jax.random.key(1), (4, 16), 0, base.vocab_size)
tgt = jnp.roll(toks, -1, axis=1)
devs = np.array(jax.devices())

def run(cfg, mesh):
  fn = models.functional_loss(cfg)
  def g(p):
    with sharding.constraints(mesh):
      return jax.value_and_grad(lambda p: fn(p, toks, tgt)[0])(p)
  return jax.jit(g)(params)

def diff(a, b):
  return max(float(jnp.max(jnp.abs(u - v)) / jnp.max(jnp.abs(v))) for u, v in
             zip(jax.tree.leaves(a), jax.tree.leaves(b)))

want = run(base, None)
res = {}
for name, shape, axes in (("fsdp", (4,), ("fsdp",)), ("data_fsdp", (2, 2), ("data", "fsdp")),
                          ("fsdp_tensor", (2, 2), ("fsdp", "tensor"))):
  got = run(tk, Mesh(devs.reshape(shape), axes))
  res[name] = [abs(float(got[0] - want[0])), diff(got[1], want[1])]
print("RESULT " + json.dumps(res))
"""


@pytest.mark.integration
def test_model_under_meshes():
  """On 4 simulated devices (FSDP; data x FSDP; FSDP x tensor): the model with every tokamax
  op (XLA references, per device under shard_map) gives the unsharded XLA path's loss and
  gradients."""
  out = subprocess.run([sys.executable, "-c", MESH_SCRIPT], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": ""})
  assert out.returncode == 0, out.stderr[-3000:]
  res = json.loads(out.stdout.split("RESULT ")[-1])
  for name, (loss_diff, grad_diff) in res.items():
    assert loss_diff < 1e-5 and grad_diff < 1e-4, (name, res)
