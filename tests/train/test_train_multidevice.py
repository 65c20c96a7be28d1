"""8 simulated CPU devices: data x FSDP x tensor sharding reproduces the single-device run."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from scaleopt.train import config as C
from scaleopt.train import loop, metrics

from train_helpers import tiny_raw

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax
assert jax.device_count() == 8, jax.devices()
from scaleopt.train import config as C, loop
from scaleopt.train.config import ConfigError
out = {}
for name, raw in json.loads(open(sys.argv[1]).read()).items():
  cfg = C.from_dict(raw)
  if name == "bad_batch":
    try:
      loop.setup(cfg)
      out[name] = "no error"
    except ConfigError as e:
      out[name] = str(e)
    continue
  s = loop.setup(cfg)
  loop.train(cfg, os.path.join(sys.argv[2], name), s=s)
  import numpy as np
  from scaleopt.train import mesh as M, step as S
  from scaleopt import models
  shape = jax.eval_shape(lambda: S.init_state(s.model, s.tx, 0)).params
  sh = M.param_shardings(s.mesh, shape, models.partition_rules(s.model.cfg))
  out[name + "_embed_spec"] = str(sh["embed"]["embedding"].spec)
  out[name + "_mesh"] = dict(s.mesh.shape)
print(json.dumps(out))
"""


def _configs():
  common = dict(run={"steps": 8, "eval_every": 8, "checkpoint_every": 0, "log_every": 1,
                     "tensorboard": False})
  adamw = tiny_raw(**common, mesh={"data": 2, "fsdp": 2, "tensor": 2})
  bc = tiny_raw(**common, mesh={"data": 2, "fsdp": 4},
                optimizer={"name": "adamw_bc",
                           "extra": {"mode": "full", "crossfit": "rolling_b"}})
  bad = tiny_raw(data={"batch_size": 12, "microbatches": 2}, mesh={"data": 8})
  return {"adamw": adamw, "adamw_bc": bc, "bad_batch": bad}


@pytest.mark.parametrize("name", ["adamw", pytest.param("adamw_bc", marks=pytest.mark.slow)])
def test_data_fsdp_matches_single_device(tmp_path, name):
  cfgs = {k: v for k, v in _configs().items() if k in (name, "bad_batch")}
  (tmp_path / "cfgs.json").write_text(json.dumps(cfgs))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  r = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "cfgs.json"),
                      str(tmp_path / "multi")], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  info = json.loads(r.stdout.strip().splitlines()[-1])
  expect = {"adamw": {"data": 2, "fsdp": 2, "tensor": 2},
            "adamw_bc": {"data": 2, "fsdp": 4, "tensor": 1}}[name]
  assert info[name + "_mesh"] == expect
  assert "fsdp" in info[name + "_embed_spec"]  # parameters really are sharded
  if name == "adamw":
    assert "tensor" in info[name + "_embed_spec"]
  msg = info["bad_batch"]
  assert "6 sequences" in msg and "8 batch shards" in msg, msg
  for name in (name,):
    single = dict(cfgs[name], mesh={"data": -1})
    loop.train(C.from_dict(single), tmp_path / "single" / name)
    a = metrics.read_metrics(tmp_path / "single" / name / "metrics.jsonl")
    b = metrics.read_metrics(tmp_path / "multi" / name / "metrics.jsonl")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 9))
    for k in ("loss", "grad_norm", "update_norm"):
      np.testing.assert_allclose([r[k] for r in b], [r[k] for r in a], rtol=2e-4, err_msg=k)
    np.testing.assert_allclose(b[-1]["eval_loss"], a[-1]["eval_loss"], rtol=2e-4)
    assert a[-1]["loss"] < a[0]["loss"]  # and it is training
