"""The built wheel works outside the source tree; shipped configs resolve by name.

The wheel is built offline (``pip wheel --no-deps --no-build-isolation``) and installed with
``--no-deps`` into a fresh venv whose only other packages are the test venv's site-packages (a
``.pth`` line, so the source checkout is never on the path); commands run from a temp folder.
"""

import os
import pathlib
import re
import site
import subprocess
import sys
import tomllib
import zipfile

import pytest
import yaml

from scaleopt import config as SC

REPO = pathlib.Path(__file__).resolve().parents[1]
SHIPPED = sorted(str(p.relative_to(REPO / "configs")) for p in (REPO / "configs").rglob("*.yaml"))
TRAIN_FLAGS = ["--set", "run.steps=3", "--set", "run.log_every=1", "--set", "run.eval_every=3",
               "--set", "run.eval_tokens=256", "--set", "run.checkpoint_every=3",
               "--set", "run.progress=false", "--set", "run.plot=false",
               "--set", "run.tensorboard=false", "--set", "run.async_checkpoint=false",
               "--set", "model.d_model=32", "--set", "model.n_layers=1", "--set", "model.d_ff=64",
               "--set", "data.seq_len=16", "--set", "data.batch_size=4",
               "--set", "data.microbatches=2", "--set", "optimizer.schedule.warmup_steps=1"]


def _run(cmd, cwd, timeout=120):
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
  env["JAX_PLATFORMS"] = "cpu"
  return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=timeout)


def _venv(root: pathlib.Path) -> pathlib.Path:
  """A fresh venv (no pip) that sees the test venv's site-packages after its own."""
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
  py = root / "bin" / "python"
  own = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root)
  (pathlib.Path(own.stdout.strip()) / "_test_venv.pth").write_text(
      "\n".join(site.getsitepackages()) + "\n")
  return py


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
  out = tmp_path_factory.mktemp("wheel")
  r = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
            "-w", out, REPO], out, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  (whl,) = out.glob("scaleopt-*.whl")
  return whl


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> pathlib.Path:
  """The wheel installed with --no-deps into a fresh venv; returns that venv's bin/."""
  root = tmp_path_factory.mktemp("venv")
  py = _venv(root)
  r = _run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps",
            "--no-index", wheel], root)
  assert r.returncode == 0, r.stderr[-2000:]
  return py.parent


def test_package_list_covers_every_subpackage():
  listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
               ["packages"])
  found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "scaleopt").rglob(
      "__init__.py")}
  assert listed == found | {"scaleopt.configs"}


def test_no_private_modules_of_dependencies_imported():
  """e.g. ``optax.contrib._muon``: private paths change without notice between releases."""
  pat = re.compile(r"^\s*(from|import)\s+(jax|jaxlib|optax|flax|orbax|chex|tensorboardX|"
                   r"tokenizers|safetensors)(\.\w+)*\._[a-z]", re.M)
  hits = [f"{p.relative_to(REPO)}: {m.group(0).strip()}" for p in (REPO / "scaleopt").rglob("*.py")
          for m in pat.finditer(p.read_text())]
  # JAX has no public "has a backend started" query; determinism.backend_started guards its
  # use of the internal one (ImportError / AttributeError -> unknown).
  allowed = {"scaleopt/train/determinism.py: from jax._s"}  # the match stops at "._s"
  assert set(hits) <= allowed, sorted(set(hits) - allowed)
  assert "runpy" not in (REPO / "scaleopt" / "cli.py").read_text()


def test_wheel_contents(wheel):
  names = zipfile.ZipFile(wheel).namelist()
  assert sorted(n.removeprefix("scaleopt/configs/") for n in names
                if n.startswith("scaleopt/configs/") and n.endswith(".yaml")) == SHIPPED
  assert not [n for n in names if n.startswith(("experiments/", "tests/", "configs/", "docs/"))]
  assert "scaleopt/optim/bias_study.py" in names  # the CLI imports it (nothing runs by path)
  meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
  assert "License-Expression: Apache-2.0" in meta
  assert "Requires-Python: >=3.11" in meta
  for extra in ("hf", "tensorboard", "gpu", "dev"):
    assert f"Provides-Extra: {extra}" in meta
  lic = [n for n in names if n.endswith("licenses/LICENSE")]
  assert lic and b"Apache License" in zipfile.ZipFile(wheel).read(lic[0])


