"""No import cycle inside ``scaleopt``, read statically (ast) from every file.

Every import statement counts, at module level and inside functions (a function-level import
only defers a cycle to the first call, it does not remove it), ``if TYPE_CHECKING:`` blocks
included. An edge goes from a module to the module it names: ``from a.b import c`` is an edge to
``a.b.c`` when that is a module, else to ``a.b``; ``import a.b.c`` to ``a.b.c``. The parent
packages Python runs on the way (``a/__init__.py``, ``a/b/__init__.py``) are not edges: a
package that imports its own submodules would otherwise close a cycle with each of them.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
  parts = path.relative_to(root).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path, package: str) -> dict[str, set[str]]:
  """{module: the modules of ``package`` it imports} for every file under ``root/package``."""
  files = {_module_name(p, root): p for p in sorted((root / package).rglob("*.py"))}
  graph = {}
  for name, path in files.items():
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets = set()

    def add(module: str) -> None:
      while module and module not in files:  # a name inside a module: the module
        module = module.rpartition(".")[0]
      if module and module != name:
        targets.add(module)

    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        for alias in node.names:
          add(alias.name)
      elif isinstance(node, ast.ImportFrom):
        base = pkg[:len(pkg) - node.level + 1] if node.level else []
        module = ".".join(base + ([node.module] if node.module else []))
        for alias in node.names:
          add(f"{module}.{alias.name}" if f"{module}.{alias.name}" in files else module)
    graph[name] = targets
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
  """One import cycle as [a, b, ..., a], or [] when there is none (depth-first search)."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def visit(node: str) -> list[str]:
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph.get(node, ())):
      if state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      if nxt not in state:
        found = visit(nxt)
        if found:
          return found
    path.pop()
    state[node] = 2
    return []

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return []


def test_scaleopt_has_no_import_cycle():
  graph = import_graph(ROOT, "scaleopt")
  assert len(graph) > 50 and "scaleopt.train.loop" in graph["scaleopt.train.main"]
  cycle = find_cycle(graph)
  assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_a_cycle_through_a_function_level_import_is_found(tmp_path):
  pkg = tmp_path / "pkg"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "sub" / "__init__.py").write_text("from pkg.sub import b\n")  # its own submodule
  (pkg / "a.py").write_text("from pkg.sub import b\n")
  (pkg / "sub" / "b.py").write_text("import os\n\ndef f():\n  from pkg import c\n")
  (pkg / "c.py").write_text("from pkg.sub.b import f\n")
  graph = import_graph(tmp_path, "pkg")
  assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.c"] == {"pkg.sub.b"}
  assert find_cycle(graph) == ["pkg.sub.b", "pkg.c", "pkg.sub.b"]
  (pkg / "c.py").write_text("import os\n")
  assert find_cycle(import_graph(tmp_path, "pkg")) == []
