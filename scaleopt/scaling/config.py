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
from typing import Any, Sequence

import yaml

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

DEFAULTS: dict[str, Any] = {
    "name": "sweep",
    "problem": {
        "spectrum": "zipf",
        "s": [0.5, 0.75, 1.0, 1.25, 1.5, 2.0],
        "latent_dim": 4096,
        "n_features": [32, 64, 128, 256, 512, 1024],
        "d_out": 8,
        "feature_map": "linear",
        "teacher": "isotropic",
        "teacher_beta": 0.0,
        "noise": 0.0,
        "n_train": None,
        "n_test": 16384,
        "seeds": 5,
        "seed": 0,
    },
    "train": {"steps": 10, "lr_policy": "best", "transfer_n": 256},
    "optimizers": {"gd": {}, "ng": {}},
    "fit": {"n_min": None, "n_max": None, "excess": True, "bootstrap": 1000, "ci": 0.95,
            "baseline": "gd", "steps": None, "interval": "cluster_t", "window": 3},
    "compute": {"x64": True, "chunk": 0, "devices": 1, "progress": True, "blas_threads": 1,
                "n_layout": "sliced"},
}


class ConfigError(ValueError):
  """A sweep config value is missing, of the wrong type or not among the allowed values."""


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
  raw = copy.deepcopy(raw)
  for item in overrides or ():
    if "=" not in item:
      raise ConfigError(f"override {item!r}: expected KEY=VALUE with a dotted KEY, e.g. "
                        "train.steps=30")
    key, value = item.split("=", 1)
    parts = key.strip().split(".")
    node = raw
    for p in parts[:-1]:
      if p not in node or node[p] is None:
        node[p] = {}
      if not isinstance(node[p], dict):
        raise ConfigError(f"override {key!r}: {p!r} is not a section")
      node = node[p]
    try:
      node[parts[-1]] = yaml.safe_load(value)
    except yaml.YAMLError:
      raise ConfigError(f"override {item!r}: the value is not valid YAML") from None
  return raw


def _choice(value: Any, key: str, allowed: Sequence[str]) -> str:
  if value not in allowed:
    raise ConfigError(f"{key} = {value!r}: allowed values are {', '.join(map(str, allowed))}")
  return value


def _num_list(value: Any, key: str, cast=float, positive: bool = True) -> list:
  vals = value if isinstance(value, (list, tuple)) else [value]
  try:
    out = [cast(v) for v in vals]
  except (TypeError, ValueError):
    raise ConfigError(f"{key} = {value!r}: expected a number or a list of numbers") from None
  if not out:
    raise ConfigError(f"{key}: expected at least one value")
  if positive and any(v <= 0 for v in out):
    raise ConfigError(f"{key} = {value!r}: values must be > 0")
  return out


def _int(value: Any, key: str, minimum: int | None = None) -> int:
  """An integer (an integer-valued float such as 16.0 is accepted; 16.9, True, '16' are not)."""
  ok = isinstance(value, int) and not isinstance(value, bool)
  if isinstance(value, float) and value.is_integer():
    value, ok = int(value), True
  if not ok:
    raise ConfigError(f"{key} = {value!r}: expected an integer")
  if minimum is not None and value < minimum:
    raise ConfigError(f"{key} = {value!r}: must be an integer >= {minimum}")
  return int(value)


def _int_list(value: Any, key: str, minimum: int = 1) -> list[int]:
  """Distinct integers >= minimum, sorted; duplicates are an error (they would count twice)."""
  vals = value if isinstance(value, (list, tuple)) else [value]
  if not vals:
    raise ConfigError(f"{key}: expected at least one value")
  out = [_int(v, key, minimum) for v in vals]
  dup = sorted({v for v in out if out.count(v) > 1})
  if dup:
    raise ConfigError(f"{key} = {value!r}: duplicate value(s) {', '.join(map(str, dup))}")
  return sorted(out)


def _check_keys(section: dict, allowed: Sequence[str], where: str) -> None:
  unknown = sorted(set(section) - set(allowed))
  if unknown:
    raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed keys are "
                      f"{', '.join(sorted(allowed))}")


def parse_optimizers(raw: dict) -> list[OptimizerSpec]:
  """Validate the `optimizers` section into specs with their hyper-parameter grids."""
  if not isinstance(raw, dict) or not raw:
    raise ConfigError("optimizers: expected a mapping name -> settings with at least one entry; "
                      f"kinds are {', '.join(OPTIMIZER_KINDS)}")
  specs = []
  for name, settings in raw.items():
    settings = dict(settings or {})
    kind = settings.pop("kind", name)
    _choice(kind, f"optimizers.{name}.kind", list(OPTIMIZER_KINDS))
    defaults = OPTIMIZER_KINDS[kind]
    _check_keys(settings, list(defaults), f"optimizers.{name}")
    merged = {**defaults, **settings}
    _choice(merged["lr_scale"], f"optimizers.{name}.lr_scale", LR_SCALES)
    _choice(merged["schedule"], f"optimizers.{name}.schedule", SCHEDULES)
    axes = {}
    fixed = {}
    for k, v in merged.items():
      if k in GRID_KEYS:
        axes[k] = _num_list(v, f"optimizers.{name}.{k}", positive=k not in ("momentum",))
      else:
        fixed[k] = v
    keys = sorted(axes)
    grid = [dict(zip(keys, combo)) for combo in itertools.product(*(axes[k] for k in keys))]
    specs.append(OptimizerSpec(name=name, kind=kind, fixed=fixed, grid=grid))
  return specs


