"""run.deterministic: the XLA flags and when they can be set; the state digest."""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaleopt.config import ConfigError
from scaleopt.train import determinism as det
from train_helpers import tiny_raw

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


# ------------------------------------------------------------------------------------------
# Attention under XLA's deterministic mode (the platform is a parameter: no GPU needed).


def _train_cfg(deterministic=True, **model):
  from scaleopt.train import config as C
  return C.from_dict(tiny_raw(run={"deterministic": deterministic}, model=model))


def test_deterministic_gpu_runs_resolve_attention_auto_to_xla():
  cfg = _train_cfg()
  assert cfg.model.config.attention_impl == "auto"
  spec = det.model_spec(cfg, platform="gpu", environ={})
  assert spec.config.attention_impl == "xla"
  assert spec.config.replace(attention_impl="auto") == cfg.model.config  # nothing else changes
  assert cfg.model.config.attention_impl == "auto"  # the recorded config keeps the setting
  assert (spec.section, spec.wd_policy, spec.init_from) == (
      cfg.model.section, cfg.model.wd_policy, cfg.model.init_from)
  # a study's process with the flags set for another cell: the same rule for every cell
  off = _train_cfg(deterministic=False)
  assert det.model_spec(off, platform="gpu", environ={"XLA_FLAGS": FLAGS}
                        ).config.attention_impl == "xla"
  # unchanged: without the mode, on the CPU, or with attention by XLA already
  assert det.model_spec(off, platform="gpu", environ={}) is off.model
  assert det.model_spec(cfg, platform="cpu", environ={}) is cfg.model
  xla = _train_cfg(attention_impl="xla")
  assert det.model_spec(xla, platform="gpu", environ={}) is xla.model


@pytest.mark.parametrize("impl", ["cudnn", "tokamax_mosaic", "tokamax_triton", "tokamax_xla"])
def test_deterministic_gpu_runs_refuse_cudnn_and_tokamax_attention(impl):
  cfg = _train_cfg(attention_impl=impl)
  with pytest.raises(ConfigError, match=f"model.attention_impl={impl} under XLA's "
                     "deterministic mode on a GPU") as e:
    det.model_spec(cfg, platform="gpu", environ={})
  assert "\n" not in str(e.value) and "auto or xla" in str(e.value)
  if impl == "cudnn":
    assert "cuDNN attention" in str(e.value)
  assert det.model_spec(cfg, platform="cpu", environ={}) is cfg.model  # CPU: as before
  off = _train_cfg(deterministic=False, attention_impl=impl)
  assert det.model_spec(off, platform="gpu", environ={}) is off.model


