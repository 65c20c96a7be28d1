"""One config system: shipped configs by name, one error type, one override parser, one typed
schema mechanism (train, sweep and study configs all use it).

**Names.** ``--config tiny`` works from any folder, a path still works too. The YAML files under
the repository's ``configs/`` ship inside the wheel as the package data of ``scaleopt.configs``
(``pyproject.toml`` maps that package to ``configs/``). A name is looked up in the command's own
folder first, then from the top::

  scaleopt train --config tiny                 -> configs/train/tiny.yaml
  scaleopt train --config optim/adamw          -> configs/optim/adamw.yaml
  scaleopt sweep --config small  (or sweeps/small)   -> configs/sweeps/small.yaml
  scaleopt study --config bc_tiny (or studies/bc_tiny) -> configs/studies/bc_tiny.yaml

An existing file always wins over a name; a repository path such as
``configs/train/qwen2.5-0.5b.yaml`` also names the shipped file from any folder.

**Errors.** Every bad file, key or value raises ``ConfigError`` with one line that names the
dotted key, the value and what is allowed (the CLI prints it and exits with code 2).

**Overrides.** ``a.b.c=value`` (value parsed as YAML; ``1e-4`` is a float): ``apply_overrides``.

**Schemas.** A section is a dataclass; ``parse(cls, raw, where)`` checks the keys and converts
every value by its type hint (``int``, ``float``, ``bool``, ``str``, ``Literal[...]``,
``Optional[...]``, ``list[...]``, ``tuple[...]``, ``dict``, nested dataclasses) and the field's
``spec(...)`` metadata (lower bound, scalar-as-list, distinct), so each config family declares
its sections once and keeps only its cross-key checks by hand.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.resources
import math
import pathlib
import re
import types
import typing
from typing import Any, Callable, Literal, Optional, Sequence, Union

import yaml

KIND_DIRS = {"train": "train", "sweep": "sweeps", "study": "studies"}


class ConfigError(ValueError):
  """A config file, name, key or value is wrong; the message names it (CLI: exit code 2)."""


def configs_dir() -> pathlib.Path:
  """The folder of shipped configs: ``configs/`` of a source checkout (when scaleopt is imported
  from one), else the installed ``scaleopt.configs`` package data."""
  src = pathlib.Path(__file__).resolve().parent.parent
  if (src / "pyproject.toml").is_file() and (src / "configs" / "train").is_dir():
    return src / "configs"
  try:
    root = importlib.resources.files("scaleopt.configs")
  except ModuleNotFoundError:
    raise ConfigError("no shipped configs found (neither a source checkout's configs/ nor the "
                      "installed scaleopt.configs package)") from None
  if not isinstance(root, pathlib.Path):
    raise ConfigError(f"shipped configs at {root} are not on the file system (zipped install?); "
                      "pass a config file path")
  return root


def shipped_names(kind: str | None = None) -> list[str]:
  """Names of the shipped configs, ``folder/stem``; with ``kind``, that command's folder only
  (and without the folder)."""
  root = configs_dir()
  if kind is not None:
    return sorted(p.stem for p in (root / KIND_DIRS[kind]).glob("*.yaml"))
  return sorted(str(p.relative_to(root).with_suffix("")) for p in root.rglob("*.yaml"))


def resolve_config(name_or_path: str | pathlib.Path, kind: str) -> pathlib.Path:
  """The file for ``--config``: an existing path as given, else a shipped config's name (with
  or without ``.yaml``) in ``kind``'s folder (train, sweep, study), else from the top. A
  repository path (``configs/train/tiny.yaml``) that does not exist from the current folder
  names the shipped file it points to."""
  p = pathlib.Path(name_or_path)
  if p.is_file():
    return p
  name = str(name_or_path).removesuffix(".yaml")
  if not name or name.startswith(("/", ".")) or ".." in pathlib.PurePath(name).parts:
    raise ConfigError(f"config file {str(name_or_path)!r} does not exist")
  root = configs_dir()
  parts = pathlib.PurePath(name).parts
  if len(parts) > 1 and parts[0] == "configs":  # the repository path, typed in another folder
    name = str(pathlib.PurePath(*parts[1:]))
  for cand in (root / KIND_DIRS[kind] / f"{name}.yaml", root / f"{name}.yaml"):
    if cand.is_file():
      return cand
  others = [n for n in shipped_names() if not n.startswith(KIND_DIRS[kind] + "/")]
  raise ConfigError(f"config file {str(name_or_path)!r} does not exist and is not a shipped "
                    f"config name; shipped {kind} configs: {', '.join(shipped_names(kind))} "
                    f"(others: {', '.join(others)})")


# ---------------------------------------------------------------------------------------------
# YAML and overrides.

_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)$")


def numbers(x: Any) -> Any:
  """YAML 1.1 reads ``1e-4`` as a string; read such strings as floats (recursively)."""
  if isinstance(x, str) and _FLOAT.match(x):
    return float(x)
  if isinstance(x, dict):
    return {k: numbers(v) for k, v in x.items()}
  if isinstance(x, list):
    return [numbers(v) for v in x]
  return x


def yaml_error(e: yaml.YAMLError) -> str:
  """A YAML error on one line: where (1-based line and column) and what."""
  mark = getattr(e, "problem_mark", None)
  what = getattr(e, "problem", None) or " ".join(str(e).split())
  return f"line {mark.line + 1}, column {mark.column + 1}: {what}" if mark else what


def read_yaml(path: str | pathlib.Path, what: str = "config file") -> Any:
  """A YAML file's content (``{}`` when empty); a missing file, a directory, an unreadable
  file or a syntax error is one ConfigError line naming the file."""
  p = pathlib.Path(path)
  if p.is_dir():
    raise ConfigError(f"{what} {str(p)!r} is a directory")
  if not p.is_file():
    raise ConfigError(f"{what} {str(p)!r} does not exist")
  try:
    return numbers(yaml.safe_load(p.read_text()))
  except yaml.YAMLError as e:
    raise ConfigError(f"{what} {str(p)!r}: YAML syntax error at {yaml_error(e)}") from None
  except (OSError, UnicodeDecodeError) as e:
    raise ConfigError(f"{what} {str(p)!r} cannot be read ({type(e).__name__}: {e})") from None


def parse_override(item: str) -> tuple[list[str], Any]:
  """``a.b.c=value`` -> (["a", "b", "c"], value parsed as YAML)."""
  if "=" not in item:
    raise ConfigError(f"override {item!r}: expected KEY=VALUE with a dotted KEY, e.g. "
                      "section.key=value")
  key, value = item.split("=", 1)
  path = key.strip().split(".")
  if not all(path):
    raise ConfigError(f"override key {key!r} is empty or malformed")
  try:
    return path, numbers(yaml.safe_load(value))
  except yaml.YAMLError as e:
    raise ConfigError(f"override {item!r}: the value is not valid YAML ({yaml_error(e)})") from None


def set_dotted(raw: dict, path: Sequence[str] | str, value: Any, what: str = "") -> None:
  """``raw[a][b][c] = value`` for ``path`` a.b.c, creating sections (a value in the way is an
  error)."""
  parts = path.split(".") if isinstance(path, str) else list(path)
  node = raw
  for p in parts[:-1]:
    nxt = node.get(p)
    if nxt is None:
      nxt = node[p] = {}
    if not isinstance(nxt, dict):
      raise ConfigError(f"{what or 'key ' + repr('.'.join(parts))}: '{p}' is a value, not a "
                        "section")
    node = nxt
  node[parts[-1]] = copy.deepcopy(value)


def apply_overrides(raw: dict, overrides: Sequence[str] | None, *, min_depth: int = 1,
                    route: Optional[Callable[[list[str]], list[str]]] = None) -> dict:
  """A copy of ``raw`` with every ``a.b=value`` override set. ``min_depth``: the fewest dotted
  parts a key needs (2: ``section.key``); ``route`` maps a key's parts to where they go."""
  out = copy.deepcopy(raw)
  for item in overrides or ():
    path, value = parse_override(item)
    if len(path) < min_depth:
      raise ConfigError(f"override key {item.split('=', 1)[0].strip()!r} must be dotted, e.g. "
                        "optimizer.learning_rate")
    set_dotted(out, route(path) if route else path, value, what=f"override {item!r}")
  return out


