"""The held-out split's val (selection) and test (reporting) parts: split by document."""

import numpy as np
import pytest

from scaleopt.config import ConfigError
from scaleopt.study import report
from scaleopt.train import data as D


def _docs(lengths, sep=0):
  """Documents of distinct non-zero tokens (document k's tokens are 1000 k + position + 1),
  each ended by ``sep``."""
  return [np.append(1000 * k + 1 + np.arange(n - 1), sep).astype(np.uint32)
          for k, n in enumerate(lengths)]


def test_heldout_parts_split_by_document_no_window_in_both():
  docs = _docs([50, 31, 77, 12, 64, 40, 9])
  # two shards: documents 0-2 and 3-6 (numbering continues across shards)
  full = D.Windows([np.concatenate(docs[:3]), np.concatenate(docs[3:])], seq_len=9, sep=0)
  val, test = D.heldout_part(full, "val"), D.heldout_part(full, "test")
  owner = lambda w: {int(t) // 1000 for t in w if t}  # the documents a window reads
  val_docs = set().union(*(owner(w) for w in val.get(np.arange(val.n))))
  test_docs = set().union(*(owner(w) for w in test.get(np.arange(test.n))))
  assert val_docs == {0, 2, 4, 6} and test_docs == {1, 3, 5}
  # each part's windows are its documents' tokens, in order, cut every seq_len
  for part, ks in ((val, [0, 2, 4, 6]), (test, [1, 3, 5])):
    shard0 = np.concatenate([docs[k] for k in ks if k < 3])
    np.testing.assert_array_equal(part.get(np.array([0]))[0], shard0[:10])
  with pytest.raises(ValueError, match="allowed"):
    D.heldout_part(full, "train")


def test_a_heldout_split_of_one_document_cannot_be_cut():
  one = D.Windows([_docs([200])[0]], seq_len=9, sep=0)
  assert D.heldout_part(one, "val").n == 22
  with pytest.raises(D.DataError, match="test part .* needs more held-out documents"):
    D.heldout_part(one, "test")


def test_embedded_heldout_parts_hold_each_document_once():
  ho, _ = D.open_split("embedded", None, "val", 64)
  val, test = D.heldout_part(ho, "val"), D.heldout_part(ho, "test")
  assert min(val.n, test.n) > 100 and val.n + test.n <= ho.n
  tokens = lambda w: np.asarray(w.arrays[0])
  assert tokens(val).size + tokens(test).size == tokens(ho).size
  np.testing.assert_array_equal(np.sort(np.concatenate([tokens(val), tokens(test)])),
                                np.sort(tokens(ho)))
  ends = lambda w: int((tokens(w) == D.SEP).sum())
  assert ends(val) + ends(test) == ends(ho) and abs(ends(val) - ends(test)) <= 1
  sets = D.heldout_eval_sets(ho, 64 * 10**6)  # more than either part: each part whole
  assert (sets["val"].n, sets["test"].n) == (val.n, test.n)


def test_report_refuses_cells_scored_on_different_sets():
  rows = [{"id": "a/x", "val_set": "v1", "test_set": "t1"},
          {"id": "b/x", "val_set": "v1", "test_set": "t1"}]
  report.check_eval_sets(rows)
  report.check_eval_sets([{"id": "old"}, {"id": "older"}])  # none recorded: nothing to compare
  rows[1]["test_set"] = "t2"
  with pytest.raises(ConfigError, match="cells a/x and b/x .* different test sets"):
    report.check_eval_sets(rows)
