"""Shampoo's block order under FSDP (2 simulated CPU devices, the train step as the trainer
builds it).

With the blocks ordered by each tensor's FSDP dim (the trainer's default) every device blocks
the gradient rows it already holds: the compiled step has no more all-to-all or
collective-permute than AdamW's on the same mesh, while the stacked-layers order
(``block_major: layers``) moves every gradient and direction between layouts. Both orders
compute the same update (per coordinate after three steps). A checkpoint keeps its order:
resuming it with the other order is a one-line error.

XLA_FLAGS=--xla_force_host_platform_device_count=2 must be set before jax initialises, so the
compiles run in a subprocess.
"""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from train_helpers import tiny_raw  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, re, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
sys.path.insert(0, os.path.join(os.getcwd(), "tests", "train"))
import jax, numpy as np
from train_helpers import compiled_steps
assert jax.device_count() == 2, jax.devices()

MOVES = re.compile(r" (all-to-all|collective-permute)(?:-start)?\(")
out = {}
for name, raw in json.loads(sys.argv[2]).items():
  fns, state, step, batches = compiled_steps(raw)
  moves = len(MOVES.findall(step.as_text()))
  for b in batches:
    state, _ = step(state, b)
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state.opt_state)}
  out[name + "_kinds"] = sorted(kinds)
  flat = jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]
  np.savez(os.path.join(sys.argv[1], name + ".npz"),
           **{jax.tree_util.keystr(p): np.asarray(x) for p, x in flat})
  out[name] = moves