def merge(a: dict, b: dict) -> dict:
  """``b`` merged over ``a`` (nested mappings merge, everything else replaces)."""
  out = copy.deepcopy(a)
  for k, v in b.items():
    if isinstance(v, dict) and isinstance(out.get(k), dict):
      out[k] = merge(out[k], v)
    else:
      out[k] = copy.deepcopy(v)
  return out


# ---------------------------------------------------------------------------------------------
# Typed schemas.


def spec(default: Any = dataclasses.MISSING, *, min: Optional[float] = None,
         gt: Optional[float] = None, listify: bool = False, distinct: bool = False,
         sort: bool = False, default_factory: Any = dataclasses.MISSING) -> Any:
  """A dataclass field with value constraints: ``min`` / ``gt`` (lower bound, inclusive /
  exclusive), ``listify`` (a scalar stands for a one-element list), ``distinct`` / ``sort``
  (for lists)."""
  meta = {"min": min, "gt": gt, "listify": listify, "distinct": distinct, "sort": sort}
  if default_factory is not dataclasses.MISSING:
    return dataclasses.field(default_factory=default_factory, metadata=meta)
  return dataclasses.field(default=default, metadata=meta)


def fail(key: str, value: Any, problem: str) -> ConfigError:
  return ConfigError(f"{key} = {value!r}: {problem}")


def choice(value: Any, key: str, allowed: Sequence[Any]) -> Any:
  if value not in allowed:
    raise fail(key, value, f"allowed values are {', '.join(map(str, allowed))}")
  return value


