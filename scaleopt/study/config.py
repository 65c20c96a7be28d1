"""Study configs: a base training config plus a grid of arms, learning rates, seeds and keys.

A study file (``configs/studies/<name>.yaml``)::

  name: bc_tiny
  base: ../train/tiny.yaml        # a training config, relative to this file (optional)
  train: {run: {steps: 60}}       # merged over ``base`` (any training key, nested mappings)
  arms:                           # named overrides: dotted training keys -> values
    adamw: {}
    adamw_bc: {optimizer.name: adamw_bc, optimizer.extra: {mode: full, crossfit: loo},
               learning_rates: [1.0e-3, 3.0e-3],     # optional per-arm learning rates
               seeds: [0],                           # optional per-arm search seeds
               baseline: adamw}                      # optional: the arm's own baseline
  baseline: adamw                 # the arm every other arm is compared with (paired over seeds)
  compute_baselines: []           # arms used for the equal-gradient-pass comparison
  learning_rates: [1.0e-3, 3.0e-3]
  seeds: [0, 1]                   # every learning rate runs these seeds
  best_lr_seeds: []               # more seeds, run at each arm's best lr once it is known
  grid: {}                        # any other dotted key -> values, crossed with everything
  engine: {kind: vmap, cells_at_once: 4,   # vmap: lr/seed cells share one compiled step
           keep_checkpoints: false}        # false: a finished cell's checkpoints are deleted
  contrasts:                      # optional: [arm_a, arm_b, label] -> a - b, paired by seed
    - [adamw_bc, adamw, "the correction"]
  target_half_width: 0.05         # a contrast's wanted 95% half-width (the report's seed plan)
  sequential:                     # optional: more seeds only where a contrast is still open
    max_seeds: 6                  # seeds per arm at most (``seeds``, then the next integers)
    contrasts: [adamw_bc - adamw] # the contrasts that ask for seeds (default: all)
  twins:                          # optional: [arm_a, arm_b], arms with the same overrides,
    - [adamw_det, adamw_det_twin] # learning rates and seeds: the report checks that each
                                  # seed's two runs are bitwise equal (``study.twins``)

A cell is one point (arm, grid values, learning rate, seed); its training config is
``base <- train <- arm overrides <- grid values <- optimizer.learning_rate, run.seed``, an
ordinary ``TrainConfig``. Every cell's config is validated before anything runs; errors name
the study key (``arms.adamw_bc.optimizer.extra``) and exit with code 2.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import pathlib
import re
from typing import Any, Literal, Optional

from scaleopt.config import (ConfigError, check_keys, convert, fail, merge, parse, read_yaml,
                             set_dotted, spec)
from scaleopt.config import apply_overrides as _apply_overrides
from scaleopt.train import config as train_config

TOP_KEYS = ("name", "description", "base", "train", "arms", "baseline", "compute_baselines",
            "learning_rates", "seeds", "best_lr_seeds", "grid", "engine", "contrasts",
            "target_half_width", "sequential", "twins")
ENGINES = ("vmap", "loop")
TRAIN_SECTIONS = ("run", "data", "model", "optimizer", "mesh")
LR_KEY, SEED_KEY = "optimizer.learning_rate", "run.seed"
# Keys that do not change what a cell computes (output cadence, devices, how XLA computes and
# how the host picks the step's program); ignored when a cell folder is checked against the
# study.
COSMETIC = ("run.progress", "run.tensorboard", "run.plot", "run.async_checkpoint",
            "run.peak_flops", "run.keep_checkpoints", "run.checkpoint_every", "run.wandb",
            "run.wandb.", "run.profile", "run.profile.", "run.telemetry_every", "mesh.",
            "run.deterministic", "run.host_phases")
# Training keys added after cell folders were first recorded: the value an older folder's
# record (which lacks the key) ran with.
ADDED_KEYS = {"data.seed": None}
_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")


@dataclasses.dataclass
class Engine:
  kind: Literal[ENGINES] = "vmap"
  cells_at_once: int = spec(4, min=1)
  keep_checkpoints: bool = False


@dataclasses.dataclass
class Sequential:
  """``sequential``: seeds added at the best lr of both arms of each contrast named in
  ``contrasts`` (``"arm_a - arm_b"``; None: every contrast) whose 95% half-width is above the
  study's ``target_half_width``, up to ``max_seeds`` seeds per arm (``scaleopt.study.seedplan``)."""
  max_seeds: int = spec(min=2)
  contrasts: Optional[list[str]] = spec(None, distinct=True)


