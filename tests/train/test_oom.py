"""Out of device memory at compile time or in the first step: one line, exit 2."""

import jax
import pytest
import yaml

from scaleopt import cli
from scaleopt.train import config as C, faults, phased

from train_helpers import tiny_raw

GPU = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 158329135104 bytes.\n"
       "BufferAssignment OOM Debugging.\n...")
TPU = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space "
       "hbm. Used 20.53G of 15.48G hbm. Exceeded hbm capacity by 5.05G.")


def test_out_of_memory_message_names_bytes_limit_and_knobs(monkeypatch):
  cfg = C.from_dict(tiny_raw(run={"eval_tokens": 4096}, model={"remat": "dots"}))
  monkeypatch.setattr(faults, "pool_bytes", lambda: 80 * 2**30)
  msg = str(faults.out_of_memory(jax.errors.JaxRuntimeError(GPU), cfg))
  assert "\n" not in msg
  for words in ("asked for 147.46 GiB", "limit is 80.00 GiB", "data.microbatches (now 2",
                "model.remat (now 'dots'", "mesh.fsdp (now 1", "run.eval_tokens (now 4096"):
    assert words in msg, (words, msg)
  msg = str(faults.out_of_memory(RuntimeError(TPU), cfg))  # the limit from the message
  assert "asked for 20.53 GiB" in msg and "limit is 15.48 GiB" in msg
  assert faults.out_of_memory(ValueError("shapes do not match"), cfg) is None


def test_first_step_out_of_memory_is_one_line_exit_2(monkeypatch, capsys, tmp_path):
  def stepper(*_):
    def step(state, batch):
      raise jax.errors.JaxRuntimeError(GPU)
    return phased.OneProgram(step)

  monkeypatch.setattr(phased, "make_stepper", stepper)  # the compiled step runs out of memory
  cfg = tmp_path / "c.yaml"
  cfg.write_text(yaml.safe_dump(tiny_raw(run={"checkpoint_every": 0})))
  rc = cli.main(["train", "--config", str(cfg), "--out", str(tmp_path / "run")])
  err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
  assert rc == 2 and len(err) == 1 and err[0].startswith("error: out of device memory"), err
  assert "147.46 GiB" in err[0] and "data.microbatches" in err[0]
