"""Fused LM head + cross-entropy (models/loss.py, models/kernels.py) against float64 numpy and
plain autodiff. The Pallas kernel runs through the Pallas interpreter on CPU."""

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaleopt import models
from scaleopt.models import kernels, loss

from models_testlib import tiny, tokens

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _problem(seed, b=3, t=8, d=16, v=40, dtype=jnp.float32):
  k = jax.random.split(jax.random.key(seed), 4)
  h = jax.random.normal(k[0], (b, t, d), jnp.float32).astype(dtype)
  w = (0.5 * jax.random.normal(k[1], (d, v), jnp.float32)).astype(dtype)
  y = jax.random.randint(k[2], (b, t), 0, v)
  c = jax.random.normal(k[3], (b, t), jnp.float32)  # a cotangent per token
  return h, w, y, c


def _numpy_nll(h, w, y):
  z = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
  m = z.max(-1, keepdims=True)
  lse = np.log(np.exp(z - m).sum(-1)) + m[..., 0]
  return lse - np.take_along_axis(z, np.asarray(y)[..., None], -1)[..., 0]


def _plain_nll(h, w, y):  # plain autodiff reference: f32 logits, jax.nn.logsumexp
  z = jnp.einsum("btd,dv->btv", h, w).astype(jnp.float32)
  return jax.nn.logsumexp(z, -1) - jnp.take_along_axis(z, y[..., None], -1)[..., 0]


@pytest.mark.parametrize("chunks,kernel", [(1, False), (4, False), (1, True)])
def test_per_token_values_and_gradients(chunks, kernel):
  h, w, y, c = _problem(0)
  nll, vjp = jax.vjp(jax.jit(lambda a, b: models.head_nll(a, b, y, chunks, kernel)), h, w)
  np.testing.assert_allclose(nll, _numpy_nll(h, w, y), rtol=1e-5, atol=1e-5)
  ref, ref_vjp = jax.vjp(jax.jit(lambda a, b: _plain_nll(a, b, y)), h, w)
  for got, want in zip(vjp(c), ref_vjp(c)):  # per coordinate, random per-token cotangents
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # one token at a time: its cotangent reaches only its own row of dh
  one = jnp.zeros_like(c).at[1, 3].set(1.0)
  dh, _ = vjp(one)
  assert float(jnp.abs(dh).sum()) == float(jnp.abs(dh[1, 3]).sum()) > 0


def test_masked_mean_matches_lm_loss_and_bf16_close():
  h, w, y, _ = _problem(1)
  mask = (jax.random.uniform(jax.random.key(7), y.shape) < 0.6).astype(jnp.float32)
  plain = lambda a, b: models.lm_loss(jnp.einsum("btd,dv->btv", a, b), y, mask)
  for chunks in (1, 2):
    fused = lambda a, b: models.head_loss(a, b, y, mask, chunks)
    (lf, gf), (lp, gp) = [jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(h, w)
                          for f in (fused, plain)]
    np.testing.assert_allclose(lf, lp, rtol=1e-6)
    for a, b in zip(gf, gp):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  # bf16 inputs: same bf16 logits and bf16 logit gradients as the plain path up to rounding
  hb, wb = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  plain_b = lambda a, b: models.lm_loss(
      jnp.einsum("btd,dv->btv", a, b).astype(jnp.float32), y, mask)
  (lf, gf), (lp, gp) = [jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(hb, wb) for f in
                        (lambda a, b: models.head_loss(a, b, y, mask), plain_b)]
  assert gf[0].dtype == jnp.bfloat16 and gf[1].dtype == jnp.bfloat16
  np.testing.assert_allclose(lf, lp, rtol=1e-6)
  for a, b in zip(gf, gp):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b)


