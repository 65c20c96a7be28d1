"""Orbax checkpoints: every N steps, keep the last K, asynchronous, atomic.

A checkpoint ``RUN_DIR/checkpoints/<step>/`` holds two items: ``state`` (the whole
``TrainState``: step, float32 params, optimizer state, RNG, skip counters) and ``data`` (the
iterator position, JSON). Orbax writes to a temporary directory and renames it when complete,
so a run killed mid-save resumes from the previous complete checkpoint.
"""

from __future__ import annotations

import pathlib
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp


class Checkpointer:

  def __init__(self, directory: pathlib.Path, keep: int, use_async: bool = True):
    self.dir = pathlib.Path(directory).absolute()
    opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                        enable_async_checkpointing=use_async)
    self.mngr = ocp.CheckpointManager(self.dir, options=opts)

  def latest_step(self) -> Optional[int]:
    return self.mngr.latest_step()

  def save(self, step: int, state: Any, data_state: dict) -> None:
    """Starts saving (returns once the state is copied off the devices when async)."""
    if step in self.mngr.all_steps():
      return
    self.mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                 data=ocp.args.JsonSave(data_state)),
                   force=True)

  def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
    """(state, data_state); ``abstract_state`` is a tree of ShapeDtypeStruct with shardings."""
    out = self.mngr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    return out["state"], out["data"]

  def wait(self) -> None:
    self.mngr.wait_until_finished()

  def close(self) -> None:
    self.mngr.wait_until_finished()
    self.mngr.close()


def abstract(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)