@dataclasses.dataclass(frozen=True)
class Cell:
  """One training run of a study."""
  arm: str
  grid: tuple  # ((dotted key, value), ...) in the study's grid order
  lr: float
  seed: int
  stage: int  # 1: learning-rate search, 2: extra seed at the arm's best lr, 3: sequential seed

  @property
  def condition(self) -> tuple:
    """(arm, grid): the cells whose best lr is chosen together."""
    return (self.arm, self.grid)

  @property
  def id(self) -> str:
    parts = [f"{k}={_fmt(v)}" for k, v in self.grid] + [f"lr={self.lr:g}", f"seed={self.seed}"]
    return f"{self.arm}/{','.join(parts)}"


@dataclasses.dataclass
class Study:
  name: str
  path: Optional[pathlib.Path]
  base: dict  # merged raw training config (before arm / grid / lr / seed)
  arms: dict  # name -> {"set": {dotted: value}, "learning_rates": [...]}
  baseline: str
  compute_baselines: list
  seeds: list
  best_lr_seeds: list
  grid: dict  # dotted key -> list of values
  engine: str
  cells_at_once: int
  keep_checkpoints: bool
  raw: dict
  contrasts: list = dataclasses.field(default_factory=list)  # [(arm_a, arm_b, label)]
  target_half_width: float = 0.05
  sequential: Optional[Sequential] = None
  twins: list = dataclasses.field(default_factory=list)  # [(arm_a, arm_b)]

  def grid_points(self) -> list[tuple]:
    keys = list(self.grid)
    return [tuple(zip(keys, vals)) for vals in itertools.product(*self.grid.values())]

  def lrs(self, arm: str) -> list[float]:
    return self.arms[arm]["learning_rates"]

  def arm_seeds(self, arm: str) -> list[int]:
    """The search seeds of ``arm``: its own ``seeds`` if set, else the study's."""
    return self.arms[arm].get("seeds") or self.seeds

  def search_cells(self) -> list[Cell]:
    """Stage 1: every arm x grid point x its learning rates x ``seeds``."""
    return [Cell(a, g, lr, s, 1) for a in self.arms for g in self.grid_points()
            for lr in self.lrs(a) for s in self.arm_seeds(a)]

  def best_lr_cells(self, arm: str, grid: tuple, best_lr: float) -> list[Cell]:
    """Stage 2: the ``best_lr_seeds`` not already run at the best lr."""
    return [Cell(arm, grid, best_lr, s, 2) for s in self.best_lr_seeds
            if s not in self.arm_seeds(arm)]

  def seed_sequence(self) -> list[int]:
    """Sequential mode's seeds, in order: ``seeds``, then the integers after their largest,
    ``sequential.max_seeds`` in all."""
    n = self.sequential.max_seeds if self.sequential else len(self.seeds)
    return (self.seeds + list(range(max(self.seeds) + 1, max(self.seeds) + 1 + n)))[:n]

  def sequential_cell(self, arm: str, grid: tuple, best_lr: float, seed: int) -> Cell:
    """Stage 3: a seed that sequential mode adds at the arm's best lr."""
    return Cell(arm, grid, best_lr, seed, 3)

  def cell_raw(self, cell: Cell) -> dict:
    """The raw training config of a cell (validate with ``train.config.from_dict``)."""
    raw = copy.deepcopy(self.base)
    for k, v in self.arms[cell.arm]["set"].items():
      set_dotted(raw, k, v)
    for k, v in cell.grid:
      set_dotted(raw, k, v)
    set_dotted(raw, LR_KEY, float(cell.lr))
    set_dotted(raw, SEED_KEY, int(cell.seed))
    return raw

  def cell_config(self, cell: Cell) -> train_config.TrainConfig:
    try:
      return train_config.from_dict(self.cell_raw(cell))
    except ConfigError as e:
      raise ConfigError(f"study cell {cell.id}: {e}") from None