@pytest.mark.integration  # slow to compile on CPU: the second tier
def test_model_loss_equals_lm_loss_of_logits():
  cfg = tiny()
  init, apply = models.functional(cfg)
  params = init(jax.random.key(0))
  tok = tokens(cfg, b=2, t=16)
  x, tgt = tok[:, :-1], tok[:, 1:]
  plain = lambda p: models.lm_loss(apply(p, x)[0], tgt)
  fused = lambda p: models.functional_loss(cfg.replace(loss_chunks=3))(p, x, tgt)[0]
  (lf, gf), (lp, gp) = [jax.jit(jax.value_and_grad(f))(params) for f in (fused, plain)]
  np.testing.assert_allclose(lf, lp, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), gf, gp)
  unfused = jax.jit(models.functional_loss(cfg.replace(fused_loss=False)))(params, x, tgt)[0]
  np.testing.assert_allclose(unfused, lp, rtol=1e-7)
  # the model's loss through the Pallas kernel (interpreted on CPU)
  kern = lambda p: models.functional_loss(cfg.replace(loss_kernel="pallas"))(p, x, tgt)[0]
  assert "xent_rows" in str(jax.make_jaxpr(jax.grad(kern))(params))
  lk, gk = jax.jit(jax.value_and_grad(kern))(params)
  np.testing.assert_allclose(lk, lp, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), gk, gp)


def _numpy_rows(z, y):
  z = np.asarray(z, np.float64)
  m = z.max(-1, keepdims=True)
  lse = np.log(np.exp(z - m).sum(-1)) + m[:, 0]
  d = np.exp(z - lse[:, None])
  d[np.arange(len(y)), y] -= 1.0
  return lse - z[np.arange(len(y)), y], d


@pytest.mark.parametrize("dtype, width, block, lanes", [
    (jnp.float32, 1000, 256, 16), (jnp.bfloat16, 1000, 256, 16), (jnp.bfloat16, 300, 512, 16),
    (jnp.float32, 1000, 256, 1)])
def test_kernel_rows_against_float64(dtype, width, block, lanes):
  # 1000 columns in blocks of 256: three whole blocks and a partial one whose last lane is
  # all padding; 300 columns in one block of 512: lanes that are padding from the start;
  # targets on the first and last column and on both sides of a block boundary; rows shifted
  # by up to +-300 (the online max must keep exp in range) and one row of ties.
  z = 8.0 * jax.random.normal(jax.random.key(3), (7, width), jnp.float32)
  z = (z + jnp.array([0.0, 300.0, -300.0, 0.0, 50.0, 0.0, 0.0])[:, None]).at[5].set(1.0)
  z = z.astype(dtype)
  y = np.array([0, 999, 255, 256, 511, 3, 768]) % width
  y[1] = width - 1
  interpret = jax.default_backend() != "gpu"  # the Pallas interpreter off GPU
  # z * 1: a buffer of the jitted function's own for the kernel to write d over
  nll, d = jax.jit(lambda z: kernels.xent_rows(z * 1, y, block=block, lanes=lanes,
                                               interpret=interpret))(z)
  want_nll, want_d = _numpy_rows(z, y)
  assert d.dtype == dtype and nll.dtype == jnp.float32
  np.testing.assert_allclose(nll, want_nll, rtol=1e-6, atol=2e-5)
  d = np.asarray(d, np.float64)
  if dtype == jnp.float32:  # exp(z - lse) at |z| ~ 300: relative error ~ 300 x float32 eps
    np.testing.assert_allclose(d, want_d, rtol=5e-5, atol=1e-7)
  else:  # d rounded once to bf16 (7 fraction bits): at most half an ulp, 2^-8 relative
    assert np.all(np.abs(d - want_d) <= (2.0**-8 + 5e-5) * np.abs(want_d) + 1e-30)


def test_use_kernel_settings():
  assert not loss.use_kernel("auto", jnp.bfloat16, backend="cpu")  # CPU: XLA's form
  assert loss.use_kernel("auto", jnp.bfloat16, backend="gpu")
  assert not loss.use_kernel("auto", jnp.float32, backend="gpu")  # 16-bit dtypes only
  assert not loss.use_kernel("auto", jnp.bfloat16, chunks=2, backend="gpu")
  assert loss.use_kernel("pallas", jnp.float32) and not loss.use_kernel("xla", jnp.bfloat16)
  with pytest.raises(ValueError, match="loss_kernel"):
    models.ModelConfig(loss_kernel="triton")
  with pytest.raises(ValueError, match="loss_kernel='pallas' needs loss_chunks=1, got 2"):
    models.ModelConfig(loss_kernel="pallas", loss_chunks=2)


