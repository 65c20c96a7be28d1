"""The vmapped, padded sweep against independent references (one-at-a-time runs, closed forms)."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scaleopt.scaling import config, problem, sweep, theory

# the tiny configs use two draws on purpose (speed); their small-sample warning is expected
pytestmark = pytest.mark.filterwarnings("ignore::scaleopt.scaling.sweep.SmallSampleWarning")

ALL_KINDS = {
    "gd": {"lr": [0.5, 1.5]},
    "adam": {"lr": [1e-2, 1e-1]},
    "kron_sqrt": {"lr": [1.0], "damping": [1e-3, 1e-1]},
    "shampoo": {"lr": [3e-2]},
    "msign": {"lr": [0.1], "momentum": [0.0, 0.5]},
    "ng": {"lr": [1.0, 0.5], "damping": 1e-6},
}


def tiny_cfg(**problem_overrides):
  raw = {
      "problem": {"s": [1.0, 1.7], "latent_dim": 96, "n_features": [8, 16, 24], "d_out": 3,
                  "seeds": 2, **problem_overrides},
      "train": {"steps": 5},
      "optimizers": ALL_KINDS,
      "fit": {"bootstrap": 50},
      "compute": {"progress": False},
  }
  return config.load_config(raw)


@pytest.fixture(scope="module")
def tiny_result():
  cfg = tiny_cfg()
  cfg["compute"]["n_layout"] = "padded"
  return cfg, sweep.run_sweep(cfg)


def test_sliced_layout_equals_the_padded_one_everywhere(tiny_result):
  """The sliced layout (one vmapped program per N) against the padded one, which the next test
  checks against one-at-a-time runs: every optimizer, s, seed, N and hyperparameter."""
  cfg, padded = tiny_result
  sliced = sweep.run_sweep({**cfg, "compute": {**cfg["compute"], "n_layout": "sliced"}})
  assert sorted(sliced.losses) == sorted(padded.losses)
  for name, arr in padded.losses.items():
    np.testing.assert_allclose(sliced.losses[name], arr, rtol=1e-9, atol=1e-12, err_msg=name)


def test_padded_vmapped_sweep_equals_one_at_a_time(tiny_result):
  """Every kind at one padded N (N_max is the same vmapped program without padding), the
  padded Ns taken in turn so that each is checked, on half of the (s, seed, hyperparameter)
  grid: one compile of the reference per kind. The sliced layout (one program per N, no
  padding) equals the padded one at every point (the test above)."""
  cfg, res = tiny_result
  padded = [int(n) for n in res.n[:-1]]
  checked = set()
  for k, (name, arr) in enumerate(res.losses.items()):
    j = k % len(padded)
    for i, s in enumerate(res.s):
      for seed in range(cfg["problem"]["seeds"]):
        for h, hyper in enumerate(res.grids[name]):
          if (i + seed + h) % 2:
            continue
          ref = sweep.run_single(cfg, s, seed, padded[j], name, hyper)
          np.testing.assert_allclose(arr[i, seed, j, h], ref, rtol=1e-9, atol=1e-12,
                                     err_msg=f"{name} s={s} seed={seed} N={padded[j]} {hyper}")
          checked.add((name, padded[j]))
  assert {k for k, _ in checked} == set(res.losses) and {n for _, n in checked} == set(padded)
  assert all(np.all(np.isfinite(a)) for a in res.losses.values())


@pytest.mark.integration  # two more sweeps; the padded-vmapped equality above stays fast
def test_finite_data_and_nonlinear_features_also_match_single():
  """Finite training data with label noise (relu: the training quadratic is sampled), and tanh
  features (no closed-form kernel: train and test statistics differ) against one-at-a-time
  runs."""
  for fm, n_train in (("relu", 64), ("tanh", None)):
    cfg = tiny_cfg(feature_map=fm, n_train=n_train, noise=0.3, n_test=512)
    cfg["optimizers"] = {"gd": {"lr": [1.0]}, "ng": {"damping": 1e-3}}
    res = sweep.run_sweep(cfg)
    for name in ("gd", "ng"):
      ref = sweep.run_single(cfg, 1.7, 1, 16, name, res.grids[name][0])
      np.testing.assert_allclose(res.losses[name][1, 1, 1, 0], ref, rtol=1e-9)


def _stats(cfg, s, seed, n):
  spec = problem.ProblemSpec.from_config(cfg["problem"])
  with jax.enable_x64(True):
    q = problem.sample_problem(sweep.problem_keys(cfg["problem"]["seed"], 2)[seed],
                               jnp.asarray(s, jnp.float64), spec)
    return (np.asarray(q.a_train)[:n, :n], np.asarray(q.b_train)[:, :n], float(q.c_test))


@pytest.mark.parametrize("kind,lr,damping", [("gd", 1.0, 0.0), ("gd", 1.9, 0.0),
                                              ("ng", 1.0, 1e-3), ("ng", 0.7, 1e-2),
                                              ("kron_sqrt", 1.5, 1e-3)])
def test_closed_form_loss_equals_simulation(kind, lr, damping):
  cfg = tiny_cfg()
  cfg["train"]["steps"] = 12
  hyper = {"lr": lr} if kind == "gd" else {"lr": lr, "damping": damping}
  cfg["optimizers"] = {kind: {k: [v] for k, v in hyper.items()}}
  sim = sweep.run_single(cfg, 1.3, 1, 24, kind, hyper)
  a, b, c = _stats(cfg, 1.3, 1, 24)
  closed = theory.closed_form_loss(a, b, c, np.arange(13), kind, lr, damping)
  np.testing.assert_allclose(sim, closed, rtol=1e-8)
  assert sim[-1] < 0.9 * sim[0]


def test_population_statistics_match_monte_carlo_numpy():
  """Exact linear/ReLU population statistics vs a plain-numpy Monte-Carlo estimate."""
  rng = np.random.default_rng(0)
  for fm in ("linear", "relu"):
    spec = problem.ProblemSpec(latent_dim=20, n_max=6, d_out=2, feature_map=fm)
    with jax.enable_x64(True):
      key = jax.random.key(3)
      q = problem.sample_problem(key, jnp.asarray(1.2, jnp.float64), spec)
      ku, kw, _, _ = jax.random.split(key, 4)
      u = np.asarray(jax.random.normal(ku, (6, 20), jnp.float64)) / np.sqrt(20)
      w = np.asarray(jax.random.normal(kw, (2, 20), jnp.float64))
    lam = np.arange(1, 21) ** -1.2
    x = rng.standard_normal((400_000, 20)) * np.sqrt(lam)
    z = x @ u.T
    if fm == "relu":
      z = np.maximum(z, 0)
    y = x @ w.T
    for exact, prod in ((q.a_test, z[:, :, None] * z[:, None, :]),
                        (q.b_test, y[:, :, None] * z[:, None, :]),
                        (q.c_test, (y * y).sum(1))):
      se = prod.std(axis=0) / np.sqrt(len(x))  # Monte-Carlo standard error per entry
      assert np.all(np.abs(np.asarray(exact) - prod.mean(axis=0)) < 5 * se + 1e-12), fm


@pytest.mark.integration  # a whole sweep: the second tier
def test_small_preset_ng_steeper_than_gd_at_s1():
  root = pathlib.Path(__file__).resolve().parents[2]
  cfg = config.load_config(root / "configs/sweeps/small.yaml",
                           ["problem.s=[1.0]", "compute.progress=false"])
  rows, _ = sweep.summarize(sweep.run_sweep(cfg))
  alpha = {r["optimizer"]: r for r in rows}
  assert alpha["ng"]["alpha"] > alpha["gd"]["alpha"] + 0.05
  assert alpha["ng"]["ci_low"] > alpha["gd"]["ci_high"]


def test_x64_does_not_leak(tiny_result):
  assert jnp.zeros(1).dtype == jnp.float32
  assert tiny_result[1].losses["gd"].dtype == np.float64


def test_transfer_policy_uses_one_lr_for_every_n(tiny_result):
  cfg, res = tiny_result
  cfg = {**cfg, "train": {**cfg["train"], "lr_policy": "transfer", "transfer_n": 16}}
  res_t = sweep.SweepResult(cfg, res.s, res.n, res.losses, res.grids, res.floor, res.timing)
  _, loss_rows = sweep.summarize(res_t, bootstrap=0)
  for s in res.s:
    lrs = {r["hp_lr"] for r in loss_rows if r["optimizer"] == "gd" and r["s"] == s}
    assert len(lrs) == 1


@pytest.mark.integration
def test_sweep_split_across_two_devices_matches_one(tmp_path):
  """compute.devices=2 shards each chunk over 2 (forced host) devices; same numbers."""
  import subprocess
  import sys
  import textwrap
  code = textwrap.dedent("""
      import numpy as np, jax
      from scaleopt.scaling import config, sweep
      assert len(jax.devices()) == 2
      raw = {"problem": {"s": [1.0, 1.5], "latent_dim": 64, "n_features": [8, 16], "d_out": 2,
                         "seeds": 3},
             "train": {"steps": 4}, "optimizers": {"gd": {}, "msign": {}, "ng": {}},
             "compute": {"progress": False, "chunk": 3}}
      a = sweep.run_sweep(config.load_config(raw))
      raw["compute"]["devices"] = 2
      b = sweep.run_sweep(config.load_config(raw))
      for k in a.losses:
        np.testing.assert_allclose(a.losses[k], b.losses[k], rtol=1e-12)
      print("OK")
  """)
  env = {**__import__("os").environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
         "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(pathlib.Path(__file__).resolve().parents[2])}
  out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]
