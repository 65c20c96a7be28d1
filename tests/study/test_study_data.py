"""The held-out split's val (selection) and test (reporting) parts are disjoint halves."""

import numpy as np
import pytest

from scaleopt.train import data as D


def test_heldout_parts_are_disjoint_halves_of_the_heldout_windows():
  full = D.Windows([np.arange(1000, dtype=np.uint16)], seq_len=9)  # 111 windows
  val, test = D.heldout_part(full, "val"), D.heldout_part(full, "test")
  assert (val.n, test.n) == (55, 56)
  got = np.concatenate([val.get(np.arange(val.n)), test.get(np.arange(test.n))])
  np.testing.assert_array_equal(got, full.get(np.arange(full.n)))  # every window once, in order
  first = {int(w[0]) for w in val.get(np.arange(val.n))}
  assert not first & {int(w[0]) for w in test.get(np.arange(test.n))}
  # an eval set larger than a part wraps inside that part, never into the other one
  ev = D.eval_batches(val, batch_size=40, num=2)
  assert {int(w[0]) for b in ev for w in b} <= first
  with pytest.raises(ValueError, match="allowed"):
    D.heldout_part(full, "train")


def test_embedded_heldout_parts_cover_the_heldout_split():
  ho, _ = D.open_split("embedded", None, "val", 64)
  val, test = D.heldout_part(ho, "val"), D.heldout_part(ho, "test")
  assert val.n + test.n == ho.n and min(val.n, test.n) > 100
  np.testing.assert_array_equal(test.get(np.array([0])), ho.get(np.array([val.n])))