MESH_SCRIPT = r"""
import json, os, re
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"  # 4 simulated devices, also on a GPU machine
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
from scaleopt.models import loss, sharding

k = jax.random.split(jax.random.key(0), 4)
h = jax.random.normal(k[0], (4, 12, 32))  # 48 rows of 256 logits
w = 0.5 * jax.random.normal(k[1], (32, 256))
y = jax.random.randint(k[2], (4, 12), 0, 256)
mask = (jax.random.uniform(k[3], (4, 12)) < 0.7).astype(jnp.float32)
devs = np.array(jax.devices())
mesh = Mesh(devs.reshape(2, 2), ("data", "fsdp"))

def grad_fn(kernel, mesh=None, micro=False):
  def one(h, y, m):
    return jax.value_and_grad(lambda h, w: loss.head_loss(h, w, y, m, kernel=kernel),
                              argnums=(0, 1))(h, w)
  def g(h, y, m):
    with sharding.constraints(mesh):
      if not micro:
        return one(h, y, m)
      with sharding.microbatch_axis("data"):  # each data shard one microbatch
        split = lambda a: a.reshape(2, 2, *a.shape[1:])
        ls, (dh, dw) = jax.vmap(one, spmd_axis_name="data")(split(h), split(y), split(m))
      return jnp.mean(ls), (dh.reshape(h.shape) / 2, jnp.mean(dw, 0))
  return jax.jit(g).lower(h, y, mask).compile()

def diff(a, b):  # largest per-coordinate difference over every leaf, relative to its leaf's scale
  return max(float(jnp.max(jnp.abs(u - v)) / jnp.max(jnp.abs(v))) for u, v in
             zip(jax.tree.leaves(a), jax.tree.leaves(b)))

res = {}
for name, fn, ref in (("pallas", grad_fn(True), grad_fn(False)),
                      ("pallas_mesh", grad_fn(True, mesh), grad_fn(False)),
                      ("pallas_micro", grad_fn(True, mesh, True), grad_fn(False, None, True))):
  out, want = fn(h, y, mask), ref(h, y, mask)
  hlo = fn.as_text()
  gathers = re.findall(r"\[[0-9,]*\b(?:12|48),256\]\S* all-gather(?:-start)?\(", hlo)
  res[name] = [abs(float(out[0] - want[0])), diff(out[1], want[1]),
               hlo.count("xent_rows") > 0,  # the kernel (interpreted) is in the program
               len(gathers)]  # and no all-gather of the logits' rows
with sharding.constraints(Mesh(devs[:2], ("tensor",))):
  res["auto_tensor"] = loss.use_kernel("auto", jnp.bfloat16, backend="gpu")
  try:
    loss.use_kernel("pallas", jnp.bfloat16)
    res["tensor_error"] = ""
  except ValueError as e:
    res["tensor_error"] = str(e)
print("RESULT " + json.dumps(res))
"""


@pytest.mark.integration
def test_kernel_under_meshes():
  """On 4 simulated devices: the kernel per device on its rows (data x fsdp, and microbatches
  vmapped over the data axis) gives XLA's masked loss and gradients in h and W without
  gathering the logits; under tensor parallelism auto keeps XLA's form and pallas is
  refused."""
  out = subprocess.run([sys.executable, "-c", MESH_SCRIPT], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": ""})
  assert out.returncode == 0, out.stderr[-3000:]
  res = json.loads(out.stdout.split("RESULT ")[-1])
  for name in ("pallas", "pallas_mesh", "pallas_micro"):
    loss_diff, grad_diff, has_kernel, gathers = res[name]
    assert loss_diff < 1e-5 and grad_diff < 1e-4 and has_kernel and gathers == 0, (name, res)
  assert res["auto_tensor"] is False and "tensor axis" in res["tensor_error"], res


def test_bad_chunk_count_names_the_key():
  h, w, y, _ = _problem(2, t=8)
  with pytest.raises(ValueError, match="loss_chunks=3"):
    models.head_nll(h, w, y, chunks=3)
  with pytest.raises(ValueError, match="loss_chunks"):
    models.ModelConfig(loss_chunks=0)
