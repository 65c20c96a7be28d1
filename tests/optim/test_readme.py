"""The README's "Use it" code runs as written."""

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_readme_use_it_snippet_runs():
  text = README.read_text()
  section = text[text.index("## Use it"):]
  code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  ns: dict = {}
  exec(compile(code, str(README), "exec"), ns)  # noqa: S102 - the documented snippet
  assert np.isfinite(float(ns["loss"]))
  w0 = np.asarray(ns["params"]["w"])
  assert np.any(w0 != 0)  # the step moved the parameters
