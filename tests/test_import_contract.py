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


def _docstrings(tree) -> set[int]:
  """ids of the docstring constants of a module and of its functions and classes."""
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      body = node.body
      if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        out.add(id(body[0].value))
  return out


def _lookups_by_name(text: str, prefixes: tuple[str, ...]) -> list[str]:
  """Ways a file reaches a module without an import statement: ``sys.modules``,
  ``importlib.import_module``, ``__import__``, and string constants (docstrings aside) that
  name a module under ``prefixes``."""
  tree, out = ast.parse(text), []
  docs = _docstrings(tree)
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and node.attr in ("modules", "import_module"):
      out.append(f"line {node.lineno}: .{node.attr}")
    elif isinstance(node, ast.Name) and node.id == "__import__":
      out.append(f"line {node.lineno}: __import__")
    elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
          and id(node) not in docs and node.value.startswith(prefixes)):
      out.append(f"line {node.lineno}: {node.value!r}")
  return out


def test_optim_reaches_no_module_by_name():
  """No ``sys.modules`` look-up or module named in a string: the layering holds for modules
  reached without an import line too (the mesh comes from ``scaleopt.mesh_context``)."""
  bad = {str(f.relative_to(ROOT)): _lookups_by_name(f.read_text(), ("flax", "scaleopt.models"))
         for f in sorted((ROOT / "scaleopt/optim").rglob("*.py"))}
  assert {k: v for k, v in bad.items() if v} == {}


def test_lookups_by_name_are_seen():
  """The scan's own check, on the ways a module can be reached without importing it."""
  text = ('"""Reads scaleopt.models.sharding."""\nimport sys, importlib\n'
          'def f():\n  """From scaleopt.models."""\n'
          '  a = sys.modules.get("scaleopt.models.sharding")\n'
          '  b = importlib.import_module("flax.nnx")\n  return __import__("x")\n')
  found = _lookups_by_name(text, ("flax", "scaleopt.models"))
  assert sorted(found) == sorted(["line 5: .modules", "line 5: 'scaleopt.models.sharding'",
                   "line 6: .import_module", "line 6: 'flax.nnx'", "line 7: __import__"]), found


def test_mesh_context_is_shared_and_standard_library_only():
  """The module both sides import names no third-party or scaleopt module, and the model's
  ``constraints`` context is what the optimizer reads."""
  names = _imports(ROOT / "scaleopt/mesh_context.py")
  assert {n.split(".")[0] for n in names} <= {"__future__", "contextlib", "contextvars",
                                              "typing"}, names
  from scaleopt import mesh_context
  from scaleopt.models import sharding
  mesh = object()
  assert mesh_context.current() is None
  with sharding.constraints(mesh):
    assert mesh_context.current() is mesh and sharding.current_mesh() is mesh
  assert mesh_context.current() is None


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