@pytest.mark.parametrize("name,kind,rel", [
    ("tiny", "train", "train/tiny.yaml"),
    ("train/tiny.yaml", "train", "train/tiny.yaml"),
    ("optim/adamw", "train", "optim/adamw.yaml"),
    ("small", "sweep", "sweeps/small.yaml"),
    ("sweeps/small", "sweep", "sweeps/small.yaml"),
    ("bc_tiny", "study", "studies/bc_tiny.yaml"),
    ("studies/bc_tiny", "study", "studies/bc_tiny.yaml"),
])
def test_names_resolve_in_source_tree(name, kind, rel, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  assert SC.resolve_config(name, kind) == REPO / "configs" / rel


def test_path_wins_and_unknown_name_lists_names(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  (tmp_path / "tiny").write_text("run: {steps: 3}\n")
  assert SC.resolve_config("tiny", "train") == pathlib.Path("tiny")
  with pytest.raises(SC.ConfigError, match=r"'nope' does not exist.*tiny_adamw_bc.*sweeps/small"):
    SC.resolve_config("nope", "train")
  with pytest.raises(SC.ConfigError, match="does not exist"):
    SC.resolve_config("../configs/train/tiny", "train")


@pytest.mark.integration  # builds and installs the wheel: second tier
def test_installed_wheel_resolves_names_from_any_folder(installed, tmp_path):
  r = _run([installed / "python", "-c", "import scaleopt.config as c, scaleopt; "
            "print(scaleopt.__file__); print(c.resolve_config('tiny', 'train')); "
            "print(c.resolve_config('sweeps/small', 'sweep'))"], tmp_path)
  assert r.returncode == 0, r.stderr[-2000:]
  pkg, tiny, small = r.stdout.split()
  venv = installed.parent
  assert pathlib.Path(pkg).is_relative_to(venv), pkg  # not the source checkout
  assert pathlib.Path(tiny).is_relative_to(venv)
  assert tiny.endswith("scaleopt/configs/train/tiny.yaml")
  assert small.endswith("scaleopt/configs/sweeps/small.yaml")
  r = _run([installed / "scaleopt", "train", "--config", "tiny", "--print-config",
            "--set", "run.steps=70"], tmp_path)
  assert r.returncode == 0, r.stderr[-2000:]
  printed = yaml.safe_load(r.stdout)
  assert printed["run"]["steps"] == 70 and printed["model"]["preset"] == "tiny"
  r = _run([installed / "scaleopt", "study", "--config", "bc_tiny", "--out", "s", "--list"],
           tmp_path)  # the study's `base: ../train/tiny.yaml` resolves inside the package
  assert r.returncode == 0 and "study bc_tiny: 8 cell(s)" in r.stdout, r.stderr[-2000:]
  r = _run([installed / "scaleopt", "study", "--config", "nope", "--out", "x"], tmp_path)
  assert r.returncode == 2 and r.stderr.startswith("error: config file 'nope' does not exist")


@pytest.mark.slow
def test_installed_wheel_trains_tiny(installed, tmp_path):
  r = _run([installed / "scaleopt", "train", "--config", "tiny", "--out", "run", *TRAIN_FLAGS],
           tmp_path, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert (tmp_path / "run" / "metrics.jsonl").is_file()
  r = _run([installed / "scaleopt", "bias-study", "--quick", "--trials", "200", "--out", "b.md"],
           tmp_path, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "bias-study:begin" in (tmp_path / "b.md").read_text()


def test_editable_install_resolves_names(tmp_path):
  """An editable install maps scaleopt.configs onto configs/ (importlib.resources sees it)."""
  py = _venv(tmp_path / "venv")
  r = _run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps",
            "--no-build-isolation", "--no-index", "-e", REPO], tmp_path, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  r = _run([py, "-c", "import importlib.resources as r, scaleopt.config as c; "
            "print(r.files('scaleopt.configs') / 'train' / 'tiny.yaml'); "
            "print(c.resolve_config('tiny', 'train'))"], tmp_path)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.split() == [str(REPO / "configs" / "train" / "tiny.yaml")] * 2
