"""No private name of ``scaleopt.optim`` crosses a module: nothing in ``scaleopt/``,
``tests/`` or ``benchmarks/`` imports an underscore name from an ``scaleopt.optim`` module or
reads one as a module attribute (shared helpers are public, e.g. ``scaleopt.optim.tree_utils``)."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


NAMEDTUPLE_API = {"_fields", "_replace", "_asdict", "_make", "_field_defaults"}


def _private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__") and name not in NAMEDTUPLE_API


def _crossings(path: pathlib.Path) -> list[str]:
  tree = ast.parse(path.read_text())
  modules, out = {}, []
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("scaleopt.optim"):
      for alias in node.names:
        if _private(alias.name):
          out.append(f"{path}:{node.lineno}: from {node.module} import {alias.name}")
        modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    elif isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.startswith("scaleopt.optim") and alias.asname:
          modules[alias.asname] = alias.name
  for node in ast.walk(tree):
    if (isinstance(node, ast.Attribute) and _private(node.attr)
        and isinstance(node.value, ast.Name) and node.value.id in modules):
      out.append(f"{path}:{node.lineno}: {node.value.id}.{node.attr}")
  return out


def test_no_private_optim_name_is_used_outside_its_module():
  files = [p for d in ("scaleopt", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py")]
  found = [c for p in files for c in _crossings(p)]
  assert not found, "\n".join(found)


def test_the_check_sees_a_private_import(tmp_path):
  bad = tmp_path / "bad.py"
  bad.write_text("from scaleopt.optim.soap_lib import _x\n"
                 "from scaleopt.optim.shampoo_lib import roots\nroots._y(1)\n")
  assert len(_crossings(bad)) == 2
