"""``mesh.shard_optimizer`` (ZeRO-1) on 8 simulated CPU devices under pure data parallelism.

The optimizer state is split over ``data`` and every device updates only its slice; the run
must equal the replicated one per coordinate (parameters and every optimizer-state leaf after
three steps), and the compiled step's memory analysis must show the per-device optimizer
state divided by 8 (AdamW) or, for Shampoo, its parameter-shaped moments divided by 8 while
the block-stacked factors keep their layout. Both compiles run in the same process; nothing
is compared with a stored number.

XLA_FLAGS=--xla_force_host_platform_device_count=8 must be set before jax initialises, so the
runs happen in a subprocess that writes the final states (npz) and the memory figures (json).
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from scaleopt import optim
from scaleopt.train.mesh import _with_data

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
N = 8

SCRIPT = r"""
import json, os, re, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "train"))
import jax, numpy as np
from train_helpers import compiled_steps, tiny_raw
assert jax.device_count() == 8, jax.devices()

def nbytes(tree, shardings):
  return int(sum(np.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize
                 for x, sh in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings))))

def run(name, shard, out):
  sched = {"schedule": {"kind": "constant"}} if name == "schedule_free_adamw" else {}
  raw = tiny_raw(mesh={"data": 8, "shard_optimizer": shard}, optimizer={"name": name, **sched})
  fns, state, step, batches = compiled_steps(raw)
  init = jax.device_get(state.params)
  ma = step.memory_analysis()
  for b in batches:
    state, _ = step(state, b)
  flat = jax.tree_util.tree_flatten_with_path(jax.device_get(state))[0]
  arrays = {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}
  arrays.update({"init" + jax.tree_util.keystr(p): np.asarray(x)
                 for p, x in jax.tree_util.tree_flatten_with_path(init)[0]})
  np.savez(os.path.join(out, f"{name}_{int(shard)}.npz"), **arrays)
  # everything the step takes besides the optimizer state, per device, from its shardings
  other = (nbytes(fns.state_shape._replace(opt_state=()), fns.state_sh._replace(opt_state=()))
           + sum(nbytes(b, fns.batch_sh) for b in batches[:1]))
  # state leaves that mirror a parameter (path ends with its path, same shape): the moments
  pkeys = {jax.tree_util.keystr(p): x.shape
           for p, x in jax.tree_util.tree_flatten_with_path(fns.state_shape.params)[0]}
  mirror = [x for p, x in jax.tree_util.tree_flatten_with_path(fns.state_shape.opt_state)[0]
            if any(jax.tree_util.keystr(p).endswith(k) and x.shape == shp
                   for k, shp in pkeys.items())]
  # collectives inside the microbatch loop (op names under a while body): the forward and
  # backward passes must not change
  in_loop = sorted(m.group(1) for m in re.finditer(
      r" (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(.*"
      r"op_name=\"[^\"]*while/body", step.as_text()))
  return dict(in_loop=in_loop, args=ma.argument_size_in_bytes, temp=ma.temp_size_in_bytes,
              out=ma.output_size_in_bytes, alias=ma.alias_size_in_bytes, other=other,
              moments=int(sum(np.prod(x.shape) * x.dtype.itemsize for x in mirror)),
              params=nbytes(fns.state_shape.params, fns.state_sh.params))

out = {}
for name in sys.argv[2:]:
  out[name] = {str(shard): run(name, shard, sys.argv[1]) for shard in (False, True)}
print(json.dumps(out))
"""


def _run(tmp_path, names):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path), *names], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def _check_equal(tmp_path, name):
  rep, zero = (np.load(tmp_path / f"{name}_{k}.npz") for k in (0, 1))
  assert sorted(rep.files) == sorted(zero.files)
  moved = 0.0
  for k in rep.files:
    a, b = rep[k], zero[k]
    if k.startswith(".params"):  # the parameters: float32 rounding of a different reduction
      np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=f"{name} {k}")
      moved = max(moved, float(np.max(np.abs(a - rep["init" + k[len(".params"):]]))))
    elif k.startswith(".opt_state") and a.size:  # relative to the leaf's scale (roots ~30)
      scale = float(np.max(np.abs(a))) or 1.0
      np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * scale, err_msg=f"{name} {k}")
  assert moved > 1e-3, f"{name}: the parameters did not move"


def _opt_state_bytes(m):
  """Per-device optimizer-state bytes: the compiled step's arguments minus everything else."""
  return m["args"] - m["other"]


# block-stacked factors; the others with the slow tests (adamw_bc's collector hooks, which read
# the state, also run under ZeRO-1 in test_device_microbatches' data 8 + ZeRO-1 case)
FAST = ("shampoo",)
# SOAP's first basis is the eigenvectors of factors of one gradient: rank-deficient, so its
# eigenvectors in their null space (and the per-coordinate second moment there) follow float32
# rounding, which a sharded reduction changes; its runs agree only to ~1e-4 (a property of the
# algorithm, not of the sharding).
NOT_BITWISE = ("soap", "soap_bc")


@pytest.mark.parametrize("names", [FAST, pytest.param(tuple(n for n in optim.names()
                                                            if n not in FAST + NOT_BITWISE),
                                                      marks=pytest.mark.slow)],
                         ids=["shampoo", "others"])
def test_sharded_state_trains_like_replicated_with_an_nth_of_the_memory(tmp_path, names):
  mem = _run(tmp_path, names)
  for name in names:
    _check_equal(tmp_path, name)
    rep, zero = mem[name]["False"], mem[name]["True"]
    assert rep["other"] == zero["other"]  # the same parameters and batch either way
    s_rep, s_zero = _opt_state_bytes(rep), _opt_state_bytes(zero)
    if name in ("adamw", "adamw_bc"):  # mu and nu mirror the parameters: all of it divides
      assert s_rep / s_zero > 0.95 * N, (s_rep, s_zero)
    else:  # at least the moments that mirror the parameters divide by n (not Shampoo's
      # block-stacked factors: they are split on their block axis either way)
      assert rep["moments"] >= rep["params"]  # every optimizer keeps at least one moment
      saved = s_rep - s_zero
      assert saved >= 0.95 * (1 - 1 / N) * rep["moments"], (name, saved, rep["moments"])
    assert rep["in_loop"] and zero["in_loop"] == rep["in_loop"], name  # no gathers per microbatch
    # no full-size copy of the state appears inside the step instead
    peak = lambda m: m["args"] + m["out"] - m["alias"] + m["temp"]
    assert peak(rep) - peak(zero) >= 0.9 * (s_rep - s_zero), (name, rep, zero)


def test_data_axis_goes_to_the_first_dimension_it_divides():
  mesh = AbstractMesh((4, 2, 1), ("data", "fsdp", "tensor"))
  spec = lambda s, shape: _with_data(mesh, NamedSharding(mesh, s), shape).spec
  assert spec(P(), (12, 768, 768)) == P("data", None, None)  # a stack: whole layers per device
  assert spec(P(), (6, 768)) == P(None, "data")
  assert spec(P(None, "fsdp"), (6, 768, 2048)) == P(None, "fsdp", "data")
  assert spec(P("fsdp"), (8, 3)) == P(("fsdp", "data"), None)  # joins fsdp where it must
  assert spec(P(), (3, 5)) == P()  # nothing divides: replicated, as without the option
  assert spec(P(), ()) == P()
  assert spec(P("data"), (8, 8)) == P("data")
