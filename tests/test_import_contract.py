"""The package's layering, read from the import statements of every file: ``scaleopt.optim``
is Optax transforms on pytrees (no Flax, no model code), and nothing in ``scaleopt`` or
``tests`` imports the benchmark scripts (they are programs run from the command line, not
modules; what they measure lives in the package)."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _imports(path: pathlib.Path) -> set[str]:
  return _imports_of(path.read_text(), path.relative_to(ROOT).with_suffix("").parts[:-1])


def _imports_of(text: str, pkg: tuple[str, ...]) -> set[str]:
  """Absolute module names a file of package ``pkg`` imports, anywhere in it (function bodies
  too); relative imports resolved against ``pkg``."""
  out = set()
  for node in ast.walk(ast.parse(text)):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = list(pkg[:len(pkg) - node.level + 1]) if node.level else []
      mod = ".".join(base + ([node.module] if node.module else []))
      out.add(mod)
      out.update(f"{mod}.{a.name}" for a in node.names)
  return out


def _under(names: set[str], prefix: str) -> list[str]:
  return sorted(n for n in names if n == prefix or n.startswith(prefix + "."))


def _violations(folder: str, prefixes: tuple[str, ...]) -> dict[str, list[str]]:
  out = {}
  for f in sorted((ROOT / folder).rglob("*.py")):
    names = _imports(f)
    bad = [n for p in prefixes for n in _under(names, p)]
    if bad:
      out[str(f.relative_to(ROOT))] = bad
  return out


def test_optim_imports_neither_flax_nor_models():
  assert _violations("scaleopt/optim", ("flax", "scaleopt.models")) == {}


def test_nothing_imports_benchmarks():
  assert _violations("scaleopt", ("benchmarks",)) == {}
  assert _violations("tests", ("benchmarks",)) == {}


def test_relative_imports_are_resolved():
  """The scan's own check: imports inside functions and relative ones are seen."""
  text = "def f():\n  from ..models import sharding\n  import flax.nnx\nfrom . import build\n"
  names = _imports_of(text, ("scaleopt", "optim"))
  assert {"scaleopt.models.sharding", "flax.nnx", "scaleopt.optim.build"} <= names


def test_importing_optim_loads_no_flax():
  code = ("import sys, scaleopt.optim; print(sorted(m for m in sys.modules if "
          "m.split('.')[0] == 'flax' or m.startswith('scaleopt.models')))")
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       check=True, env={"PATH": "", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)})
  assert out.stdout.strip() == "[]", out.stdout
