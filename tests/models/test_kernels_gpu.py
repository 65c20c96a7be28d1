"""tokamax's GPU kernels (Mosaic GPU, Pallas Triton; models/tokamax_ops.py) against today's path,
per coordinate, forward and gradients, on a GPU (skipped elsewhere; the CPU tier compares the
XLA references in tests/models/test_kernels_tokamax.py):

  PYTHONPATH=. python -m pytest -q -p no:xdist tests/models/test_kernels_gpu.py

Tolerances, as the largest per-coordinate difference over the largest magnitude of the
reference array:

* bfloat16 inputs, each op against today's path on the same inputs: 1e-2 forward, 2e-2 for
  the gradients (both round their outputs to bfloat16, 2^-8 relative, in their own places);
  and no more than twice today's own error (+ 2e-3) against the same op in float32 from those
  inputs.
* float32 inputs (where tokamax's kernel takes them): 2e-3 (the kernels' matmuls may use TF32).
* the model (bf16) with each setting: the loss and every parameter's gradient no further from
  the float32 model than twice today's bf16 model (+ 2e-3).

A kernel that tokamax declines for the input (NotImplementedError) is skipped with its reason.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaleopt import models
from scaleopt.models import layers, tokamax_ops

from models_testlib import rel_err, vjp_random

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="tokamax's GPU kernels need a GPU"),
    pytest.mark.skipif(not tokamax_ops.installed(), reason="tokamax is not installed"),
]

BF16_FWD, BF16_GRAD, F32 = 1e-2, 2e-2, 2e-3




def _run(fn, *args):
  try:
    return jax.jit(lambda *a: vjp_random(fn, *a))(*args)
  except NotImplementedError as e:
    pytest.skip(f"tokamax declines: {str(e).splitlines()[0][:200]}")


def _compare(got, want, ref, fwd_tol, grad_tol):
  """got, want: (out, grads) of the kernel and of today's path on the same bf16 inputs; ref:
  today's path in float32 on those inputs."""
  (o, g), (ow, gw), (orf, grf) = got, want, ref
  assert rel_err(o, ow) < fwd_tol, rel_err(o, ow)
  assert rel_err(o, orf) <= 2 * rel_err(ow, orf) + 2e-3, (rel_err(o, orf), rel_err(ow, orf))
  for a, b, r in zip(g, gw, grf):
    assert rel_err(a, b) < grad_tol, rel_err(a, b)
    assert rel_err(a, r) <= 2 * rel_err(b, r) + 2e-3, (rel_err(a, r), rel_err(b, r))


def _f32(args):
  return tuple(a.astype(jnp.float32) for a in args)


# (B, T, heads, kv heads, d_head): gpt2-small's layer, qwen2.5-0.5b's (GQA 14 / 2)
ATTN_SHAPES = [(4, 1024, 12, 12, 64), (2, 1024, 14, 2, 64)]


@pytest.mark.parametrize("setting", ["tokamax_mosaic", "tokamax_triton"])
@pytest.mark.parametrize("shape", ATTN_SHAPES)
def test_attention_kernel_matches_today(setting, shape):
  b, t, h, kv, dh = shape
  k = jax.random.split(jax.random.key(0), 3)
  args = (jax.random.normal(k[0], (b, t, h, dh)).astype(jnp.bfloat16),
          *(jax.random.normal(x, (b, t, kv, dh)).astype(jnp.bfloat16) for x in k[1:]))
  today = lambda *a: layers.causal_attention(*a, "cudnn", strict=True)
  _compare(_run(lambda *a: tokamax_ops.attention(*a, setting), *args), _run(today, *args),
           _run(lambda *a: layers.causal_attention(*a, "xla"), *_f32(args)),
           BF16_FWD, BF16_GRAD)


@pytest.mark.parametrize("setting", ["tokamax_mosaic", "tokamax_triton"])
def test_attention_kernel_float32(setting):
  k = jax.random.split(jax.random.key(1), 3)
  q = jax.random.normal(k[0], (2, 256, 4, 64))
  kv = [jax.random.normal(x, (2, 256, 2, 64)) for x in k[1:]]
  got = _run(lambda *a: tokamax_ops.attention(*a, setting), q, *kv)
  want = _run(lambda *a: layers.causal_attention(*a, "xla"), q, *kv)
  assert rel_err(got[0], want[0]) < F32
  for a, b in zip(got[1], want[1]):
    assert rel_err(a, b) < F32


def _glu_xla(x, wg, wu):
  return jax.nn.silu(x @ wg) * (x @ wu)


# (rows, d, f): gpt2-small, qwen2.5-0.5b
GLU_SHAPES = [(8192, 768, 2048), (4096, 896, 4864)]


