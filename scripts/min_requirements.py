"""Prints the lowest versions pyproject.toml allows (`pkg>=X` -> `pkg==X`), one per line, for
the core dependencies and the extras named on the command line (`make test-min`)."""

import pathlib
import re
import sys
import tomllib

project = tomllib.loads((pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml")
                        .read_text())["project"]
reqs = list(project["dependencies"])
for extra in sys.argv[1:]:
  reqs += project["optional-dependencies"][extra]
for r in reqs:
  m = re.fullmatch(r"\s*([A-Za-z0-9_.\-]+(?:\[[^\]]*\])?)\s*>=\s*([^,;\s]+)\s*", r)
  print(f"{m[1]}=={m[2]}" if m else r)
