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
preset and variant are resolved); the optimizer section is typed through the optimizer registry
and its values checked by ``scaleopt.optim`` (a trial build, dropped), so every error comes
before anything compiles.

A ``TrainConfig`` is data: parsing reads no file but the config itself and keeps no built
object. The trainer builds the optimizer and its schedule from the typed sections
(``bridge.run_optimizer``) and reads a ``model.init_from`` source's architecture when it starts
(``bridge.with_source_architecture``).
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
                             choice, convert, fail, parse, read_yaml, spec, to_dict)

WD_POLICIES = ("iwd", "all", "matrices-only")


@dataclasses.dataclass
class RunConfig:
  seed: int = 0  # initialization and per-step keys (and the data order unless data.seed is set)
  # bitwise-reproducible steps on one card and software: XLA's deterministic GPU programs
  # (scaleopt.train.determinism); summary.json then records a digest of the final state
  deterministic: bool = False
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
  seed: Optional[int] = None  # the training data's order; None: run.seed (``data_seed``)


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
  # the optimizer.schedule.warmup_steps the config wrote, where it was shortened to fit
  # run.steps (``_fit_warmup``; the optimizer is built with the shortened one); None otherwise
  written_warmup: Optional[int] = None

  def to_dict(self) -> dict:
    """The config as the user wrote it (what ``config.yaml`` records and a resume compares):
    every key, the model section as written, a fitted warm-up as written."""
    out = {f.name: to_dict(getattr(self, f.name)) for f in dataclasses.fields(self)
           if f.name != "written_warmup"}
    if self.written_warmup is not None:
      out["optimizer"]["schedule"]["warmup_steps"] = self.written_warmup
    return {**out, "model": to_dict(self.model.section)}


def data_seed(cfg: TrainConfig) -> int:
  """The seed of the training data's order: ``data.seed``, or ``run.seed`` when unset."""
  return cfg.run.seed if cfg.data.seed is None else cfg.data.seed


_SECTIONS = {"run": RunConfig, "data": DataConfig, "mesh": MeshConfig}


def _check_optimizer(opt: Any, steps: int) -> tuple["OptimizerConfig", Optional[int]]:
  """The optimizer section typed through the optimizer registry: ``name`` is a registered name
  (``scaleopt.optim.names()``), every other key is typed by ``OptimizerConfig``'s field of that
  name, ``schedule`` by ``ScheduleConfig`` (``total_steps`` defaults to ``run.steps``) and
  ``extra`` by the optimizer's registered config class. Returns the typed ``OptimizerConfig``
  (every key, with its default where the file sets none), whose values ``_check_values``
  checks, and the warm-up as written where ``_fit_warmup`` shortened it (else None)."""
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
  sched, written = opt.get("schedule"), None
  if sched is None or (isinstance(sched, dict) and sched.get("total_steps", steps) == steps):
    sched, written = _fit_warmup({**(sched or {}), "total_steps": steps})
  kw["extra"] = convert(opt.get("extra") or {}, dict, "optimizer.extra")
  try:
    kw["schedule"] = parse(ScheduleConfig, sched, "optimizer.schedule")
    return _check_values(optim.OptimizerConfig(**kw)), written
  except (ValueError, TypeError) as e:
    raise ConfigError(f"config section 'optimizer': {e}") from None


def _check_values(opt: "OptimizerConfig") -> "OptimizerConfig":
  """``opt``, after ``scaleopt.optim``'s factories checked its values: they check them when
  they build, so the chain is built once here (pure Python, nothing is traced) and dropped.
  Masks and filters only route tensors: an embedding filter that marks nothing stands in for
  the run's. The trainer builds the run's own chain (``bridge.run_optimizer``)."""
  import jax
  import optax

  from scaleopt import optim
  no_embeddings = lambda params: jax.tree.map(lambda _: False, params)
  optim.build(opt, sparse_filter=no_embeddings, schedule=optax.constant_schedule(0.0))
  return opt