def validate(cfg: dict) -> dict:
  """Check every section; returns the config with types normalised. Raises ConfigError."""
  _check_keys(cfg, list(DEFAULTS), "config")
  for section in ("problem", "train", "fit", "compute"):
    if not isinstance(cfg[section], dict):
      raise ConfigError(f"{section} = {cfg[section]!r}: expected a mapping of keys")
  p = cfg["problem"]
  _check_keys(p, list(DEFAULTS["problem"]), "problem")
  _choice(p["spectrum"], "problem.spectrum", SPECTRA)
  _choice(p["feature_map"], "problem.feature_map", FEATURE_MAPS)
  _choice(p["teacher"], "problem.teacher", TEACHERS)
  p["s"] = _num_list(p["s"], "problem.s")
  p["n_features"] = _int_list(p["n_features"], "problem.n_features")
  for k in ("latent_dim", "d_out", "n_test"):
    p[k] = _int(p[k], f"problem.{k}", 1)
  p["seeds"] = _int(p["seeds"], "problem.seeds", 1)
  if p["seeds"] < 2:
    raise ConfigError(f"problem.seeds = {p['seeds']}: need at least 2 independent problem draws "
                      "for an interval (4 or more recommended)")
  if p["n_train"] is not None:
    p["n_train"] = _int(p["n_train"], "problem.n_train", 1)
  p["noise"] = float(p["noise"])
  if p["noise"] < 0:
    raise ConfigError(f"problem.noise = {p['noise']}: must be >= 0")
  p["teacher_beta"] = float(p["teacher_beta"])
  p["seed"] = _int(p["seed"], "problem.seed", 0)
  if max(p["n_features"]) > p["latent_dim"] and p["feature_map"] == "linear":
    raise ConfigError(f"problem.n_features: max {max(p['n_features'])} exceeds "
                      f"problem.latent_dim = {p['latent_dim']} (linear features have rank <= M)")
  t = cfg["train"]
  _check_keys(t, list(DEFAULTS["train"]), "train")
  t["steps"] = _int(t["steps"], "train.steps", 1)
  _choice(t["lr_policy"], "train.lr_policy", LR_POLICIES)
  t["transfer_n"] = _int(t["transfer_n"], "train.transfer_n", 1)
  if t["lr_policy"] == "transfer" and t["transfer_n"] not in p["n_features"]:
    raise ConfigError(f"train.transfer_n = {t['transfer_n']}: allowed values are the "
                      f"problem.n_features {p['n_features']}")
  specs = parse_optimizers(cfg["optimizers"])
  f = cfg["fit"]
  _check_keys(f, list(DEFAULTS["fit"]), "fit")
  names = [s.name for s in specs]
  _choice(f["baseline"], "fit.baseline", names)
  f["n_min"] = min(p["n_features"]) if f["n_min"] is None else _int(f["n_min"], "fit.n_min", 1)
  f["n_max"] = max(p["n_features"]) if f["n_max"] is None else _int(f["n_max"], "fit.n_max", 1)
  in_range = [n for n in p["n_features"] if f["n_min"] <= n <= f["n_max"]]
  if len(in_range) < 2:
    raise ConfigError(f"fit.n_min/fit.n_max = {f['n_min']}/{f['n_max']}: need at least two of "
                      f"problem.n_features {p['n_features']} inside the range")
  f["steps"] = t["steps"] if f["steps"] is None else _int(f["steps"], "fit.steps")
  if not 1 <= f["steps"] <= t["steps"]:
    raise ConfigError(f"fit.steps = {f['steps']}: allowed values are 1..train.steps "
                      f"({t['steps']})")
  f["bootstrap"] = _int(f["bootstrap"], "fit.bootstrap", 2)
  _choice(f["interval"], "fit.interval", INTERVAL_METHODS)
  f["window"] = _int(f["window"], "fit.window", 2)
  f["ci"] = _num_list(f["ci"], "fit.ci")[0]
  if not 0 < f["ci"] < 1:
    raise ConfigError(f"fit.ci = {f['ci']}: must be in (0, 1)")
  c = cfg["compute"]
  _check_keys(c, list(DEFAULTS["compute"]), "compute")
  c["chunk"] = _int(c["chunk"], "compute.chunk", 0)
  c["devices"] = _int(c["devices"], "compute.devices", 1)
  c["blas_threads"] = _int(c["blas_threads"] or 0, "compute.blas_threads", 0)
  _choice(c["n_layout"], "compute.n_layout", N_LAYOUTS)
  return cfg


def _read_yaml(path: pathlib.Path) -> Any:
  """Parse a YAML file; a syntax error becomes one ConfigError line with its position."""
  try:
    return yaml.safe_load(path.read_text()) or {}
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    what = getattr(e, "problem", None) or str(e).splitlines()[0]
    raise ConfigError(f"config file {path}: YAML syntax error{where}: {what}") from None
  except (OSError, UnicodeDecodeError) as e:
    raise ConfigError(f"config file {path}: cannot read ({e.__class__.__name__}: {e})") from None


def load_config(path: str | pathlib.Path | dict | None = None,
                overrides: Sequence[str] = ()) -> dict:
  """Read a YAML file (or take a dict), merge over DEFAULTS, apply overrides, validate."""
  if path is None:
    raw = {}
  elif isinstance(path, dict):
    raw = path
  else:
    path = pathlib.Path(path)
    if not path.exists():
      raise ConfigError(f"config file {path} does not exist")
    if path.is_dir():
      raise ConfigError(f"config file {path} is a directory")
    raw = _read_yaml(path)
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
