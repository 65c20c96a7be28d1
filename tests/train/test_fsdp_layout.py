"""FSDP on 2 simulated CPU devices: which collectives the compiled train step contains.

FSDP means: activations split on the batch, parameters gathered for use, gradients reduced
back to shards. The failure this guards against is GSPMD propagating the parameters' model-
dimension sharding into the activations, so that every matmul all-reduces full-batch
activations (tensor parallelism over d by accident). The check reads the optimized HLO: no
floating-point all-reduce / reduce-scatter may carry the sequence axis (T = 40, a size no
parameter has).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, os, re, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import jax, jax.numpy as jnp
from scaleopt.train import config as C, loop

T = 40
def step_hlo(micro, legacy=False, mesh={"fsdp": 2}):
  raw = {"run": {"steps": 1, "progress": False, "plot": False, "tensorboard": False},
         "model": {"preset": "tiny", "dtype": "float32", "d_model": 32, "n_layers": 2,
                   "d_ff": 64, "vocab_size": 256},
         "data": {"source": "embedded", "seq_len": T, "batch_size": 4 * micro,
                  "microbatches": micro},
         "optimizer": {"name": "adamw"}, "mesh": mesh}
  s = loop.setup(C.from_dict(raw))
  if legacy:  # the model without its sharding constraints
    s.model = s.model.with_mesh(None)
  fns = loop.compile_fns(s)
  st = jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh),
                    fns.state_shape, fns.state_sh)
  batch = {"tokens": jax.ShapeDtypeStruct((micro, 4, T + 1), jnp.int32, sharding=fns.batch_sh)}
  return fns.train_step.lower(st, batch).compile().as_text()

COLL = re.compile(r"= (\(?[a-z0-9]+\[[^=]*?) (all-reduce|reduce-scatter|all-gather|all-to-all)"
                  r"(?:-start)?\(")
def collectives(txt):
  out = []
  for line in txt.splitlines():
    m = COLL.search(line)
    if m:
      shapes = re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", m.group(1))
      out.append((m.group(2), [(t, [int(d) for d in s.split(",") if d]) for t, s in shapes]))
  return out

def activation_reductions(txt):
  return [c for c in collectives(txt) if c[0] in ("all-reduce", "reduce-scatter")
          and any(t.startswith(("f", "bf")) and T in dims for t, dims in c[1])]

res = {}
for name, kw in (("fsdp", dict(micro=2)), ("legacy", dict(micro=2, legacy=True))):
  txt = step_hlo(**kw)
  res[name] = dict(act=len(activation_reductions(txt)),
                   gathers=sum(c[0] == "all-gather" for c in collectives(txt)))
print(json.dumps(res))
"""


@pytest.mark.integration
def test_fsdp_reduces_gradients_not_activations():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  res = json.loads(r.stdout.strip().splitlines()[-1])
  # Without the constraints GSPMD all-reduces activations (the test can fail) ...
  assert res["legacy"]["act"] > 0, res
  # ... with them no activation is all-reduced or reduce-scattered, and kernels are gathered.
  assert res["fsdp"]["act"] == 0 and res["fsdp"]["gathers"] > 0, res


def test_launch_xla_flags_keep_the_users_settings():
  from scaleopt.train import mesh
  assert mesh.launch_xla_flags("") == " ".join(mesh.LAUNCH_XLA_FLAGS)
  mine = "--xla_gpu_enable_triton_gemm=true --xla_dump_to=/tmp/x"
  out = mesh.launch_xla_flags(mine).split()
  assert out[:2] == mine.split() and "--xla_gpu_enable_triton_gemm=false" not in out
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in out
  env = {"SCALEOPT_XLA_DEFAULTS": "0", "XLA_FLAGS": "--a=1"}
  mesh.set_launch_xla_flags(env)
  assert env["XLA_FLAGS"] == "--a=1"


@pytest.mark.parametrize("command", ["train", "study"])
def test_training_launchers_set_the_launch_flags(monkeypatch, tmp_path, command):
  """``scaleopt train`` and ``scaleopt study`` (whose cells are training runs) both add the
  launch flags to XLA_FLAGS before JAX starts a backend, and keep the user's."""
  from scaleopt import cli
  from scaleopt.train import mesh
  monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
  monkeypatch.delenv("SCALEOPT_XLA_DEFAULTS", raising=False)
  args = {"train": ["train", "--config", "tiny", "--print-config"],
          "study": ["study", "--config", "bc_tiny", "--out", str(tmp_path / "s"), "--list"]}
  assert cli.main(args[command]) == 0
  assert os.environ["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/x", *mesh.LAUNCH_XLA_FLAGS]