def check_keys(section: dict, allowed: Sequence[str], where: str) -> None:
  unknown = sorted(str(k) for k in set(section) - set(allowed))
  if unknown:
    names = ", ".join(f"{where}.{k}" if where else k for k in unknown)
    raise ConfigError(f"unknown key(s) {names}; allowed keys in {where or 'the config'}: "
                      f"{', '.join(sorted(map(str, allowed)))}")


def _describe(tp: Any) -> str:
  origin = typing.get_origin(tp)
  if origin is Literal:
    return "one of " + ", ".join(map(str, typing.get_args(tp)))
  if origin in (Union, types.UnionType):
    return " or ".join(_describe(a) for a in typing.get_args(tp))
  if origin in (list, tuple):
    inner = _describe(typing.get_args(tp)[0])
    return f"a list of {inner.split(' ', 1)[1] if inner.startswith(('a ', 'an ')) else inner}s"
  return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
          dict: "a mapping", type(None): "null"}.get(tp, getattr(tp, "__name__", str(tp)))


def convert(value: Any, tp: Any, key: str, meta: Optional[dict] = None) -> Any:
  """``value`` checked against the type hint ``tp`` (and the field constraints ``meta``) and
  normalized: integer-valued floats are ints, ints are floats where a float is expected, a
  mapping becomes its dataclass. Raises ConfigError naming ``key``."""
  meta = meta or {}
  origin = typing.get_origin(tp)
  if origin in (Union, types.UnionType):
    args = typing.get_args(tp)
    if value is None and type(None) in args:
      return None
    errors = []
    for a in (a for a in args if a is not type(None)):
      try:
        return convert(value, a, key, meta)
      except ConfigError as e:
        errors.append(e)
    if len(errors) == 1:
      raise errors[0]
    raise fail(key, value, f"expected {_describe(tp)}")
  if origin is Literal:
    args = typing.get_args(tp)
    if isinstance(value, bool) and value not in args:  # YAML 1.1 reads on/off/yes/no as bools
      words = ("on", "yes", "true") if value else ("off", "no", "false")
      value = next((a for a in args if a in words), value)
    return choice(value, key, args)
  if origin in (list, tuple):
    if meta.get("listify") and not isinstance(value, (list, tuple)):
      value = [value]
    if not isinstance(value, (list, tuple)):
      raise fail(key, value, f"expected {_describe(tp)}")
    if not value:
      raise ConfigError(f"{key}: expected at least one value")
    inner = {k: v for k, v in meta.items() if k in ("min", "gt")}
    out = [convert(v, typing.get_args(tp)[0], key, inner) for v in value]
    dup = sorted({v for v in out if out.count(v) > 1}, key=str)
    if meta.get("distinct") and dup:
      raise fail(key, value, f"duplicate value(s) {', '.join(map(str, dup))}")
    out = sorted(out) if meta.get("sort") else out
    return tuple(out) if origin is tuple else out
  if dataclasses.is_dataclass(tp):
    return parse(tp, value, key)
  if tp is bool:
    if not isinstance(value, bool):
      raise fail(key, value, "expected true or false")
    return value
  if tp is int:
    if isinstance(value, float) and value.is_integer():
      value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
      raise fail(key, value, "expected an integer")
  elif tp is float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
      raise fail(key, value, "expected a number")
    value = float(value)
    if not math.isfinite(value):
      raise fail(key, value, "expected a finite number")
  elif tp is Any:
    return value
  elif not isinstance(value, origin or tp):
    raise fail(key, value, f"expected {_describe(tp)}")
  lo, gt = meta.get("min"), meta.get("gt")
  if lo is not None and value < lo:
    raise fail(key, value, f"must be {'an integer ' if tp is int else ''}>= {lo}")
  if gt is not None and value <= gt:
    raise fail(key, value, f"must be > {gt}")
  return value


def parse(cls: type, raw: Any, where: str):
  """An instance of the dataclass ``cls`` from the mapping ``raw`` (None: all defaults): every
  key must be a field, every value is ``convert``-ed by its type hint; missing keys take the
  field defaults. Errors name ``where.key``."""
  if raw is None:
    raw = {}
  if not isinstance(raw, dict):
    raise fail(where, raw, "expected a mapping of keys")
  fields = {f.name: f for f in dataclasses.fields(cls)}
  check_keys(raw, list(fields), where)
  hints = typing.get_type_hints(cls)
  missing = [k for k, f in fields.items() if k not in raw and f.default is dataclasses.MISSING
             and f.default_factory is dataclasses.MISSING]
  if missing:
    raise ConfigError(f"{where}: missing key(s) {', '.join(f'{where}.{k}' for k in missing)}")
  return cls(**{k: convert(v, hints[k], f"{where}.{k}", dict(fields[k].metadata))
                for k, v in raw.items()})


def to_dict(obj: Any) -> Any:
  """A dataclass (or a structure of them) as plain YAML-safe data (tuples become lists)."""
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
  if isinstance(obj, dict):
    return {k: to_dict(v) for k, v in obj.items()}
  if isinstance(obj, (list, tuple)):
    return [to_dict(v) for v in obj]
  return obj
