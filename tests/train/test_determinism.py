"""run.deterministic: the XLA flags and when they can be set; the state digest."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaleopt.config import ConfigError
from scaleopt.train import determinism as det

FLAGS = " ".join(det.DETERMINISTIC_XLA_FLAGS)


def test_flags_are_added_once_and_kept_with_others():
  assert det.with_flags("") == FLAGS
  cur = "--xla_gpu_enable_triton_gemm=false"
  assert det.with_flags(cur) == f"{cur} {FLAGS}"
  assert det.with_flags(det.with_flags(cur)) == f"{cur} {FLAGS}"
  assert det.missing_flags(f"{cur} {FLAGS}") == []
  assert det.missing_flags(cur) == list(det.DETERMINISTIC_XLA_FLAGS)


def test_a_contrary_flag_is_refused_in_one_line():
  with pytest.raises(ConfigError, match="xla_gpu_deterministic_ops=false"):
    det.with_flags("--xla_gpu_deterministic_ops=false")


def test_prepare_sets_the_flags_before_the_backend_starts():
  env = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=false"}
  det.prepare(True, env, started=False)
  assert det.missing_flags(env["XLA_FLAGS"]) == []
  env = {}
  det.prepare(False, env, started=False)
  assert env == {}  # off: nothing changes


def test_prepare_refuses_a_started_gpu_backend_without_the_flags():
  with pytest.raises(ConfigError, match="started its GPU backend without") as e:
    det.prepare(True, {"XLA_FLAGS": ""}, started=True, platform="gpu")
  assert "\n" not in str(e.value)
  det.prepare(True, {"XLA_FLAGS": FLAGS}, started=True, platform="gpu")  # flags in place
  det.prepare(True, {}, started=True, platform="cpu")  # CPU programs need none
  det.prepare(False, {}, started=True, platform="gpu")


def test_wanted_reads_the_raw_mapping():
  assert det.wanted({"run": {"deterministic": True}})
  assert not det.wanted({"run": {"deterministic": False}})
  assert not det.wanted({"run": {}}) and not det.wanted({}) and not det.wanted(None)


def test_state_digest_sees_one_bit():
  tree = {"a": jnp.arange(6, dtype=jnp.float32).reshape(2, 3), "b": [jnp.ones(3, jnp.bfloat16)]}
  d0 = det.state_digest(tree)
  assert d0 == det.state_digest(jax.tree.map(lambda x: x + 0, tree))
  a = np.asarray(tree["a"]).copy()
  a.view(np.uint32)[1, 2] ^= 1  # the last mantissa bit of one entry
  assert det.state_digest({**tree, "a": jnp.asarray(a)}) != d0
  assert det.state_digest({**tree, "a": tree["a"].reshape(3, 2)}) != d0  # shape counts
  assert det.state_digest({"a": tree["b"], "b": [tree["a"]]}) != d0  # and which leaf is where
