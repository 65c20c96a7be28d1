"""benchmarks/kernels.py: which tokamax settings count as passed, from pytest's JUnit XML file or,
when pytest was stopped before writing it, from its ``-v`` log."""

import importlib.util
import pathlib

_PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"
_spec = importlib.util.spec_from_file_location("kernels_benchmark", _PATH)
kb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kb)

F = "tests/models/test_kernels_gpu.py::"
# A -v log cut short: attention passed for both settings (mosaic declines float32), the GLU
# passed for mosaic only, Triton's GLU failed on one shape; the model tests never ran.
LOG = "\n".join([
    f"{F}test_attention_kernel_matches_today[shape0-tokamax_mosaic] PASSED [  5%]",
    f"{F}test_attention_kernel_matches_today[shape0-tokamax_triton] PASSED [ 10%]",
    f"{F}test_attention_kernel_float32[tokamax_mosaic] SKIPPED (tokamax declines) [ 15%]",
    f"{F}test_attention_kernel_float32[tokamax_triton] PASSED [ 20%]",
    f"{F}test_glu_kernel_matches_today[shape0-tokamax_mosaic] PASSED [ 25%]",
    f"{F}test_glu_kernel_matches_today[shape0-tokamax_triton] PASSED [ 30%]",
    f"{F}test_glu_kernel_matches_today[shape1-tokamax_triton] FAILED [ 35%]",
])


def test_log_fallback_when_pytest_wrote_no_xml(tmp_path):
  (tmp_path / "tests.log").write_text(LOG + "\n")
  junit = str(tmp_path / "tests.xml")  # never written
  bad = kb.failed_settings(junit)
  assert ("attention", "tokamax_mosaic") not in bad and ("attention", "tokamax_triton") not in bad
  assert ("glu", "tokamax_mosaic") not in bad
  assert ("glu", "tokamax_triton") in bad  # one shape failed
  assert ("norm", "tokamax_triton") in bad  # never ran
  assert kb.tests_line(junit) == "5 passed, 1 failed, 1 skipped (from the log: pytest stopped)"


def test_xml_wins_over_the_log(tmp_path):
  (tmp_path / "tests.log").write_text(LOG + "\n")
  (tmp_path / "tests.xml").write_text(
      '<testsuites><testsuite><testcase name="test_norm_kernel_matches_today[768-tokamax_triton]"/>'
      '<testcase name="test_attention_kernel_matches_today[shape0-tokamax_mosaic]">'
      '<failure message="x"/></testcase></testsuite></testsuites>')
  bad = kb.failed_settings(str(tmp_path / "tests.xml"))
  assert ("norm", "tokamax_triton") not in bad
  assert ("attention", "tokamax_mosaic") in bad and ("glu", "tokamax_mosaic") in bad
  assert kb.tests_line(str(tmp_path / "tests.xml")) == "1 passed, 1 failed, 0 skipped"


def test_a_truncated_xml_falls_back_to_the_log_and_a_teardown_error_counts(tmp_path):
  (tmp_path / "tests.log").write_text(LOG + f"\n{F}test_glu_kernel_matches_today"
                                      "[shape0-tokamax_mosaic] ERROR [ 40%]\n")
  (tmp_path / "tests.xml").write_text("<testsuites><testsuite><testcase name=")  # cut short
  junit = str(tmp_path / "tests.xml")
  assert ("glu", "tokamax_mosaic") in kb.failed_settings(junit)  # its last line: an error
  assert kb.tests_line(junit) == "4 passed, 2 failed, 1 skipped (from the log: pytest stopped)"


def test_nothing_readable_counts_every_setting_failed(tmp_path):
  bad = kb.failed_settings(str(tmp_path / "tests.xml"))
  assert ("attention", "tokamax_mosaic") in bad and ("norm", "tokamax_triton") in bad
  assert kb.tests_line(str(tmp_path / "tests.xml")) == "not run"
  assert kb.failed_settings(None) == set()
