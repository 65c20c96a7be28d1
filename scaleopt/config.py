"""Shipped configs by name: ``--config tiny`` works from any folder, a path still works too.

The YAML files under the repository's ``configs/`` ship inside the wheel as the package data of
``scaleopt.configs`` (``pyproject.toml`` maps that package to ``configs/``). A name is looked up
in the command's own folder first, then from the top::

  scaleopt train --config tiny                 -> configs/train/tiny.yaml
  scaleopt train --config optim/adamw          -> configs/optim/adamw.yaml
  scaleopt sweep --config small  (or sweeps/small)   -> configs/sweeps/small.yaml
  scaleopt study --config bc_tiny (or studies/bc_tiny) -> configs/studies/bc_tiny.yaml

An existing file always wins over a name.
"""

from __future__ import annotations

import importlib.resources
import pathlib

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
  or without ``.yaml``) in ``kind``'s folder (train, sweep, study), else from the top."""
  p = pathlib.Path(name_or_path)
  if p.is_file():
    return p
  name = str(name_or_path).removesuffix(".yaml")
  if not name or name.startswith(("/", ".")) or ".." in pathlib.PurePath(name).parts:
    raise ConfigError(f"config file {str(name_or_path)!r} does not exist")
  root = configs_dir()
  for cand in (root / KIND_DIRS[kind] / f"{name}.yaml", root / f"{name}.yaml"):
    if cand.is_file():
      return cand
  others = [n for n in shipped_names() if not n.startswith(KIND_DIRS[kind] + "/")]
  raise ConfigError(f"config file {str(name_or_path)!r} does not exist and is not a shipped "
                    f"config name; shipped {kind} configs: {', '.join(shipped_names(kind))} "
                    f"(others: {', '.join(others)})")