def _fmt(v: Any) -> str:
  return f"{v:g}" if isinstance(v, float) else str(v)


def flatten(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    key = f"{prefix}{k}"
    if isinstance(v, dict) and v:
      out.update(flatten(v, key + "."))
    else:
      out[key] = v
  return out


def without_cosmetic(flat: dict, drop: tuple = ()) -> dict:
  """A flattened config without the ``COSMETIC`` keys (and without ``drop``); also a record
  written when a key that is cosmetic now was not yet."""
  skip = COSMETIC + tuple(drop)
  return {k: v for k, v in flat.items()
          if not any(k == c or (c.endswith(".") and k.startswith(c)) for c in skip)}


def fingerprint(cfg_dict: dict, drop: tuple = ()) -> dict:
  """The flattened config without cosmetic keys (and without ``drop``)."""
  return without_cosmetic(flatten(json.loads(json.dumps(cfg_dict))), drop)


def group_key(cfg: train_config.TrainConfig) -> str:
  """Cells with equal group keys differ only in learning rate and seed (one compiled step)."""
  fp = fingerprint(cfg.to_dict(), drop=(LR_KEY, SEED_KEY))
  return hashlib.sha1(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:12]


def _list(raw: dict, key: str, kind: type, default=None, allow_empty: bool = False) -> list:
  """A list of distinct numbers (``kind`` float: learning rates, > 0) or integers (seeds)."""
  v = raw.get(key, default)
  if allow_empty and v == []:
    return []
  meta = {"distinct": True, **({"gt": 0} if kind is float else {})}
  return convert(v, list[kind], key, meta)


def _arm(name: str, spec: Any, lrs: Optional[list]) -> dict:
  if not _NAME.match(str(name)):
    raise ConfigError(f"study key 'arms.{name}': arm names may use letters, digits and _ . + -")
  spec = {} if spec is None else spec
  if not isinstance(spec, dict):
    raise ConfigError(f"study key 'arms.{name}' must be a mapping of dotted training keys")
  sets = {}
  for k, v in spec.items():
    if k in ("learning_rates", "baseline", "seeds"):
      continue
    if "." not in k or k.split(".")[0] not in TRAIN_SECTIONS:
      raise ConfigError(f"study key 'arms.{name}.{k}' is not a dotted training key (e.g. "
                        f"optimizer.name) nor 'learning_rates'")
    if k in (LR_KEY, SEED_KEY):
      raise ConfigError(f"study key 'arms.{name}.{k}': set learning rates with "
                        "'learning_rates' and seeds with 'seeds'")
    sets[k] = v
  arm_lrs = _list(spec, "learning_rates", float) if "learning_rates" in spec else lrs
  if arm_lrs is None:
    raise ConfigError(f"study key 'learning_rates' is missing (and arm '{name}' has none)")
  seeds = _list(spec, "seeds", int) if "seeds" in spec else None
  return {"set": sets, "learning_rates": arm_lrs, "baseline": spec.get("baseline"),
          "seeds": seeds}


def _contrasts(raw: Any, arms: dict) -> list[tuple]:
  """``contrasts``: a list of [arm_a, arm_b, label]; each arm must exist, a != b."""
  if raw is None:
    return []
  if not isinstance(raw, list):
    raise ConfigError("study key 'contrasts' must be a list of [arm_a, arm_b, label]")
  out = []
  for i, c in enumerate(raw):
    if not isinstance(c, (list, tuple)) or len(c) != 3 or not all(isinstance(x, str) for x in c):
      raise ConfigError(f"study key 'contrasts[{i}]'={c!r} must be [arm_a, arm_b, label]")
    for a in c[:2]:
      if a not in arms:
        raise ConfigError(f"study key 'contrasts[{i}]': {a!r} is not an arm; arms: {list(arms)}")
    if c[0] == c[1]:
      raise ConfigError(f"study key 'contrasts[{i}]' compares arm {c[0]!r} with itself")
    out.append(tuple(c))
  return out


def _twins(raw: Any, arms: dict, grid: dict) -> list[tuple]:
  """``twins``: a list of [arm_a, arm_b], two different arms with the same overrides, learning
  rates and seeds (the same cells under two names), in a study without a ``grid``."""
  if raw is None:
    return []
  if not isinstance(raw, list):
    raise ConfigError("study key 'twins' must be a list of [arm_a, arm_b]")
  if grid:
    raise ConfigError("study key 'twins' needs a study without 'grid' (a twin check is one "
                      "cell trained twice)")
  out = []
  for i, t in enumerate(raw):
    if not isinstance(t, (list, tuple)) or len(t) != 2 or not all(isinstance(x, str) for x in t):
      raise ConfigError(f"study key 'twins[{i}]'={t!r} must be [arm_a, arm_b]")
    missing = [a for a in t if a not in arms]
    if missing or t[0] == t[1]:
      raise ConfigError(f"study key 'twins[{i}]'={list(t)!r} must name two different arms of "
                        f"{list(arms)}")
    a, b = (arms[x] for x in t)
    for key in ("set", "learning_rates", "seeds"):
      if a[key] != b[key]:
        raise ConfigError(f"study key 'twins[{i}]': arms {t[0]!r} and {t[1]!r} differ in "
                          f"{'their overrides' if key == 'set' else repr(key)} "
                          f"({a[key]!r} vs {b[key]!r}); twins train the same cells")
    out.append(tuple(t))
  return out


def _sequential(raw: Any, contrasts: list, seeds: list) -> Optional[Sequential]:
  """``sequential``: needs ``contrasts``; names contrasts as ``"a - b"``; ``max_seeds`` at
  least the number of ``seeds``."""
  if raw is None:
    return None
  seq = parse(Sequential, raw, "sequential")
  if not contrasts:
    raise ConfigError("study key 'sequential' needs 'contrasts' (the seeds go to contrasts "
                      "whose interval is still wider than target_half_width)")
  names = [f"{a} - {b}" for a, b, _ in contrasts]
  for x in seq.contrasts or []:
    if x not in names:
      raise ConfigError(f"study key 'sequential.contrasts': {x!r} is not a contrast; "
                        f"contrasts: {names}")
  if seq.max_seeds < len(seeds):
    raise fail("sequential.max_seeds", seq.max_seeds, f"must be >= the {len(seeds)} 'seeds'")
  return seq


def from_dict(raw: dict, path: Optional[pathlib.Path] = None) -> Study:
  """Validates a study mapping; every cell's training config is checked too."""
  if not isinstance(raw, dict):
    raise ConfigError("a study config must be a mapping")
  check_keys(raw, TOP_KEYS, "")
  name = raw.get("name")
  if not isinstance(name, str) or not _NAME.match(name):
    raise fail("name", name, "must be a name (letters, digits, _ . + -)")
  base: dict = {}
  if raw.get("base") is not None:
    bp = pathlib.Path(raw["base"])
    if not bp.is_absolute() and path is not None:
      bp = path.parent / bp
    if not bp.is_file():
      raise ConfigError(f"study key 'base'={raw['base']!r}: no file {str(bp)!r}")
    base = read_yaml(bp, "study key 'base' file") or {}
  train = raw.get("train") or {}
  if not isinstance(train, dict):
    raise ConfigError("study key 'train' must be a mapping of training sections")
  base = merge(base, train)
  lrs = _list(raw, "learning_rates", float) if "learning_rates" in raw else None
  arms_raw = raw.get("arms")
  if not isinstance(arms_raw, dict) or not arms_raw:
    raise ConfigError("study key 'arms' must be a non-empty mapping of arm name -> overrides")
  arms = {str(n): _arm(n, s, lrs) for n, s in arms_raw.items()}
  baseline = raw.get("baseline", next(iter(arms)))
  if baseline not in arms:
    raise ConfigError(f"study key 'baseline'={baseline!r} is not an arm; arms: {list(arms)}")
  for n, a in arms.items():
    if a["baseline"] is not None and (a["baseline"] not in arms or a["baseline"] == n):
      raise ConfigError(f"study key 'arms.{n}.baseline'={a['baseline']!r} must name another "
                        f"arm of {list(arms)}")
  cb = raw.get("compute_baselines") or []
  if not isinstance(cb, list) or any(c not in arms for c in cb):
    raise ConfigError(f"study key 'compute_baselines'={cb!r} must list arms of {list(arms)}")
  seeds = _list(raw, "seeds", int, default=[0])
  best = _list(raw, "best_lr_seeds", int, default=[], allow_empty=True)
  grid = raw.get("grid") or {}
  if not isinstance(grid, dict):
    raise ConfigError("study key 'grid' must map dotted training keys to lists of values")
  for k, v in grid.items():
    if "." not in k or k.split(".")[0] not in TRAIN_SECTIONS or k in (LR_KEY, SEED_KEY):
      raise ConfigError(f"study key 'grid.{k}' must be a dotted training key other than "
                        f"{LR_KEY} and {SEED_KEY}")
    if not isinstance(v, list) or not v or any(isinstance(x, (dict, list)) for x in v):
      raise ConfigError(f"study key 'grid.{k}'={v!r} must be a non-empty list of scalars")
    if any(not _NAME.match(_fmt(x)) for x in v):
      raise ConfigError(f"study key 'grid.{k}'={v!r}: values may use letters, digits, _ . + -")
  eng = parse(Engine, raw.get("engine"), "engine")
  contrasts = _contrasts(raw.get("contrasts"), arms)
  target = convert(raw.get("target_half_width", 0.05), float, "target_half_width", {"gt": 0})
  st = Study(name, path, base, arms, baseline, list(cb), seeds, best, dict(grid), eng.kind,
             eng.cells_at_once, eng.keep_checkpoints, raw, contrasts, target,
             _sequential(raw.get("sequential"), contrasts, seeds),
             _twins(raw.get("twins"), arms, grid))
  cells = st.search_cells() + [c for a in arms for g in st.grid_points()
                               for c in st.best_lr_cells(a, g, st.lrs(a)[0])]
  if st.sequential:
    cells += [st.sequential_cell(a, g, st.lrs(a)[0], st.seed_sequence()[-1])
              for a in dict.fromkeys(x for c in contrasts for x in c[:2])
              for g in st.grid_points()]
  for c in cells:  # every cell validates (its optimizer built) before anything runs
    st.cell_config(c)
  return st


def _route(path: list[str]) -> list[str]:
  """A training key (``run.steps``) goes to ``train``; ``arms.NAME.section.key`` sets the arm's
  dotted key ``section.key``; ``grid.section.key`` sets one dotted grid key."""
  if path[0] in TRAIN_SECTIONS:
    path = ["train"] + path
  if path[0] == "arms" and len(path) > 2:
    return ["arms", path[1], ".".join(path[2:])]
  if path[0] == "grid" and len(path) > 1:
    return ["grid", ".".join(path[1:])]
  return path


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
  """``key=value`` overrides of the study mapping; a first component that names a training
  section (``run.steps=50``) goes to ``train``."""
  return _apply_overrides(raw, overrides, route=_route)


def load(path: str | pathlib.Path, overrides: Optional[list[str]] = None) -> Study:
  p = pathlib.Path(path)
  raw = read_yaml(p, "study config") or {}
  return from_dict(apply_overrides(raw, overrides or []), p)
