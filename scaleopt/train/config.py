"""Training config: typed dataclasses, YAML loading, dotted overrides, validation.

A config file has five sections (every key optional except ``optimizer.name``)::

  run:        seed, steps, log/eval/checkpoint cadence, skip policy, outputs
  data:       source (embedded | shards), path, seq_len, batch_size, microbatches
  model:      preset + any ``scaleopt.models.ModelConfig`` field + wd_policy
  optimizer:  passed to ``scaleopt.optim.build`` (name, learning_rate, schedule, ...)
  mesh:       data / fsdp / tensor axis sizes, multi-host initialization

``load_config(path, overrides)`` applies ``a.b=value`` overrides (values parsed as YAML) to
the raw mapping, then validates every key and value with the shared schema mechanism of
``scaleopt.config`` (one error type, one override parser): run, data and mesh are dataclasses
here; every model key is typed by ``scaleopt.models.ModelConfig``'s field of that name (then the
preset and variant are resolved); the optimizer section is checked by building the optimizer
(pure Python), so every error comes before anything compiles.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys
import time
import typing
from typing import Any, Literal, Optional

import yaml

if typing.TYPE_CHECKING:
  from scaleopt.optim import OptimizerConfig

from scaleopt.config import (ConfigError, apply_overrides as _apply_overrides, check_keys,
                             choice, convert, fail, numbers, parse, read_yaml, spec, to_dict,
                             yaml_error)

WD_POLICIES = ("iwd", "all", "matrices-only")
_numbers = numbers  # the old private name


@dataclasses.dataclass
class RunConfig:
  seed: int = 0
  steps: int = spec(200, gt=0)
  log_every: int = spec(10, gt=0)
  eval_every: int = spec(100, min=0)  # 0: only at the end
  # target tokens of the fixed held-out evaluation set (eval_tokens // seq_len windows chosen
  # by the data, never by the batch size: scaleopt.train.data.eval_set); 0: no evaluation
  eval_tokens: int = spec(1 << 18, min=0)
  checkpoint_every: int = spec(100, min=0)  # 0: only at the end
  keep_checkpoints: int = spec(3, gt=0)
  async_checkpoint: bool = True
  max_consecutive_skips: int = spec(5, gt=0)  # non-finite steps in a row before the run stops
  progress: bool = True  # tqdm bar on the terminal
  tensorboard: bool = True
  plot: bool = True  # loss-curve PNG at the end
  peak_flops: Optional[float] = None  # per device; None: looked up from the device kind
  wandb: Optional[dict] = None  # {project, entity, name, group, tags, notes, mode}: W&B on
  profile: Optional[dict] = None  # {start_step, steps}: jax.profiler trace in RUN_DIR/profile
  telemetry_every: int = spec(0, min=0)  # per-group norms + BC statistics (0: off)
  # every-N work (Shampoo roots, Sophia refresh, telemetry): one compiled program per outcome,
  # picked by the host ("on"), or device branches in one program ("off"); auto: on on GPUs
  host_phases: Literal["auto", "on", "off"] = "auto"
  # the skip guard's update check: "auto" checks the update's norm only for optimizers not
  # registered with finite updates (then a finite loss and gradient decide the skip before
  # the update: one pass over the state); "always" for every optimizer
  update_guard: Literal["auto", "always"] = "auto"


@dataclasses.dataclass
class DataConfig:
  source: Literal["embedded", "shards"] = "embedded"
  path: Optional[str] = None  # shard directory for source=shards
  seq_len: int = spec(128, gt=0)
  batch_size: int = spec(32, gt=0)  # sequences per step (per group for the A/B layout)
  microbatches: int = spec(4, gt=0)  # microbatches per group; batch_size must be divisible by it


@dataclasses.dataclass
class MeshConfig:
  data: int = -1  # -1: every device not used by fsdp x tensor
  fsdp: int = spec(1, gt=0)
  tensor: int = spec(1, gt=0)
  distributed: Literal["auto", "on", "off"] = "auto"  # jax.distributed.initialize
  shard_optimizer: bool = False  # ZeRO-1: optimizer state split over data too


@dataclasses.dataclass
class TrainConfig:
  run: RunConfig
  data: DataConfig
  model: "ModelSpec"  # preset + ModelConfig fields + wd_policy, the preset resolved once
  optimizer: "OptimizerConfig"  # typed through the optimizer registry (scaleopt.optim)
  mesh: MeshConfig
  # the run's optimizer (tx, spec, schedule: bridge.Built), built once from the sections above
  # when the config is made (nothing is traced); the trainer steps with it. Not recorded.
  built: Any = dataclasses.field(init=False, repr=False, compare=False)

  def __post_init__(self):
    from scaleopt.train import bridge
    try:
      self.built = bridge.run_optimizer(self.optimizer, self.model.wd_policy)
    except (ValueError, TypeError) as e:
      raise ConfigError(f"config section 'optimizer': {e}") from None

  def to_dict(self) -> dict:
    out = {f.name: to_dict(getattr(self, f.name)) for f in dataclasses.fields(self)
           if f.name != "built"}
    return {**out, "model": to_dict(self.model.section)}


_SECTIONS = {"run": RunConfig, "data": DataConfig, "mesh": MeshConfig}


def _check_optimizer(opt: Any, steps: int) -> dict:
  """The optimizer section typed through the optimizer registry: ``name`` is a registered name
  (``scaleopt.optim.names()``), every other key is typed by ``OptimizerConfig``'s field of that
  name, ``schedule`` by ``ScheduleConfig`` (``total_steps`` defaults to ``run.steps``) and
  ``extra`` by the optimizer's registered config class. Returns the typed ``OptimizerConfig``
  (every key, with its default where the file sets none); ``TrainConfig`` then builds the
  optimizer once (pure Python, nothing is traced), which checks the values of ``extra``."""
  from scaleopt import optim
  from scaleopt.optim.schedules import ScheduleConfig
  if not isinstance(opt, dict):
    raise fail("optimizer", opt, "expected a mapping with 'name'")
  if "name" not in opt:
    raise ConfigError(f"config section 'optimizer' needs 'name'; allowed names: "
                      f"{', '.join(optim.names())}")
  choice(opt["name"], "optimizer.name", optim.names())
  opt = optim.with_recommended(opt)  # the optimizer's learning rate, schedule where unset
  fields = [f.name for f in dataclasses.fields(optim.OptimizerConfig)]
  check_keys(opt, fields, "optimizer")
  hints = typing.get_type_hints(optim.OptimizerConfig)
  kw = {k: convert(v, hints[k], f"optimizer.{k}") for k, v in opt.items()
        if k not in ("schedule", "extra")}
  sched = opt.get("schedule")
  if sched is None or (isinstance(sched, dict) and "total_steps" not in sched):
    sched = _fit_warmup({**(sched or {}), "total_steps": steps})
  kw["extra"] = convert(opt.get("extra") or {}, dict, "optimizer.extra")
  try:
    kw["schedule"] = parse(ScheduleConfig, sched, "optimizer.schedule")
    return optim.OptimizerConfig(**kw)  # built (values checked) by TrainConfig
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config section 'optimizer': {e}") from None


def _fit_warmup(sched: dict) -> dict:
  """A schedule whose ``total_steps`` is ``run.steps`` (none set) with ``warmup_steps``
  shortened to what the run has room for, with a one-line notice: a short smoke run
  (``--set run.steps=10``) of a config written for hundreds of steps then trains instead of
  being refused. A ``total_steps`` the config sets itself is never changed (there a too-long
  warmup is an error naming both keys)."""
  from scaleopt.optim.schedules import ScheduleConfig
  w, total = sched.get("warmup_steps", 0), sched["total_steps"]
  kind = sched.get("kind", ScheduleConfig.kind)
  frac = sched.get("decay_fraction", ScheduleConfig.decay_fraction)
  if (kind == "constant" or not isinstance(w, int) or isinstance(w, bool)
      or not isinstance(total, int) or not isinstance(frac, (int, float))):
    return sched  # nothing to fit, or a bad value that parse() names
  room = total - (int(round(frac * total)) if kind == "wsd" else 0)
  if w <= max(room, 0):
    return sched
  fit = max(room, 0)
  print(f"note: optimizer.schedule.warmup_steps={w} does not fit run.steps={total}; warming "
        f"up over {fit} steps (set optimizer.schedule.warmup_steps to choose)", file=sys.stderr)
  return {**sched, "warmup_steps": fit}


@dataclasses.dataclass
class ModelKeys:
  """The model-section keys that are not ``ModelConfig`` fields."""
  preset: str = "tiny"
  variant: Optional[str] = None  # a scale-vector variant name
  wd_policy: Literal[WD_POLICIES] = "matrices-only"
  init_from: Optional[str] = None  # parameters to start from (scaleopt.train.convert)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """The model section, typed: the ``ModelConfig`` its preset, variant and overrides resolve
  to (resolved once, here), the weight-decay policy and the parameter source; ``section`` is
  the section as written (keys typed, what the run's config.yaml records)."""
  config: Any  # scaleopt.models.ModelConfig
  wd_policy: str
  init_from: Optional[str]
  section: dict


def model_spec(model: Any) -> ModelSpec:
  """Every key typed (ModelKeys, else the ModelConfig field of that name), then the preset,
  variant and overrides resolved by ``bridge.model_config`` (which checks their values)."""
  from scaleopt import models
  if not isinstance(model, dict):
    raise fail("model", model, "expected a mapping of keys")
  fields = {f.name: f for f in dataclasses.fields(models.ModelConfig)}
  own = {f.name for f in dataclasses.fields(ModelKeys)}
  check_keys(model, sorted(own | set(fields)), "model")
  if isinstance(model.get("init_from"), str):  # the architecture of the source
    from scaleopt.train.convert import with_architecture
    model = with_architecture(model)
  hints = typing.get_type_hints(models.ModelConfig)
  out = to_dict(parse(ModelKeys, {k: v for k, v in model.items() if k in own}, "model"))
  out = {k: v for k, v in out.items() if k in model}
  typed = {k: convert(v, hints[k], f"model.{k}") for k, v in model.items() if k not in own}
  out.update({k: list(v) if isinstance(v, tuple) else v for k, v in typed.items()})
  from scaleopt.train.bridge import model_config
  try:
    resolved = model_config(out)
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config section 'model': {e}") from None
  keys = {**to_dict(ModelKeys()), **out}
  return ModelSpec(resolved, keys["wd_policy"], keys["init_from"], {k: out[k] for k in model})


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


def _resolve_block_shards(opt: Any, mesh: MeshConfig) -> Any:
  """``optimizer.extra.block_shards: fsdp`` -> ``mesh.fsdp`` (Shampoo's blocks cut per FSDP
  shard). Resolved here, so the run's recorded config holds the number: resuming on another
  FSDP size changes it, and the resume check refuses that before any checkpoint is read."""
  extra = opt.get("extra") if isinstance(opt, dict) else None
  if not isinstance(extra, dict) or extra.get("block_shards") != "fsdp":
    return opt
  return {**opt, "extra": {**extra, "block_shards": mesh.fsdp}}


def from_dict(raw: dict) -> TrainConfig:
  """Validates a raw mapping (as loaded from YAML) and returns a TrainConfig."""
  if not isinstance(raw, dict):
    raise ConfigError(f"a config must be a mapping of sections, got {type(raw).__name__}")
  check_keys(raw, sorted(set(_SECTIONS) | {"model", "optimizer"}), "")
  _check_finite(raw)
  if isinstance(raw.get("run"), dict) and "eval_batches" in raw["run"]:
    raise ConfigError("config key 'run.eval_batches' was replaced by 'run.eval_tokens' (the "
                      "held-out set's size in target tokens, the same for every batch size)")
  secs = {k: parse(cls, raw.get(k), k) for k, cls in _SECTIONS.items()}
  r, d, m = secs["run"], secs["data"], secs["mesh"]
  if r.telemetry_every % r.log_every:
    raise fail("run.telemetry_every", r.telemetry_every,
               f"must be a multiple of run.log_every={r.log_every} (0: off)")
  if d.batch_size % d.microbatches:
    raise ConfigError(f"config key 'data.batch_size'={d.batch_size} must be divisible by "
                      f"'data.microbatches'={d.microbatches}")
  if d.source == "shards" and not d.path:
    raise ConfigError("config key 'data.path' is required when data.source='shards' (a "
                      "directory written by `scaleopt data prepare`)")
  if m.data != -1 and m.data <= 0:
    raise fail("mesh.data", m.data, "must be > 0 or -1 (every device not used by fsdp x tensor)")
  model = model_spec(raw.get("model") or {})
  opt = _check_optimizer(_resolve_block_shards(raw.get("optimizer"), m), r.steps)
  return TrainConfig(model=model, optimizer=opt, **secs)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
  """Sets ``section.key=value`` in a copy of ``raw`` (validation happens in ``from_dict``)."""
  return _apply_overrides(raw, overrides, min_depth=2)


def load_config(path: str | pathlib.Path, overrides: list[str] | None = None) -> TrainConfig:
  """Reads a YAML config, applies dotted overrides and validates."""
  raw = read_yaml(path)
  return from_dict(apply_overrides({} if raw is None else raw, overrides or []))


def dump_config(cfg: TrainConfig, path: str | pathlib.Path) -> None:
  pathlib.Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


# ---------------------------------------------------------------------------------------------
# Resuming with a changed config.

# Keys (and sections, with everything under them) a resumed run may change: when and how much
# to train, log, evaluate, profile and checkpoint, the schedule's end, the device layout, and
# ``model.init_from`` (only read by fresh runs), and where Shampoo keeps its statistics
# (``offload_statistics``: where the statistics live, not what they are). Anything else (seed,
# data, model, optimizer) would make the continued run a different experiment than its
# checkpoints.
RESUMABLE = ("run.steps", "run.log_every", "run.eval_every", "run.eval_tokens",
             "run.checkpoint_every", "run.keep_checkpoints", "run.async_checkpoint",
             "run.max_consecutive_skips", "run.progress", "run.tensorboard", "run.plot",
             "run.peak_flops", "run.wandb", "run.profile", "run.telemetry_every", "run.host_phases",
             "optimizer.schedule.total_steps", "model.init_from", "mesh.data", "mesh.fsdp", "mesh.tensor", "mesh.distributed",
             "mesh.shard_optimizer", "optimizer.extra.block_major",
             "optimizer.extra.offload_statistics")
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


def saved_section(run_dir: str | pathlib.Path, name: str) -> Any:
  """One section of the config a run last trained with (``saved_config``), typed: ``model`` as
  its ``ModelSpec``, ``run`` / ``data`` / ``mesh`` as their dataclasses; None when the run has no
  config. Only that section is validated (an export reads a run's model and data sections
  without needing the rest to be valid under today's rules)."""
  raw = saved_config(run_dir)
  if raw is None:
    return None
  section = raw.get(name) or {}
  return model_spec(section) if name == "model" else parse(_SECTIONS[name], section, name)


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