def _fit_warmup(sched: dict, note: bool = True) -> tuple[dict, Optional[int]]:
  """A schedule that ends with the run (``total_steps`` unset, so ``run.steps``, or set to
  ``run.steps``) with ``warmup_steps`` shortened to what the run has room for, with a one-line
  notice: a short smoke run (``--set run.steps=10``) of a config written for hundreds of steps
  then trains instead of being refused. Returns the schedule and the warm-up as written when
  it was shortened (else None): the run records what was written (``TrainConfig.to_dict``),
  so ``--resume`` with a longer ``run.steps`` fits it again instead of seeing a changed key. A
  ``total_steps`` the config sets to another value is never changed (there a too-long warmup
  is an error naming both keys)."""
  from scaleopt.optim.schedules import ScheduleConfig
  w, total = sched.get("warmup_steps", 0), sched["total_steps"]
  kind = sched.get("kind", ScheduleConfig.kind)
  frac = sched.get("decay_fraction", ScheduleConfig.decay_fraction)
  if (kind == "constant" or not isinstance(w, int) or isinstance(w, bool)
      or not isinstance(total, int) or not isinstance(frac, (int, float))):
    return sched, None  # nothing to fit, or a bad value that parse() names
  room = total - (int(round(frac * total)) if kind == "wsd" else 0)
  if w <= max(room, 0):
    return sched, None
  fit = max(room, 0)
  if note:
    print(f"note: optimizer.schedule.warmup_steps={w} does not fit run.steps={total}; warming "
          f"up over {fit} steps (set optimizer.schedule.warmup_steps to choose)",
          file=sys.stderr)
  return {**sched, "warmup_steps": fit}, w


@dataclasses.dataclass
class ModelKeys:
  """The model-section keys that are not ``ModelConfig`` fields."""
  preset: str = "tiny"
  variant: Optional[str] = None  # a scale-vector variant name
  wd_policy: Literal[WD_POLICIES] = "matrices-only"
  init_from: Optional[str] = None  # parameters to start from (scaleopt.train.convert)


MODEL_KEYS = tuple(f.name for f in dataclasses.fields(ModelKeys))


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """The model section, typed: the ``ModelConfig`` its preset, variant and overrides resolve
  to (resolved once, here), the weight-decay policy and the parameter source; ``section`` is
  the section as written (keys typed, what the run's config.yaml records).

  ``config`` is None while ``init_from`` names a source and the section leaves architecture
  fields to it: the source is read when the trainer starts
  (``bridge.with_source_architecture``), not while parsing."""
  config: Any  # scaleopt.models.ModelConfig, or None (above)
  wd_policy: str
  init_from: Optional[str]
  section: dict


def resolve_model_config(section: dict) -> Any:
  """The ``ModelConfig`` of a model section (a mapping): ``preset`` (default
  ``ModelKeys.preset``), optional ``variant`` (a scale-vector variant name) and any
  ModelConfig field as an override. ValueError on an unknown key or a bad value."""
  from scaleopt import models
  fields = {f.name for f in dataclasses.fields(models.ModelConfig)}
  bad = [k for k in section if k not in fields and k not in MODEL_KEYS]
  if bad:
    raise ValueError(f"unknown key 'model.{bad[0]}'; allowed: {sorted(MODEL_KEYS)} and the "
                     f"ModelConfig fields {sorted(fields)}")
  cfg = models.get_preset(section.get("preset", ModelKeys.preset))
  if section.get("variant") is not None:
    cfg = cfg.with_variant(section["variant"])
  over = {k: v for k, v in section.items() if k in fields}
  if "dual_targets" in over and isinstance(over["dual_targets"], list):
    over["dual_targets"] = tuple(over["dual_targets"])
  return dataclasses.replace(cfg, **over) if over else cfg


def architecture_fields() -> list[str]:
  """The ModelConfig fields that make the parameters and the function (all but
  ``FREE_FIELDS``): those a ``model.init_from`` source fixes."""
  from scaleopt import models
  return [f.name for f in dataclasses.fields(models.ModelConfig) if f.name not in FREE_FIELDS]


# ModelConfig fields that change numerics or speed but not the function or the parameters
FREE_FIELDS = ("dtype", "remat", "scan_unroll", "attention_impl", "max_seq_len",
               "logits_dot_in_fp32", "fused_loss", "loss_chunks", "loss_kernel", "norm_kernel",
               "glu_kernel", "init_std", "moe_capacity_factor", "moe_lb_weight", "moe_z_weight")