print(json.dumps(out))
"""

MODEL = {"n_layers": 2}  # a stack of 2 layers: the orders differ when layers and blocks are > 1
SHAMPOO = {"name": "shampoo", "learning_rate": 3e-3,
           "extra": {"block_size": 16, "root_every": 2}}  # d_model 32: 2 row blocks of 16


def _raw(optimizer, micro=2, mesh=None, **extra):
  opt = {**optimizer, "extra": {**optimizer.get("extra", {}), **extra}}
  return tiny_raw(model=MODEL, mesh=mesh or {"data": 1, "fsdp": 2}, optimizer=opt,
                  data={"microbatches": micro})


def _compile_and_run(d, raws):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  r = subprocess.run([sys.executable, "-c", SCRIPT, str(d), json.dumps(raws)], cwd=ROOT,
                     env=env, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  return d, json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def bc_runs(tmp_path_factory):
  """The collector blocks each group-B gradient too (cross-fit, eigenvalue variances)."""
  return _compile_and_run(tmp_path_factory.mktemp("bc_blocks"), {
      "bc_major": _raw({**SHAMPOO, "name": "shampoo_bc"}, micro=4),
      "bc_layers": _raw({**SHAMPOO, "name": "shampoo_bc"}, micro=4, block_major="layers"),
      "adamw": _raw({"name": "adamw"})})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  d = tmp_path_factory.mktemp("blocks")
  # statistics every other step (the offload's host crossings happen on those steps only);
  # major_offload keeps them in host memory, their blocks split over the two devices
  raws = {"adamw": _raw({"name": "adamw"}), "major": _raw(SHAMPOO, stats_every=2),
          "layers": _raw(SHAMPOO, block_major="layers", stats_every=2),
          "major_offload": _raw(SHAMPOO, stats_every=2, offload_statistics=True),
          # one row block of 32 (d_model) would span both FSDP shards (and move, as the layers
          # order does); cut per shard it is two of 16, on the fsdp mesh and, the same blocks,
          # on a data-parallel one
          "shards32": _raw(SHAMPOO, block_size=32, block_shards="fsdp"),
          "shards32_data2": _raw(SHAMPOO, block_size=32, block_shards=2,
                                 mesh={"data": 2, "fsdp": 1})}
  return _compile_and_run(d, raws)


def test_fsdp_ordered_blocks_move_no_gradient(runs):
  _, moves = runs
  assert moves["major"] <= moves["adamw"], moves
  assert moves["layers"] > moves["adamw"], moves  # the other order does move data


@pytest.mark.parametrize("name", ["", pytest.param("bc_", marks=pytest.mark.slow)])
def test_block_orders_give_the_same_update(request, name):
  d, _ = request.getfixturevalue("bc_runs" if name else "runs")
  major, layers = (np.load(d / f"{name}{n}.npz") for n in ("major", "layers"))
  adamw = np.load(d / "adamw.npz")
  for k in major.files:
    np.testing.assert_allclose(major[k], layers[k], rtol=1e-5, atol=1e-6, err_msg=k)
  # Shampoo really preconditioned: its matrices differ from AdamW's after the same steps
  assert max(float(np.abs(major[k] - adamw[k]).max()) for k in major.files) > 1e-4


def test_offloaded_statistics_split_over_devices_give_the_same_update(runs):
  """L, R sharded over the mesh and kept in host memory: same parameters, no more collectives
  than AdamW (host transfers are not collectives and are not counted)."""
  d, moves = runs
  assert moves["major_offload_kinds"] == ["device", "pinned_host"], moves
  assert moves["major_kinds"] == ["device"], moves
  assert moves["major_offload"] <= moves["adamw"], moves
  major, off = (np.load(d / f"{n}.npz") for n in ("major", "major_offload"))
  for k in major.files:
    np.testing.assert_allclose(off[k], major[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_blocks_cut_per_fsdp_shard_move_no_gradient(runs):
  """``block_shards: fsdp`` where a block (32 rows) is larger than a shard (16): the per-shard
  cut moves no more data than AdamW's step (without it the block would span both devices'
  rows); the per-shard blocks give the same update on a data-parallel mesh (they depend on
  ``block_shards``, not on the mesh the step runs on), and Shampoo preconditioned."""
  d, moves = runs
  assert moves["shards32"] <= moves["adamw"], moves
  shards, data2, adamw = (np.load(d / f"{n}.npz") for n in ("shards32", "shards32_data2",
                                                            "adamw"))
  for k in shards.files:
    np.testing.assert_allclose(shards[k], data2[k], rtol=1e-5, atol=1e-6, err_msg=k)
  assert max(float(np.abs(shards[k] - adamw[k]).max()) for k in shards.files) > 1e-4


def test_resuming_with_the_other_block_order_is_a_clear_error(tmp_path):
  cfg = tmp_path / "cfg.yaml"
  run = tmp_path / "run"
  base = tiny_raw(model=MODEL, optimizer={**SHAMPOO, "schedule": {"kind": "constant",
                                                                   "warmup_steps": 0}},
                  run={"steps": 2, "checkpoint_every": 2})
  base["mesh"] = {"data": 1}
  cli = [sys.executable, "-m", "scaleopt.cli", "train", "--config", str(cfg), "--out", str(run)]
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  cfg.write_text(yaml.safe_dump(base))
  first = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=600)
  assert first.returncode == 0, first.stderr[-2000:]
  base["run"]["steps"] = 4
  base["optimizer"]["extra"] = {**SHAMPOO["extra"], "block_major": "layers"}
  cfg.write_text(yaml.safe_dump(base))
  before = sorted(p.name for p in (run / "checkpoints").iterdir())
  again = subprocess.run(cli + ["--resume"], env=env, capture_output=True, text=True,
                         timeout=600)
  assert again.returncode == 2, again.stderr[-2000:]
  lines = [l for l in again.stderr.strip().splitlines() if l.strip()]
  assert "remove optimizer.extra.block_major" in lines[-1], again.stderr[-2000:]
  assert "Traceback" not in again.stderr, again.stderr[-2000:]
  assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
  del base["optimizer"]["extra"]["block_major"]  # the order it was saved with resumes
  cfg.write_text(yaml.safe_dump(base))
  ok = subprocess.run(cli + ["--resume"], env=env, capture_output=True, text=True, timeout=600)
  assert ok.returncode == 0, ok.stderr[-2000:]
  assert "4" in sorted(p.name for p in (run / "checkpoints").iterdir())
