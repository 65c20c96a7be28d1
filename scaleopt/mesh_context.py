"""The device mesh a step is traced under, shared by the model and the optimizer.

The trainer traces its step inside ``scaleopt.models.sharding.constraints(mesh)``, which sets
this context; the model reads it to pin its activations' layout, and optimizer code
(``scaleopt.optim``, which imports neither Flax nor the models) reads it to place per-block
work on the devices that hold the blocks. Outside such a context there is no mesh (None).
Standard library only: both sides may import it.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Optional

_MESH: contextvars.ContextVar[Optional[Any]] = contextvars.ContextVar("scaleopt_mesh",
                                                                      default=None)


@contextlib.contextmanager
def use(mesh) -> Iterator[None]:
  """Within this context (entered while tracing) ``current()`` is ``mesh`` (a
  ``jax.sharding.Mesh`` or None)."""
  token = _MESH.set(mesh)
  try:
    yield
  finally:
    _MESH.reset(token)


def current():
  """The mesh of the innermost ``use`` context, or None outside one."""
  return _MESH.get()
