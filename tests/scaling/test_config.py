"""Config errors name the key and the allowed values; overrides reach nested keys."""

import pathlib

import pytest

from scaleopt.scaling import config

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("override,needle", [
    ("problem.spectrum=lognormal", "problem.spectrum = 'lognormal': allowed values are zipf, mrs"),
    ("problem.feature_map=gelu", "problem.feature_map = 'gelu': allowed values are linear"),
    ("train.lr_policy=median", "train.lr_policy = 'median': allowed values are best, transfer"),
    ("optimizers.gd.lr_scale=huge", "optimizers.gd.lr_scale = 'huge': allowed values are abs"),
    ("optimizers.lion={}", "optimizers.lion.kind = 'lion': allowed values are gd, adam"),
    ("optimizers.gd.beta=3", "unknown key(s) optimizers.gd.beta; allowed keys in optimizers.gd"),
    ("fit.baseline=sgd", "fit.baseline = 'sgd': allowed values are"),
    ("fit.steps=999", "fit.steps = 999: allowed values are 1..train.steps"),
    ("problem.latent_dim=100", "exceeds problem.latent_dim = 100"),
    ("problem.typo=1", "unknown key(s) problem.typo"),
    ("train.steps", "expected KEY=VALUE"),
    ("problem.n_features=[16.9, 32]", "problem.n_features = 16.9: expected an integer"),
    ("problem.n_features=[16, 32, 16]", "problem.n_features = [16, 32, 16]: duplicate value(s) 16"),
    ("problem.seeds=2.7", "problem.seeds = 2.7: expected an integer"),
    ("problem.seeds=1", "problem.seeds = 1: need at least 2 independent problem draws"),
    ("problem.seeds=0", "problem.seeds = 0: must be an integer >= 1"),
    ("fit.bootstrap=-5", "fit.bootstrap = -5: must be an integer >= 2"),
    ("fit.bootstrap=0", "fit.bootstrap = 0: must be an integer >= 2"),
    ("fit.bootstrap=10.5", "fit.bootstrap = 10.5: expected an integer"),
    ("fit.interval=normal", "fit.interval = 'normal': allowed values are cluster_t"),
    ("fit.window=1", "fit.window = 1: must be an integer >= 2"),
    ("train.steps=true", "train.steps = True: expected an integer"),
    ("problem=3", "problem = 3: expected a mapping"),
    ("problem.s=[1,", "override 'problem.s=[1,': the value is not valid YAML"),
])
def test_errors_name_key_and_allowed_values(override, needle):
  with pytest.raises(config.ConfigError) as e:
    config.load_config(ROOT / "configs/sweeps/small.yaml", [override])
  assert needle in str(e.value)


def test_presets_load_and_overrides_apply():
  for path in sorted((ROOT / "configs/sweeps").glob("*.yaml")):
    config.load_config(path)
  cfg = config.load_config(ROOT / "configs/sweeps/paper.yaml",
                           ["train.steps=7", "problem.s=[1.0, 2.0]", "optimizers.ng.damping=[1e-3]"])
  assert cfg["train"]["steps"] == 7 and cfg["problem"]["s"] == [1.0, 2.0]
  ng = next(o for o in config.parse_optimizers(cfg["optimizers"]) if o.name == "ng")
  assert {g["damping"] for g in ng.grid} == {1e-3} and len(ng.grid) == 5
  paper = config.load_config(ROOT / "configs/sweeps/paper.yaml")
  assert len(paper["problem"]["s"]) == 6 and len(paper["optimizers"]) >= 5


def test_grid_is_cartesian_product():
  specs = config.parse_optimizers({"kron_sqrt": {"lr": [0.5, 1.0, 1.5], "damping": [1e-4, 1e-2]}})
  assert len(specs[0].grid) == 6
  assert {(g["lr"], g["damping"]) for g in specs[0].grid} == {
      (a, b) for a in (0.5, 1.0, 1.5) for b in (1e-4, 1e-2)}


def test_integer_valued_floats_are_accepted():
  cfg = config.load_config(ROOT / "configs/sweeps/small.yaml",
                           ["problem.n_features=[32.0, 16]", "problem.seeds=3.0"])
  assert cfg["problem"]["n_features"] == [16, 32] and cfg["problem"]["seeds"] == 3
  assert isinstance(cfg["problem"]["seeds"], int)


def test_yaml_syntax_error_is_one_line_with_position(tmp_path):
  bad = tmp_path / "bad.yaml"
  bad.write_text("problem:\n  s: [1.0, 2.0\n  seeds: 4\n")
  with pytest.raises(config.ConfigError) as e:
    config.load_config(bad)
  msg = str(e.value)
  assert "\n" not in msg and str(bad) in msg and "YAML syntax error at line" in msg
  (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
  with pytest.raises(config.ConfigError, match="expected a mapping of sections"):
    config.load_config(tmp_path / "list.yaml")
