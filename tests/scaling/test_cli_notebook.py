"""End to end: `sweep_main` writes its files; the notebook runs on the small preset."""

import csv
import os
import pathlib
import subprocess
import sys

import pytest

from scaleopt.scaling import sweep

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.integration  # a whole sweep: the second tier
def test_sweep_main_writes_alpha_losses_and_plots(tmp_path, capsys):
  """Two draws (seeds = 2) is allowed with a loud warning; every output file is written."""
  rc = sweep.sweep_main(str(ROOT / "configs/sweeps/small.yaml"), str(tmp_path),
                        overrides=["problem.s=[1.0, 2.0]", "problem.seeds=2",
                                   "problem.n_features=[16, 32, 64]", "fit.bootstrap=20",
                                   "compute.progress=false"])
  assert rc == 0
  rows = list(csv.DictReader((tmp_path / "alpha.csv").open()))
  assert list(rows[0])[:7] == ["s", "optimizer", "alpha", "ci_low", "ci_high", "shift",
                               "interval_method"]
  assert {r["interval_method"] for r in rows} == {"cluster_t"}
  assert {"alpha_drop_first", "alpha_drop_last", "window_ratio", "slope_16_64"} <= set(rows[0])
  assert len(rows) == 2 * 5
  losses = list(csv.DictReader((tmp_path / "losses.csv").open()))
  assert len(losses) == 2 * 5 * 3
  for f in ("loss_vs_n.png", "alpha_vs_s.png", "window.png", "raw.npz"):
    assert (tmp_path / f).stat().st_size > 1000
  out = capsys.readouterr()
  assert "| s |" in out.out
  assert "WARNING: problem.seeds = 2" in out.err
  re = sweep.load_raw(tmp_path / "raw.npz")
  again, _ = sweep.summarize(re)
  assert [round(float(r["alpha"]), 4) for r in rows] == [round(r["alpha"], 4) for r in again]


def test_sweep_main_reports_config_errors(tmp_path, capsys):
  rc = sweep.sweep_main(str(ROOT / "configs/sweeps/small.yaml"), str(tmp_path),
                        overrides=["problem.spectrum=flat"])
  assert rc == 2
  assert "problem.spectrum" in capsys.readouterr().err


def _cli(*args):
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  return subprocess.run([sys.executable, "-m", "scaleopt.cli", "sweep", *args], env=env,
                        capture_output=True, text=True, timeout=120)


def test_cli_bad_inputs_exit_2_with_one_line(tmp_path):
  """YAML syntax error, --out naming a file, invalid values: one line on stderr, exit 2."""
  bad = tmp_path / "bad.yaml"
  bad.write_text("problem:\n  s: [1.0\n")
  afile = tmp_path / "afile"
  afile.write_text("x")
  small = str(ROOT / "configs/sweeps/small.yaml")
  cases = [((("--config", str(bad), "--out", str(tmp_path / "o"))), "YAML syntax error"),
           ((("--config", small, "--out", str(afile))), "is a file")]
  for args, needle in cases:
    r = _cli(*args)
    assert r.returncode == 2, (args, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
  assert not (tmp_path / "o").exists()


def test_sweep_main_invalid_value_is_one_line(tmp_path, capsys):
  rc = sweep.sweep_main(str(ROOT / "configs/sweeps/small.yaml"), str(tmp_path / "o"),
                        overrides=["problem.seeds=2.7"])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and err == ["error: problem.seeds = 2.7: expected an integer"]


# Every figure the notebook promises, by a piece of source unique to the cell that draws it.
NOTEBOOK_FIGURES = {"loss vs N": 'OUT / "loss_vs_n.png"', "window report": 'OUT / "window.png"',
                    "alpha vs s": 'OUT / "alpha_vs_s.png"',
                    "closed form vs simulation": 'OUT / "theory_overlay.png"',
                    "spectra": "ax.loglog("}


def _figure_cells(nb) -> dict:
  """Each promised figure's code cell (exactly one per figure)."""
  cells = {}
  for name, marker in NOTEBOOK_FIGURES.items():
    found = [c for c in nb.cells if c.cell_type == "code" and marker in c.source]
    assert len(found) == 1, (name, len(found))
    cells[name] = found[0]
  return cells


def _images(cell) -> int:
  return sum("image/png" in o.get("data", {}) for o in cell.get("outputs", []))


@pytest.mark.integration
def test_notebook_executes_on_small_preset():
  """Headless (a fresh kernel, no display), each cell under a time limit: no error, the
  expected text, and every promised figure rendered as an image in its own cell."""
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  nb = nbformat.read(ROOT / "notebooks/scaling_exponents.ipynb", as_version=4)
  for c in nb.cells:
    if c.cell_type == "code":
      c.outputs = []
  saved = {k: os.environ.pop(k, None) for k in ("DISPLAY", "MPLBACKEND")}
  os.environ["SCALEOPT_NB_QUICK"] = "1"
  try:
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()
  finally:
    os.environ.pop("SCALEOPT_NB_QUICK", None)
    os.environ.update({k: v for k, v in saved.items() if v is not None})
  text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []))
  assert "s_hat" in text and "max relative difference" in text
  assert "LM tiny (trained" in text and "(mode counting)" in text and "window" in text
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors
  missing = [name for name, cell in _figure_cells(nb).items() if _images(cell) != 1]
  assert not missing, f"figures without exactly one image output: {missing}"


def test_committed_notebook_shows_every_promised_figure():
  """The notebook is committed with its outputs: each promised figure is an image there too."""
  nbformat = pytest.importorskip("nbformat")
  nb = nbformat.read(ROOT / "notebooks/scaling_exponents.ipynb", as_version=4)
  missing = [name for name, cell in _figure_cells(nb).items() if _images(cell) != 1]
  assert not missing, f"figures without exactly one image output: {missing}"