def test_the_trainer_refuses_cudnn_attention_in_one_line(monkeypatch, tmp_path, capsys):
  """`scaleopt train` with run.deterministic=true and attention_impl=cudnn on a GPU: exit 2
  before anything is trained (the trainer's platform set to gpu through model_spec's
  parameter)."""
  import functools

  from scaleopt.train import main as train_main
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # restored afterwards
  monkeypatch.setattr(det, "model_spec", functools.partial(det.model_spec, platform="gpu"))
  cfg = tmp_path / "c.yaml"
  cfg.write_text(yaml.safe_dump(tiny_raw(run={**_RUN, "steps": 10, "progress": False},
                                         model={"attention_impl": "cudnn"})))
  rc = train_main.train_main(str(cfg), str(tmp_path / "out"))
  err = capsys.readouterr().err.strip()
  assert rc == 2 and len(err.splitlines()) == 1, err
  assert "model.attention_impl=cudnn" in err and "auto or xla" in err
  assert not (tmp_path / "out" / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------------------
# Whole runs on the CPU.

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import yaml

_ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("determinism_bench",
                                               _ROOT / "benchmarks" / "determinism.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

_RUN = {"steps": 4, "log_every": 1, "eval_every": 0, "eval_tokens": 1024, "checkpoint_every": 0,
        "keep_checkpoints": 1, "tensorboard": False, "deterministic": True}


def _rows(run):
  return bench.read_run(pathlib.Path(run))


def test_two_deterministic_runs_are_bitwise_equal_and_a_data_seed_is_not(tmp_path):
  from scaleopt.train import config as C, loop
  cfg = lambda **data: C.from_dict(tiny_raw(run=_RUN, data=data))
  summaries = [loop.train(cfg(), tmp_path / name) for name in ("a", "b")]
  a, b = _rows(tmp_path / "a"), _rows(tmp_path / "b")
  same = bench.compare(a, b)
  assert same["differ"] == 0 and same["state_equal"] is True, same
  assert same["steps"] == 4 and same["values"] >= 4 * 5  # loss, grad norm, lr, ... per step
  assert summaries[0]["state_sha256"] == summaries[1]["state_sha256"]
  prov = summaries[0]["provenance"]
  assert prov["deterministic"] is True and prov["corpus"]["source"] == "embedded"
  assert json.loads((tmp_path / "a" / "summary.json").read_text())["provenance"] == prov
  # another data order is another run (the comparison sees it from the first step)
  loop.train(cfg(seed=1), tmp_path / "d")
  other = bench.compare(a, _rows(tmp_path / "d"))
  assert other["differ"] > 0 and other["first"]["step"] == 1 and other["state_equal"] is False


def test_data_seed_follows_run_seed_unless_set(monkeypatch, tmp_path):
  """Only the data order reads data.seed; only the initialization reads run.seed."""
  from scaleopt.train import config as C, data as D, loop, step as step_lib
  seen = {}
  real_batches, real_init = D.Batches.__init__, step_lib.init_state

  def batches(self, *a, seed=0, **k):
    seen["data"] = seed
    real_batches(self, *a, seed=seed, **k)

  def init(model, tx, seed):
    seen["init"] = seed
    return real_init(model, tx, seed)

  monkeypatch.setattr(D.Batches, "__init__", batches)
  monkeypatch.setattr(step_lib, "init_state", init)
  run = {**_RUN, "steps": 1, "deterministic": False, "seed": 3}
  for data, want in (({}, 3), ({"seed": 5}, 5)):
    cfg = C.from_dict(tiny_raw(run=run, data=data))
    assert C.data_seed(cfg) == want
    loop.train(cfg, tmp_path / str(want))
    assert seen == {"data": want, "init": 3}


@pytest.mark.integration  # two processes, each compiling
def test_deterministic_runs_in_two_processes_are_bitwise_equal(tmp_path):
  """`scaleopt train` twice, each process with its own hash seed and no compilation cache."""
  cfg = tmp_path / "c.yaml"
  cfg.write_text(yaml.safe_dump(tiny_raw(run={**_RUN, "steps": 6, "progress": False})))
  for name, hash_seed in (("a", "1"), ("b", "2")):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONHASHSEED=hash_seed,
               JAX_ENABLE_COMPILATION_CACHE="false", PYTHONPATH=str(_ROOT))
    subprocess.run([sys.executable, "-m", "scaleopt.cli", "train", "--config", str(cfg),
                    "--out", str(tmp_path / name)], env=env, check=True, timeout=600,
                   capture_output=True)
  same = bench.compare(_rows(tmp_path / "a"), _rows(tmp_path / "b"))
  assert same["differ"] == 0 and same["state_equal"] is True and same["steps"] == 6, same


def test_the_benchmark_compares_bits_and_times_steps():
  row = {"step": 1, "loss": 2.5, "grad_norm": 0.1, "tokens_per_s": 10.0, "wall_s": 1.0}
  a = {"rows": [row, {**row, "step": 2}], "summary": {"state_sha256": "x"}}
  b = {"rows": [{**row, "wall_s": 9.0}, {**row, "step": 2, "tokens_per_s": 1.0}],
       "summary": {"state_sha256": "x"}}
  assert bench.compare(a, b) == {"values": 6, "differ": 0, "first": None, "steps": 2,
                                 "state_equal": True}
  nudged = np.nextafter(np.float32(0.1), np.float32(1.0))  # one float32 ulp
  b["rows"][1]["grad_norm"] = float(nudged)
  b["summary"]["state_sha256"] = "y"
  c = bench.compare(a, b)
  assert c["differ"] == 1 and c["first"]["key"] == "grad_norm" and c["first"]["step"] == 2
  assert c["state_equal"] is False
  assert bench.compare(a, {"rows": a["rows"][:1], "summary": {}})["differ"] == 3  # step missing
  rows = [{"timed_steps": n, "train_s": 0.5 * n} for n in range(1, 9)]
  assert bench.ms_per_step(rows) == pytest.approx(500.0)


def test_the_benchmark_times_against_the_same_and_the_fastest_kernels():
  cudnn = {"attention": "cudnn", "loss": "pallas", "norm": "pallas", "glu": "xla"}
  xla = {**cudnn, "attention": "xla"}
  assert bench.same_kernels(xla, cudnn) == ["model.attention_impl=xla"]
  assert bench.same_kernels(xla, xla) == [] and bench.same_kernels(None, cudnn) == []
  run = lambda tag, d, k, ms: {"tag": tag, "deterministic": d, "kernels": k, "ms_per_step": ms}
  runs = [run("det1", True, xla, 230.0), run("nondet1", False, cudnn, 100.0),
          run("det2", True, xla, 240.0), run("nondet_same", False, xla, 200.0),
          run("nondet2", False, cudnn, 120.0)]
  bench.ratios(runs)
  got = {r["tag"]: (r["vs_same"], r["vs_fastest"]) for r in runs}
  assert got["det1"] == (pytest.approx(230 / 200 - 1), pytest.approx(230 / 110 - 1))
  assert got["det2"] == (pytest.approx(240 / 200 - 1), pytest.approx(240 / 110 - 1))
  assert got["nondet_same"] == (None, pytest.approx(200 / 110 - 1))
  assert got["nondet1"] == got["nondet2"] == (None, None)  # the fastest kernels themselves
  plan = [t for t, _, _ in bench.make_plan(2)]
  assert plan == ["det1", "nondet1", "det2", "nondet2"]


def test_the_benchmark_adds_a_run_with_the_deterministic_kernels(monkeypatch, tmp_path):
  """Where the deterministic runs resolved to other kernels (a GPU), one run without the
  switch takes their kernels, fourth; where they agree (the CPU), none is added."""
  calls = []

  def fake_launch(args, tag, deterministic, log, extra=()):
    calls.append((tag, list(extra)))
    attention = "xla" if deterministic or "model.attention_impl=xla" in extra else gpu[0]
    for opt in args.optimizers.split(","):
      d = log.parent.parent / "runs" / f"{opt}_{tag}"  # log: OUT/logs/TAG.log
      d.mkdir(parents=True, exist_ok=True)
      (d / "summary.json").write_text(json.dumps({"kernels": {"attention": attention}}))
    return 0

  monkeypatch.setattr(bench, "launch", fake_launch)
  args = type("A", (), {"nondet_runs": 2, "deadline": 0.0, "optimizers": "adamw,loo"})
  gpu = ["cudnn"]
  plan, rcs = bench.run_plan(args, tmp_path, ["adamw", "loo"])
  assert [c[0] for c in calls] == ["det1", "nondet1", "det2", "nondet_same", "nondet2"]
  assert dict(calls)["nondet_same"] == ["model.attention_impl=xla"] and len(rcs) == 5
  calls.clear()
  gpu[0] = "xla"
  bench.run_plan(args, tmp_path / "cpu", ["adamw", "loo"])
  assert [c[0] for c in calls] == ["det1", "nondet1", "det2", "nondet2"]


def test_the_benchmark_runs_a_refused_attention_only_in_its_deterministic_runs(monkeypatch):
  """``--det-attention``: the deterministic runs set that attention, and the benchmark's
  processes let exactly that one through the switch's refusal."""
  monkeypatch.setattr(det, "model_config", det.model_config)  # undone after the test
  args = argparse.Namespace(
      shape="config", data=None, steps=2, set=[], det_attention="tokamax_mosaic")
  assert "model.attention_impl=tokamax_mosaic" in bench.run_overrides(args, "adamw", True)
  assert not any("attention_impl" in o for o in bench.run_overrides(args, "adamw", False))
  bench.allow_attention(det, "tokamax_mosaic")
  cfg = _train_cfg(attention_impl="tokamax_mosaic")
  assert det.model_spec(cfg, platform="gpu", environ={}) is cfg.model
  assert det.model_spec(_train_cfg(), platform="gpu",  # auto: still XLA's attention
                        environ={}).config.attention_impl == "xla"
  with pytest.raises(ConfigError, match="tokamax_triton"):
    det.model_spec(_train_cfg(attention_impl="tokamax_triton"), platform="gpu", environ={})