def model_spec(model: Any) -> ModelSpec:
  """Every key typed (ModelKeys, else the ModelConfig field of that name), then the preset,
  variant and overrides resolved by ``resolve_model_config`` (which checks their values);
  left unresolved while a ``model.init_from`` source is to give architecture fields."""
  from scaleopt import models
  if not isinstance(model, dict):
    raise fail("model", model, "expected a mapping of keys")
  fields = {f.name: f for f in dataclasses.fields(models.ModelConfig)}
  own = {f.name for f in dataclasses.fields(ModelKeys)}
  check_keys(model, sorted(own | set(fields)), "model")
  hints = typing.get_type_hints(models.ModelConfig)
  out = to_dict(parse(ModelKeys, {k: v for k, v in model.items() if k in own}, "model"))
  out = {k: v for k, v in out.items() if k in model}
  typed = {k: convert(v, hints[k], f"model.{k}") for k, v in model.items() if k not in own}
  out.update({k: list(v) if isinstance(v, tuple) else v for k, v in typed.items()})
  keys = {**to_dict(ModelKeys()), **out}
  resolved = None
  if not (isinstance(keys["init_from"], str)
          and any(f not in out for f in architecture_fields())):
    try:
      resolved = resolve_model_config(out)
    except (ValueError, TypeError) as e:
      raise ConfigError(f"config section 'model': {e}") from None
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
  if d.source != "shards" and d.path:
    raise ConfigError(f"config key 'data.path'={d.path!r} is read only with "
                      f"data.source=shards, and data.source is {d.source!r} (the run would "
                      f"train on the {d.source} corpus); add --set data.source=shards to train "
                      "on those shards, or leave data.path out")
  if m.data != -1 and m.data <= 0:
    raise fail("mesh.data", m.data, "must be > 0 or -1 (every device not used by fsdp x tensor)")
  model = model_spec(raw.get("model") or {})
  opt, written = _check_optimizer(_resolve_block_shards(raw.get("optimizer"), m), r.steps)
  return TrainConfig(model=model, optimizer=opt, **secs, written_warmup=written)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
  """Sets ``section.key=value`` in a copy of ``raw`` (validation happens in ``from_dict``)."""
  return _apply_overrides(raw, overrides, min_depth=2)


def load_config(path: str | pathlib.Path, overrides: list[str] | None = None) -> TrainConfig:
  """Reads a YAML config, applies dotted overrides and validates."""
  raw = read_yaml(path)
  return from_dict(apply_overrides({} if raw is None else raw, overrides or []))


def dump_config(cfg: TrainConfig, path: str | pathlib.Path) -> None:
  from scaleopt.train import storage
  storage.path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


# ---------------------------------------------------------------------------------------------
# Resuming with a changed config.

# Keys (and sections, with everything under them) a resumed run may change: when and how much
# to train, log, evaluate, profile and checkpoint, the schedule's end, the device layout, and
# ``model.init_from`` (only read by fresh runs), and where Shampoo keeps its statistics
# (``offload_statistics``: where the statistics live, not what they are), and
# ``run.deterministic`` (how XLA computes, not what). Anything else (seed,
# data, model, optimizer) would make the continued run a different experiment than its
# checkpoints.
RESUMABLE = ("run.steps", "run.log_every", "run.eval_every", "run.eval_tokens",
             "run.checkpoint_every", "run.keep_checkpoints", "run.async_checkpoint",
             "run.max_consecutive_skips", "run.progress", "run.tensorboard", "run.plot",
             "run.peak_flops", "run.wandb", "run.profile", "run.telemetry_every",
             "run.host_phases", "optimizer.schedule.total_steps", "model.init_from", "mesh.data",
             "mesh.fsdp", "mesh.tensor", "mesh.distributed", "mesh.shard_optimizer",
             "optimizer.extra.block_major",
             "optimizer.extra.offload_statistics", "run.deterministic")
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
  from scaleopt.train import storage
  d = storage.path(run_dir)
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


WARMUP_KEY = "optimizer.schedule.warmup_steps"


def _fitted_before(saved: dict, cfg: TrainConfig) -> bool:
  """A run recorded with its fitted warm-up (not as written): the saved warm-up is what the
  requested one fits to at the saved schedule's length, so the user did not change it."""
  sched = (saved.get("optimizer") or {}).get("schedule")
  if not isinstance(sched, dict) or not isinstance(sched.get("total_steps"), int):
    return False
  want = cfg.to_dict()["optimizer"]["schedule"]
  if want["warmup_steps"] == sched.get("warmup_steps"):
    return False
  fitted, written = _fit_warmup({**want, "total_steps": sched["total_steps"]}, note=False)
  return written is not None and fitted["warmup_steps"] == sched.get("warmup_steps")


def check_resume(cfg: TrainConfig, run_dir: str | pathlib.Path) -> dict[str, tuple]:
  """Compares the requested config with the run's saved one (reads only); returns the
  resumable changes, raises ConfigError naming every other changed key."""
  saved = saved_config(run_dir)
  if saved is None:
    return {}
  changes = config_changes(saved, yaml.safe_load(yaml.safe_dump(cfg.to_dict())))
  if _fitted_before(saved, cfg):
    changes.pop(WARMUP_KEY)
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
    from scaleopt.train import storage
    storage.append_text(storage.path(run_dir) / HISTORY, json.dumps(rec) + "\n")
