"""Vmapped microbatches on a data-parallel mesh: each device computes its own microbatches.

With ``vmap_microbatches`` and m divisible by the mesh's ``data`` size, the collector splits the
microbatch axis over ``data`` (``optim.MicrobatchAxis``): apart from moving the token ids to
their devices, the forward and backward passes communicate nothing, and the per-microbatch
outputs move once, by an all-to-all, into slices where every statistic is folded locally (on
a mesh without data parallelism, the same over the fsdp axis). On 8 simulated CPU devices the
run must equal the scan over the same microbatches per coordinate (parameters after three
steps, the last step's metrics), keep every collective but FSDP's kernel gathers out of loops,
all-reduce nothing parameter-sized, and for leave-one-out (one microbatch per device) move one
gradient's bytes by all-to-all and gather back only the updated parameters and the replicated
moments (with ZeRO-1, the parameters alone). The collector itself is checked field by
field on 4 devices: every statistic of a split group equals the unsplit one, for each variance
target, with squares, at m divisible by 4 or not, and Sophia's curvature pass. The runs happen
in subprocesses (XLA_FLAGS must be set before jax initialises).
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, re, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "train"))
import jax, numpy as np
from train_helpers import compiled_steps, tiny_raw
name, data, out, zero = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] == "zero"
BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "pred": 1}
OPS = "all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter"

def collectives(hlo):
  rows = []
  for line in hlo.splitlines():
    m = re.search(r"= (.*?) (" + OPS + r")(-start)?\(", line)
    if m:
      size = sum(BYTES[t] * int(np.prod([int(d) for d in dims.split(",") if d]))
                 for t, dims in re.findall(r"(f32|s32|u32|bf16|f16|pred)\[([0-9,]*)\]", m.group(1)))
      rows.append((m.group(2), size, "while/body" in line))
  return rows

def run(vmap):
  opt, _, crossfit = name.partition(":")  # e.g. adamw_bc:ab (two groups of m / 2)
  extra = {"vmap_microbatches": vmap} if vmap else {}
  if crossfit:
    extra["crossfit"] = crossfit
  elif opt == "adamw_bc":
    extra["loo_passes"] = 1
  mesh = {"data": data, "fsdp": 8 // data, "shard_optimizer": zero}
  raw = tiny_raw(mesh=mesh, optimizer={"name": opt, "extra": extra},
                 data={"batch_size": 64, "microbatches": 8})
  _, state, step, batches = compiled_steps(raw)
  for b in batches:
    state, metrics = step(state, b)
  metrics = [np.asarray(metrics[k]) for k in ("loss", "ce", "grad_norm", "update_norm")]
  leaves = jax.tree.leaves(jax.device_get(state.params)) + metrics
  return leaves, collectives(step.as_text())

ref, _ = run(False)
new, coll = run(True)
np.savez(out + "/params.npz", *[np.asarray(x) for x in ref + new])
json.dump({"n": len(ref), "param_bytes": 4 * sum(int(x.size) for x in ref),
           "collectives": coll}, open(out + "/info.json", "w"))
"""


