"""Training config: typed dataclasses, YAML loading, dotted overrides, validation.

A config file has five sections (every key optional except ``optimizer.name``)::

  run:        seed, steps, log/eval/checkpoint cadence, skip policy, outputs
  data:       source (embedded | shards), path, seq_len, batch_size, microbatches
  model:      preset + any ``scaleopt.models.ModelConfig`` field + wd_policy
  optimizer:  passed to ``scaleopt.optim.build`` (name, learning_rate, schedule, ...)
  mesh:       data / fsdp / tensor axis sizes, multi-host initialization

``load_config(path, overrides)`` applies ``a.b=value`` overrides (values parsed as YAML) to
the raw mapping, then validates every key and value; an error names the dotted key and what
is allowed. Model and optimizer sections are checked by building their (pure Python) config
objects, so every error comes before anything compiles.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import re
import time
import typing
from typing import Any, Literal, Optional

import yaml

SCHEDULES = ("cosine", "wsd", "constant")
OPTIMIZERS = ("adamw", "adamw_bc", "sophia", "sophia_bc", "shampoo", "shampoo_bc", "muon")
WD_POLICIES = ("iwd", "all", "matrices-only")


from scaleopt.config import ConfigError  # noqa: E402  (the one config error type)


@dataclasses.dataclass
class RunConfig:
  seed: int = 0
  steps: int = 200
  log_every: int = 10
  eval_every: int = 100  # 0: only at the end
  eval_batches: int = 4  # batches of data.batch_size sequences per eval
  checkpoint_every: int = 100  # 0: only at the end
  keep_checkpoints: int = 3
  async_checkpoint: bool = True
  max_consecutive_skips: int = 5  # non-finite steps in a row before the run stops
  progress: bool = True  # tqdm bar on the terminal
  tensorboard: bool = True
  plot: bool = True  # loss-curve PNG at the end
  peak_flops: Optional[float] = None  # per device; None: looked up from the device kind
  wandb: Optional[dict] = None  # {project, entity, name, group, tags, notes, mode}: W&B on
  profile: Optional[dict] = None  # {start_step, steps}: jax.profiler trace in RUN_DIR/profile


@dataclasses.dataclass
class DataConfig:
  source: Literal["embedded", "shards"] = "embedded"
  path: Optional[str] = None  # shard directory for source=shards
  seq_len: int = 128
  batch_size: int = 32  # sequences per step (per group for the A/B layout)
  microbatches: int = 4  # microbatches per group; batch_size must be divisible by it


@dataclasses.dataclass
class MeshConfig:
  data: int = -1  # -1: every device not used by fsdp x tensor
  fsdp: int = 1
  tensor: int = 1
  distributed: Literal["auto", "on", "off"] = "auto"  # jax.distributed.initialize


@dataclasses.dataclass
class TrainConfig:
  run: RunConfig
  data: DataConfig
  model: dict  # preset + ModelConfig fields + wd_policy (validated by bridge.model_config)
  optimizer: dict  # validated here (common keys) and by scaleopt.optim.build
  mesh: MeshConfig

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)


_SECTIONS = {"run": RunConfig, "data": DataConfig, "mesh": MeshConfig}


def _type_ok(value: Any, tp: Any) -> bool:
  origin = typing.get_origin(tp)
  if origin is typing.Union:
    return any(_type_ok(value, a) for a in typing.get_args(tp))
  if origin is Literal:
    return value in typing.get_args(tp)
  if tp is type(None):
    return value is None
  if tp is bool:
    return isinstance(value, bool)
  if tp is int:
    return isinstance(value, int) and not isinstance(value, bool)
  if tp is float:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
  return isinstance(value, tp)


def _describe(tp: Any) -> str:
  origin = typing.get_origin(tp)
  if origin is Literal:
    return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
  if origin is typing.Union:
    return " or ".join(_describe(a) for a in typing.get_args(tp))
  return "null" if tp is type(None) else tp.__name__


def _section(name: str, cls: type, raw: Any):
  if raw is None:
    raw = {}
  if not isinstance(raw, dict):
    raise ConfigError(f"config section '{name}' must be a mapping, got {raw!r}")
  hints = typing.get_type_hints(cls)
  fields = {f.name for f in dataclasses.fields(cls)}
  for k, v in raw.items():
    if k not in fields:
      raise ConfigError(f"unknown config key '{name}.{k}'; allowed keys in '{name}': "
                        f"{sorted(fields)}")
    if not _type_ok(v, hints[k]):
      raise ConfigError(f"config key '{name}.{k}'={v!r} is not allowed; expected "
                        f"{_describe(hints[k])}")
  kw = {k: (float(v) if hints[k] is float and v is not None else v) for k, v in raw.items()}
  return cls(**kw)


def _check_optimizer(opt: Any, steps: int) -> dict:
  """Validates the optimizer section with ``scaleopt.optim.build.OptimizerConfig`` (its errors
  name the key); fills ``schedule.total_steps`` with ``run.steps`` when absent."""
  if not isinstance(opt, dict):
    raise ConfigError(f"config section 'optimizer' must be a mapping with 'name', got {opt!r}")
  from scaleopt.optim import names  # shipped names plus user-registered ones
  if "name" not in opt:
    raise ConfigError("config section 'optimizer' needs 'name'; allowed names: "
                      f"{names()}")
  if opt["name"] not in names():
    raise ConfigError(f"config key 'optimizer.name'={opt['name']!r} is not allowed; choose "
                      f"one of {names()}")
  opt = dict(opt)
  sched = opt.get("schedule")
  if sched is None:
    sched = {}
  if not isinstance(sched, dict):
    raise ConfigError(f"config key 'optimizer.schedule' must be a mapping, got {sched!r}")
  opt["schedule"] = {**sched, "total_steps": sched.get("total_steps", steps)}
  from scaleopt.optim.build import build
  from scaleopt.train.bridge import optimizer_config
  try:
    optimizer_config(opt)
    build(opt)  # pure Python: checks the values of ``extra`` too (nothing is traced)
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config section 'optimizer': {e}") from None
  return opt


def _check_model(model: Any) -> dict:
  if not isinstance(model, dict):
    raise ConfigError(f"config section 'model' must be a mapping, got {model!r}")
  if model.get("wd_policy", "matrices-only") not in WD_POLICIES:
    raise ConfigError(f"config key 'model.wd_policy'={model['wd_policy']!r} is not allowed; "
                      f"choose one of {WD_POLICIES}")
  from scaleopt.train.bridge import model_config
  try:
    model_config(model)
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config section 'model': {e}") from None
  return dict(model)


def _positive(key: str, value: int, allow_zero: bool = False):
  if value < 0 or (value == 0 and not allow_zero):
    raise ConfigError(f"config key '{key}'={value!r} must be {'>= 0' if allow_zero else '> 0'}")


def _check_finite(node: Any, key: str = "") -> None:
  """No NaN or infinity anywhere (YAML reads ``.nan``/``.inf``; nothing accepts them)."""
  if isinstance(node, float) and not math.isfinite(node):
    raise ConfigError(f"config key '{key}'={node!r} is not allowed; expected a finite number")
  if isinstance(node, dict):
    for k, v in node.items():
      _check_finite(v, f"{key}.{k}" if key else str(k))
  elif isinstance(node, list):
    for i, v in enumerate(node):
      _check_finite(v, f"{key}[{i}]")


def from_dict(raw: dict) -> TrainConfig:
  """Validates a raw mapping (as loaded from YAML) and returns a TrainConfig."""
  if not isinstance(raw, dict):
    raise ConfigError(f"a config must be a mapping of sections, got {type(raw).__name__}")
  allowed = set(_SECTIONS) | {"model", "optimizer"}
  for k in raw:
    if k not in allowed:
      raise ConfigError(f"unknown config section '{k}'; allowed: {sorted(allowed)}")
  _check_finite(raw)
  secs = {k: _section(k, cls, raw.get(k)) for k, cls in _SECTIONS.items()}
  r, d, m = secs["run"], secs["data"], secs["mesh"]
  for k in ("steps", "log_every", "keep_checkpoints", "max_consecutive_skips"):
    _positive(f"run.{k}", getattr(r, k))
  for k in ("eval_every", "checkpoint_every", "eval_batches"):
    _positive(f"run.{k}", getattr(r, k), allow_zero=True)
  for k in ("seq_len", "batch_size", "microbatches"):
    _positive(f"data.{k}", getattr(d, k))
  if d.batch_size % d.microbatches:
    raise ConfigError(f"config key 'data.batch_size'={d.batch_size} must be divisible by "
                      f"'data.microbatches'={d.microbatches}")
  if d.source == "shards" and not d.path:
    raise ConfigError("config key 'data.path' is required when data.source='shards' (a "
                      "directory written by `scaleopt data prepare`)")
  for k in ("fsdp", "tensor"):
    _positive(f"mesh.{k}", getattr(m, k))
  if m.data != -1:
    _positive("mesh.data", m.data)
  model = _check_model(raw.get("model") or {})
  opt = _check_optimizer(raw.get("optimizer"), r.steps)
  return TrainConfig(model=model, optimizer=opt, **secs)


def yaml_error(e: yaml.YAMLError) -> str:
  """A YAML error on one line: where (1-based line and column) and what."""
  mark = getattr(e, "problem_mark", None)
  what = getattr(e, "problem", None) or " ".join(str(e).split())
  return f"line {mark.line + 1}, column {mark.column + 1}: {what}" if mark else what


def _parse_override(item: str) -> tuple[list[str], Any]:
  if "=" not in item:
    raise ConfigError(f"override {item!r} must look like section.key=value")
  key, value = item.split("=", 1)
  path = key.strip().split(".")
  if len(path) < 2 or not all(path):
    raise ConfigError(f"override key {key!r} must be dotted, e.g. optimizer.learning_rate")
  try:
    parsed = yaml.safe_load(value)
  except yaml.YAMLError as e:
    raise ConfigError(f"override {item!r}: value is not valid YAML ({yaml_error(e)})") from None
  return path, _numbers(parsed)


_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)$")


def _numbers(x: Any) -> Any:
  """YAML 1.1 reads ``1e-4`` as a string; read such strings as floats."""
  if isinstance(x, str) and _FLOAT.match(x):
    return float(x)
  if isinstance(x, dict):
    return {k: _numbers(v) for k, v in x.items()}
  if isinstance(x, list):
    return [_numbers(v) for v in x]
  return x


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
  """Sets ``a.b.c=value`` in a copy of ``raw`` (validation happens in ``from_dict``)."""
  import copy
  out = copy.deepcopy(raw)
  for item in overrides or []:
    path, value = _parse_override(item)
    node = out
    for p in path[:-1]:
      nxt = node.get(p)
      if nxt is None:
        nxt = node[p] = {}
      if not isinstance(nxt, dict):
        raise ConfigError(f"override {item!r}: '{p}' is a value, not a section")
      node = nxt
    node[path[-1]] = value
  return out


def load_config(path: str | pathlib.Path, overrides: list[str] | None = None) -> TrainConfig:
  """Reads a YAML config, applies dotted overrides and validates."""
  p = pathlib.Path(path)
  if not p.is_file():
    raise ConfigError(f"config file {str(p)!r} does not exist")
  try:
    raw = yaml.safe_load(p.read_text()) or {}
  except yaml.YAMLError as e:
    raise ConfigError(f"config file {str(p)!r} is not valid YAML: {yaml_error(e)}") from None
  return from_dict(apply_overrides(_numbers(raw), overrides or []))


def dump_config(cfg: TrainConfig, path: str | pathlib.Path) -> None:
  pathlib.Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


# ---------------------------------------------------------------------------------------------
# Resuming with a changed config.

# Keys (and sections, with everything under them) a resumed run may change: when and how much
# to train, log, evaluate, profile and checkpoint, the schedule's end, the device layout, and
# ``model.init_from`` (only read by fresh runs). Anything else (seed, data, model, optimizer)
# would make the continued run a different experiment than its checkpoints.
RESUMABLE = ("run.steps", "run.log_every", "run.eval_every", "run.eval_batches",
             "run.checkpoint_every", "run.keep_checkpoints", "run.async_checkpoint",
             "run.max_consecutive_skips", "run.progress", "run.tensorboard", "run.plot",
             "run.peak_flops", "run.wandb", "run.profile", "optimizer.schedule.total_steps",
             "model.init_from", "mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.distributed")
HISTORY = "config_history.jsonl"


def _flat(d: Any, key: str = "") -> dict:
  if not isinstance(d, dict) or (key and not d):
    return {key: d}
  out = {}
  for k, v in d.items():
    out.update(_flat(v, f"{key}.{k}" if key else str(k)))
  return out


def config_changes(saved: dict, requested: dict) -> dict[str, tuple]:
  """{dotted key: (saved value, requested value)} for every key that differs."""
  a, b = _flat(saved), _flat(requested)
  return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def saved_config(run_dir: str | pathlib.Path) -> Optional[dict]:
  """The config a run last trained with: ``config.yaml`` (written when the run started, never
  rewritten) with the changes of ``config_history.jsonl`` applied; None if there is none."""
  d = pathlib.Path(run_dir)
  try:
    cfg = yaml.safe_load((d / "config.yaml").read_text())
  except FileNotFoundError:
    return None
  except (OSError, yaml.YAMLError) as e:
    raise ConfigError(f"cannot read {str(d / 'config.yaml')!r} ({e})") from None
  if (d / HISTORY).exists():
    for line in (d / HISTORY).read_text().splitlines():
      try:
        changes = json.loads(line)["changes"] if line.strip() else {}
      except (ValueError, KeyError, TypeError):
        raise ConfigError(f"{str(d / HISTORY)!r} has a corrupt line: {line[:80]!r}") from None
      for key, (_, new) in changes.items():
        node = cfg
        *path, last = key.split(".")
        for p in path:
          node = node.setdefault(p, {})
        node[last] = new
  return cfg


def check_resume(cfg: TrainConfig, run_dir: str | pathlib.Path) -> dict[str, tuple]:
  """Compares the requested config with the run's saved one (reads only); returns the
  resumable changes, raises ConfigError naming every other changed key."""
  saved = saved_config(run_dir)
  if saved is None:
    return {}
  changes = config_changes(saved, yaml.safe_load(yaml.safe_dump(cfg.to_dict())))
  bad = [k for k in changes if not any(k == r or k.startswith(r + ".") for r in RESUMABLE)]
  if bad:
    what = ", ".join(f"{k} ({changes[k][0]!r} -> {changes[k][1]!r})" for k in bad)
    raise ConfigError(f"cannot resume {str(run_dir)!r} with a changed {what}: only "
                      f"{', '.join(RESUMABLE)} may change on resume; use a new --out for "
                      "a different experiment")
  return changes


def record_changes(run_dir: str | pathlib.Path, changes: dict, step: int) -> None:
  """Appends one line ``{"time", "step", "changes": {key: [old, new]}}`` to the history."""
  if changes:
    rec = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "step": step,
           "changes": {k: list(v) for k, v in changes.items()}}
    with open(pathlib.Path(run_dir) / HISTORY, "a") as f:
      f.write(json.dumps(rec) + "\n")
