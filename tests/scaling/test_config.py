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
    ("optimizers.gd.beta=3", "optimizers.gd: unknown key(s) beta; allowed keys are"),
    ("fit.baseline=sgd", "fit.baseline = 'sgd': allowed values are"),
    ("fit.steps=999", "fit.steps = 999: allowed values are 1..train.steps"),
    ("problem.latent_dim=100", "exceeds problem.latent_dim = 100"),
    ("problem.typo=1", "problem: unknown key(s) typo"),
    ("train.steps", "expected KEY=VALUE"),
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
