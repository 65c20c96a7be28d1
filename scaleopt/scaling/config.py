"""Sweep configuration: schema, defaults, YAML loading, dotted overrides, validation.

A sweep config has five sections (see `configs/sweeps/paper.yaml` for a documented example):

  problem    the random-feature regression family (spectrum convention, s grid, M, N grid, ...)
  train      step budget T, learning-rate policy
  optimizers name -> {kind, hyper-parameters}; a list-valued hyper-parameter is a grid axis
  fit        N range, excess loss, interval method, bootstrap resamples and level, baseline
             optimizer, sliding-window width of the fit-window report
  compute    float64, problems per jitted call, devices

Every error names the offending key and its allowed values. `problem.seeds` is the number K
of independent problem draws (the clusters the intervals resample); K = 1 is an error, K = 2 is
allowed with a loud warning at run time (its t interval has one degree of freedom and is wide).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import pathlib
from typing import Any, Literal, Optional, Sequence

from scaleopt.config import ConfigError, check_keys, choice, convert, fail, parse, read_yaml, spec
from scaleopt.config import apply_overrides as _apply_overrides
from scaleopt.config import to_dict
from scaleopt.scaling.fit import INTERVAL_METHODS

SPECTRA = ("zipf", "mrs")
FEATURE_MAPS = ("linear", "relu", "tanh")
TEACHERS = ("isotropic", "powerlaw")
LR_POLICIES = ("best", "transfer")
LR_SCALES = ("abs", "curvature")
N_LAYOUTS = ("sliced", "padded")
SCHEDULES = ("constant", "linear", "cosine", "inv_sqrt")

# Optimizer kinds, their hyper-parameters and defaults. `lr_scale`: "curvature" means the
# learning rate is `lr / rho`, rho the largest eigenvalue of the preconditioned curvature
# (so lr is a multiple of the stable step, the same rule for every preconditioner); "abs"
# means lr is used as given.
OPTIMIZER_KINDS: dict[str, dict[str, Any]] = {
    "gd": {"lr": [0.25, 0.5, 1.0, 1.5, 1.9], "lr_scale": "curvature", "schedule": "constant"},
    "adam": {"lr": [1e-3, 3e-3, 1e-2, 3e-2, 1e-1], "b1": 0.9, "b2": 0.999, "eps": 1e-8,
             "lr_scale": "abs", "schedule": "constant"},
    "kron_sqrt": {"lr": [0.25, 0.5, 1.0, 1.5, 1.9], "damping": 1e-4,
                  "lr_scale": "curvature", "schedule": "constant"},
    "shampoo": {"lr": [1e-2, 3e-2, 1e-1, 3e-1], "eps": 1e-8, "lr_scale": "abs",
                "schedule": "constant"},
    "msign": {"lr": [1e-2, 3e-2, 1e-1, 3e-1, 1.0], "momentum": 0.0, "ns_steps": 40,
              "lr_scale": "abs", "schedule": "linear"},
    "ng": {"lr": [1.0], "damping": 1e-4, "lr_scale": "curvature", "schedule": "constant"},
}
# Hyper-parameters that may be lists (grid axes, vmapped); the rest must be scalars / strings.
GRID_KEYS = {"lr", "damping", "b1", "b2", "eps", "momentum"}



@dataclasses.dataclass
class Problem:
  spectrum: Literal[SPECTRA] = "zipf"
  s: list[float] = spec(default_factory=lambda: [0.5, 0.75, 1.0, 1.25, 1.5, 2.0], gt=0,
                        listify=True)
  latent_dim: int = spec(4096, min=1)
  n_features: list[int] = spec(default_factory=lambda: [32, 64, 128, 256, 512, 1024], min=1,
                               listify=True, distinct=True, sort=True)
  d_out: int = spec(8, min=1)
  feature_map: Literal[FEATURE_MAPS] = "linear"
  teacher: Literal[TEACHERS] = "isotropic"
  teacher_beta: float = 0.0
  noise: float = spec(0.0, min=0)
  n_train: Optional[int] = spec(None, min=1)
  n_test: int = spec(16384, min=1)
  seeds: int = spec(5, min=1)
  seed: int = spec(0, min=0)


@dataclasses.dataclass
class Train:
  steps: int = spec(10, min=1)
  lr_policy: Literal[LR_POLICIES] = "best"
  transfer_n: int = spec(256, min=1)


@dataclasses.dataclass
class Fit:
  n_min: Optional[int] = spec(None, min=1)
  n_max: Optional[int] = spec(None, min=1)
  excess: bool = True
  bootstrap: int = spec(1000, min=2)
  ci: float = 0.95
  baseline: str = "gd"
  steps: Optional[int] = None
  interval: Literal[INTERVAL_METHODS] = "cluster_t"
  window: int = spec(3, min=2)


@dataclasses.dataclass
class Compute:
  x64: bool = True
  chunk: int = spec(0, min=0)
  devices: int = spec(1, min=1)
  progress: bool = True
  blas_threads: Optional[int] = spec(1, min=0)
  n_layout: Literal[N_LAYOUTS] = "sliced"


SECTIONS = {"problem": Problem, "train": Train, "fit": Fit, "compute": Compute}
DEFAULTS: dict[str, Any] = {"name": "sweep", **{k: to_dict(c()) for k, c in SECTIONS.items()},
                            "optimizers": {"gd": {}, "ng": {}}}


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  """One optimizer of the sweep: its name, kind, fixed settings and hyper-parameter grid.

  `grid` is a list of dicts (the cartesian product of every list-valued hyper-parameter); the
  sweep vmaps over it.
  """
  name: str
  kind: str
  fixed: dict[str, Any]
  grid: list[dict[str, float]]

  @property
  def grid_keys(self) -> list[str]:
    return sorted(self.grid[0])


def _merge(base: dict, new: dict) -> dict:
  out = copy.deepcopy(base)
  for k, v in new.items():
    if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "optimizers":
      out[k] = _merge(out[k], v)
    else:
      out[k] = copy.deepcopy(v)
  return out


def apply_overrides(raw: dict, overrides: Sequence[str]) -> dict:
  """Apply `a.b=v` strings (v parsed as YAML) to a nested dict, creating optimizer entries."""
  return _apply_overrides(raw, overrides)


def parse_optimizers(raw: dict) -> list[OptimizerSpec]:
  """Validate the `optimizers` section into specs with their hyper-parameter grids."""
  if not isinstance(raw, dict) or not raw:
    raise ConfigError("optimizers: expected a mapping name -> settings with at least one entry; "
                      f"kinds are {', '.join(OPTIMIZER_KINDS)}")
  specs = []
  for name, settings in raw.items():
    settings = dict(settings or {})
    kind = settings.pop("kind", name)
    choice(kind, f"optimizers.{name}.kind", list(OPTIMIZER_KINDS))
    defaults = OPTIMIZER_KINDS[kind]
    check_keys(settings, list(defaults), f"optimizers.{name}")
    merged = {**defaults, **settings}
    choice(merged["lr_scale"], f"optimizers.{name}.lr_scale", LR_SCALES)
    choice(merged["schedule"], f"optimizers.{name}.schedule", SCHEDULES)
    axes = {}
    fixed = {}
    for k, v in merged.items():
      if k in GRID_KEYS:
        meta = {"listify": True, **({} if k == "momentum" else {"gt": 0})}
        axes[k] = convert(v, list[float], f"optimizers.{name}.{k}", meta)
      else:
        fixed[k] = v
    keys = sorted(axes)
    grid = [dict(zip(keys, combo)) for combo in itertools.product(*(axes[k] for k in keys))]
    specs.append(OptimizerSpec(name=name, kind=kind, fixed=fixed, grid=grid))
  return specs


def validate(cfg: dict) -> dict:
  """Check every section; returns the config with types normalised. Raises ConfigError."""
  check_keys(cfg, list(DEFAULTS), "")
  sec = {k: parse(c, cfg[k], k) for k, c in SECTIONS.items()}
  p, t, f, c = sec["problem"], sec["train"], sec["fit"], sec["compute"]
  if p.seeds < 2:
    raise fail("problem.seeds", p.seeds, "need at least 2 independent problem draws for an "
               "interval (4 or more recommended)")
  if max(p.n_features) > p.latent_dim and p.feature_map == "linear":
    raise ConfigError(f"problem.n_features: max {max(p.n_features)} exceeds "
                      f"problem.latent_dim = {p.latent_dim} (linear features have rank <= M)")
  if t.lr_policy == "transfer" and t.transfer_n not in p.n_features:
    raise fail("train.transfer_n", t.transfer_n,
               f"allowed values are the problem.n_features {p.n_features}")
  specs = parse_optimizers(cfg["optimizers"])
  choice(f.baseline, "fit.baseline", [o.name for o in specs])
  f.n_min = min(p.n_features) if f.n_min is None else f.n_min
  f.n_max = max(p.n_features) if f.n_max is None else f.n_max
  if len([n for n in p.n_features if f.n_min <= n <= f.n_max]) < 2:
    raise ConfigError(f"fit.n_min/fit.n_max = {f.n_min}/{f.n_max}: need at least two of "
                      f"problem.n_features {p.n_features} inside the range")
  f.steps = t.steps if f.steps is None else f.steps
  if not 1 <= f.steps <= t.steps:
    raise fail("fit.steps", f.steps, f"allowed values are 1..train.steps ({t.steps})")
  if not 0 < f.ci < 1:
    raise fail("fit.ci", f.ci, "must be in (0, 1)")
  c.blas_threads = c.blas_threads or 0
  return {**cfg, **{k: to_dict(v) for k, v in sec.items()}}


def load_config(path: str | pathlib.Path | dict | None = None,
                overrides: Sequence[str] = ()) -> dict:
  """Read a YAML file (or take a dict), merge over DEFAULTS, apply overrides, validate."""
  if path is None:
    raw = {}
  elif isinstance(path, dict):
    raw = path
  else:
    raw = read_yaml(path)
    raw = {} if raw is None else raw
  if not isinstance(raw, dict):
    raise ConfigError(f"config {path}: expected a mapping of sections, got "
                      f"{type(raw).__name__}")
  raw = apply_overrides(raw, overrides)
  if "optimizers" in raw and not isinstance(raw["optimizers"], dict):
    raise ConfigError("optimizers: expected a mapping name -> settings")
  cfg = _merge(DEFAULTS, raw)
  if "optimizers" in raw:
    cfg["optimizers"] = raw["optimizers"]
  return validate(cfg)