@pytest.mark.parametrize("setting", ["tokamax_mosaic", "tokamax_triton"])
@pytest.mark.parametrize("shape", GLU_SHAPES)
def test_glu_kernel_matches_today(setting, shape):
  n, d, f = shape
  k = jax.random.split(jax.random.key(2), 3)
  args = (jax.random.normal(k[0], (1, n, d)).astype(jnp.bfloat16),
          *((0.02 * jax.random.normal(x, (d, f))).astype(jnp.bfloat16) for x in k[1:]))
  _compare(_run(lambda *a: tokamax_ops.gated_linear_unit(*a, setting), *args),
           _run(_glu_xla, *args), _run(_glu_xla, *_f32(args)), BF16_FWD, BF16_GRAD)


@pytest.mark.parametrize("setting", ["tokamax_triton"])
@pytest.mark.parametrize("d", [768, 896])
def test_norm_kernel_matches_today(setting, d):
  """Against today's GPU path, the Pallas add + norm kernel (``norm_kernel: auto``)."""
  k = jax.random.split(jax.random.key(3), 2)
  args = ((3 * jax.random.normal(k[0], (8, 1024, d))).astype(jnp.bfloat16),
          jax.random.normal(k[1], (8, 1024, d)).astype(jnp.bfloat16))
  f = lambda kernel: (lambda x, h: layers.add_rms_norm(x, h, 1e-6, kernel)[1])
  _compare(_run(f(setting), *args), _run(f(True), *args), _run(f(False), *_f32(args)),
           BF16_FWD, BF16_GRAD)


@pytest.mark.parametrize("setting", ["tokamax_triton"])
def test_norm_kernel_float32(setting):
  k = jax.random.split(jax.random.key(4), 2)
  x, h = (jax.random.normal(y, (4, 256, 768)) for y in k)
  f = lambda kernel: (lambda x, h: layers.add_rms_norm(x, h, 1e-6, kernel)[1])
  got, want = _run(f(setting), x, h), _run(f(False), x, h)
  assert rel_err(got[0], want[0]) < F32
  for a, b in zip(got[1], want[1]):
    assert rel_err(a, b) < F32


SMALL = models.ModelConfig(vocab_size=4096, d_model=256, n_layers=2, n_heads=4, n_kv_heads=2,
                           d_ff=512, scan_unroll=0)


@pytest.mark.parametrize("settings", [
    dict(attention_impl="tokamax_mosaic"), dict(attention_impl="tokamax_triton"),
    dict(glu_kernel="tokamax_mosaic"), dict(glu_kernel="tokamax_triton"),
    dict(norm_kernel="tokamax_triton"),
    dict(attention_impl="tokamax_mosaic", glu_kernel="tokamax_mosaic",
         norm_kernel="tokamax_triton"),
], ids=lambda s: "+".join(f"{k.split('_')[0]}={v.split('_')[1]}" for k, v in s.items()))
def test_model_with_kernels_matches_today(settings):
  params = models.functional(SMALL)[0](jax.random.key(0))
  toks = jax.random.randint(jax.random.key(1), (4, 512), 0, SMALL.vocab_size)
  tgt = jnp.roll(toks, -1, axis=1)

  def grads(cfg):
    fn = models.functional_loss(cfg)
    try:
      return jax.jit(jax.value_and_grad(lambda p: fn(p, toks, tgt)[0]))(params)
    except NotImplementedError as e:
      pytest.skip(f"tokamax declines: {str(e).splitlines()[0][:200]}")

  (lg, gg), (lt, gt) = grads(SMALL.replace(**settings)), grads(SMALL)
  lr, gr = grads(SMALL.replace(dtype="float32", attention_impl="xla", norm_kernel="xla"))
  assert abs(float(lg - lr)) <= 2 * abs(float(lt - lr)) + 2e-3 * float(lr)
  for a, b, r in zip(jax.tree.leaves(gg), jax.tree.leaves(gt), jax.tree.leaves(gr)):
    assert rel_err(a, r) <= 2 * rel_err(b, r) + 2e-3, (rel_err(a, r), rel_err(b, r))
  assert models.kernel_choices(SMALL.replace(**settings))[
      {"attention_impl": "attention", "glu_kernel": "glu", "norm_kernel": "norm"}[
          next(iter(settings))]] == next(iter(settings.values()))


def test_kernel_checks_on_this_gpu():
  cc = float(jax.devices()[0].compute_capability)
  problem = models.kernel_problem(models.ModelConfig(attention_impl="tokamax_mosaic"))
  assert (problem is None) == (cc >= 9.0), problem
  assert models.kernel_problem(models.ModelConfig(attention_impl="tokamax_triton")) is None