def _run(tmp_path, name, data, zero=False):
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  args = [name, str(data), str(tmp_path), "zero" if zero else "replicated"]
  r = subprocess.run([sys.executable, "-c", SCRIPT, *args], cwd=ROOT,
                     env=env, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  info = json.loads((tmp_path / "info.json").read_text())
  arrays = np.load(tmp_path / "params.npz")
  leaves = [arrays[f"arr_{i}"] for i in range(2 * info["n"])]
  return leaves[:info["n"]], leaves[info["n"]:], info


@pytest.mark.parametrize("name,data,zero", [
    pytest.param("adamw_bc", 8, False, marks=pytest.mark.slow),  # data 8 (ZeRO-1 below)
    ("adamw_bc", 8, True),
    pytest.param("sophia_bc", 8, False, marks=pytest.mark.slow),
    ("adamw_bc", 1, False),  # fsdp 8: the microbatches on the fsdp axis
    pytest.param("adamw_bc", 2, False, marks=pytest.mark.slow),  # data 2 x fsdp 4
    pytest.param("adamw_bc:ab", 4, True, marks=pytest.mark.slow)])  # groups of 4 on data 4
def test_device_microbatches_equal_the_scan_without_per_microbatch_collectives(
    tmp_path, name, data, zero):
  ref, new, info = _run(tmp_path, name, data, zero)
  # parameters after 3 steps and the last step's loss, ce, gradient and update norms; the
  # batched gradients round differently: per coordinate, tight
  for a, b in zip(ref, new):
    np.testing.assert_allclose(b, a, rtol=2e-4, atol=1e-6 * max(np.abs(a).max(), 1e-30))
  coll, pb = info["collectives"], info["param_bytes"]
  total = lambda op: sum(size for o, size, _ in coll if o == op)
  if 1 < data < 8:
    return  # data x fsdp: the microbatches on data, each split over fsdp
  assert total("all-reduce") <= 4096, "a parameter-sized all-reduce (scalars only: losses, norms)"
  assert total("all-to-all") > 0
  if data == 1:  # fsdp 8: the kernels' all-gathers live in the layer scan by design
    assert not [c for c in coll if c[2] and c[0] != "all-gather"], "a collective in a loop"
    return
  assert not [c for c in coll if c[2]], "a collective inside a loop"
  assert total("all-gather") > 0
  if name == "adamw_bc":  # one microbatch per device: its gradient moves once
    assert total("all-to-all") <= 1.05 * pb, (total("all-to-all"), pb)
    # back: the new parameters, with replicated moments also the two Adam moments
    assert total("all-gather") <= (1.05 if zero else 3.05) * pb, (total("all-gather"), pb)


COLLECTOR = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
import importlib
C = importlib.import_module("scaleopt.optim.collect")  # the package (optim.collect is the function)
from scaleopt.optim import sophia_lib as S
mesh = Mesh(np.array(jax.devices()).reshape(4), ("data",))
rng = np.random.default_rng(0)
params = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32),
          "b": jnp.asarray(rng.normal(size=(3,)), jnp.float32)}

def loss_fn(p, mb):
  out = jnp.tanh(mb["x"] @ p["w"] + p["b"])
  loss = jnp.mean((out - mb["y"]) ** 2)
  return loss, {"ce": 2.0 * loss}

def mbs(m):
  return {"x": jnp.asarray(rng.normal(size=(m, 6, 5)), jnp.float32),
          "y": jnp.asarray(rng.normal(size=(m, 6, 3)), jnp.float32)}

def split_and_not(f):  # f(axis): unsplit (None) and split over the 4 devices
  on_axis = lambda: f(C.MicrobatchAxis("data", 4, mesh=mesh))
  return jax.tree.leaves(jax.jit(lambda: f(None))()), jax.tree.leaves(jax.jit(on_axis)())

grad_fn = C.value_and_grad_fn(loss_fn)
cases = []
for m in (4, 6, 8):  # 6: not divisible by the 4 devices (unsplit vmap)
  data = mbs(m)
  for var_of in (None, "sq", "grad"):
    cases.append(split_and_not(lambda ax: C.scan_group(grad_fn, params, data, var_of=var_of,
                                                       need_sq=True, vmap=True, axis=ax)))
data = mbs(8)
logits = lambda p, mb: (jnp.tanh(mb["x"] @ p["w"] + p["b"]), jnp.ones(mb["x"].shape[:-1]))
for est, stat, weight in (("hutchinson", "mean_sq", "none"), ("gnb", "mean_sq", "none"),
                          ("gnb", "sq_of_mean", "tokens")):
  cases.append(split_and_not(lambda ax: S.curvature_pass(loss_fn, logits, params, data,
                                                         jax.random.key(1), est, stat, weight,
                                                         True, True, ax)))
np.savez(sys.argv[1], *[x for a, b in cases for x in (np.asarray(u) for u in a + b)],
         sizes=np.array([len(a) for a, _ in cases]))
"""


def test_split_statistics_equal_the_unsplit_ones_field_by_field(tmp_path):
  out = tmp_path / "stats.npz"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  r = subprocess.run([sys.executable, "-c", COLLECTOR, str(out)], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  z = np.load(out)
  arrays, i = [z[f"arr_{k}"] for k in range(len(z.files) - 1)], 0
  for n in z["sizes"]:
    ref, split = arrays[i:i + n], arrays[i + n:i + 2 * n]
    i += 2 * n
    for a, b in zip(ref, split):  # mean, squares, variance, loss, aux; curvature and its var
      np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7 * max(np.abs(a).max(), 1e-30))
  assert i == len(arrays)
