"""Near-duplicate groups and the leakage measure (scaleopt.train.dedup) against brute force over
every pair of documents with Python sets, on corpora built here: planted near-copies (a share
of lines changed), exact copies, short documents inside long ones, unrelated documents."""

import hashlib
import itertools
import math

import numpy as np
import pytest

from scaleopt.train import dedup as D

pytest.importorskip("datasketch")


def _lines(text: str) -> set:
  return {ln.strip() for ln in text.split("\n") if ln.strip()}


def _doc(rng, n, tag):
  return "\n".join(f"    {tag}_{rng.integers(1 << 40)} = f({k})  " for k in range(n)) + "\n"


def _edit(rng, text, share, tag):
  """A near-copy: ``share`` of the lines replaced by new ones, a few blank lines added."""
  lines = text.splitlines()
  for k in rng.choice(len(lines), int(round(share * len(lines))), replace=False):
    lines[k] = f"{tag}_{rng.integers(1 << 40)} = 0"
  return "\n\n".join(lines[:3]) + "\n" + "\n".join(lines[3:]) + "\n"


def _corpus(seed=0, families=40, excerpts=10):
  """Families of near-copies (2-4 members, 0-10% of lines changed, one exact copy each fifth
  family), plus unrelated documents and short excerpts (90% of a family's first lines inside a
  document four times longer). Returns texts and the planted family of each (-1: none)."""
  rng = np.random.default_rng(seed)
  texts, family = [], []
  for f in range(families):
    base = _doc(rng, int(rng.integers(20, 120)), f"f{f}")
    members = [base] + [_edit(rng, base, rng.uniform(0, 0.1), f"e{f}_{m}")
                        for m in range(int(rng.integers(1, 4)))]
    if f % 5 == 0:
      members.append(base)
    texts += members
    family += [f] * len(members)
  for u in range(60):
    texts.append(_doc(rng, int(rng.integers(5, 80)), f"u{u}"))
    family.append(-1)
  for x in range(excerpts):  # a short excerpt of a long document: not a near-copy of it
    long = _doc(rng, 200, f"L{x}")
    texts += [long, "\n".join(long.splitlines()[:45] + [f"x{x}_{k}" for k in range(5)])]
    family += [-1, -1]
  order = rng.permutation(len(texts))
  return [texts[i] for i in order], [family[i] for i in order]


def test_line_set_hashes_stripped_distinct_non_blank_lines():
  text = "a = 1\n  a = 1  \n\n\t\nb\r\n" + "c" * 3
  want = sorted(int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")
                for s in ("a = 1", "b", "ccc"))
  got = D.line_set(text)
  assert got.dtype == np.uint64 and got.tolist() == want
  assert D.line_set(text.encode()).tolist() == want and D.line_set("\n \n").size == 0


def _brute_groups(texts, threshold, jaccard):
  """Connected components of the pairs whose smaller line set shares >= threshold of its lines
  and whose Jaccard index is >= jaccard, over every pair (no MinHash); each document's first
  member in input order."""
  sets = [_lines(t) for t in texts]
  parent = list(range(len(texts)))

  def find(i):
    while parent[i] != i:
      i = parent[i]
    return i
  for i, j in itertools.combinations(range(len(texts)), 2):
    a, b = sets[i], sets[j]
    if a and b and len(a & b) >= threshold * min(len(a), len(b)) and (
        len(a & b) >= jaccard * len(a | b)):
      ri, rj = find(i), find(j)
      parent[max(ri, rj)] = min(ri, rj)
  return [find(i) for i in range(len(texts))], sets


def test_groups_match_brute_force_and_the_planted_families():
  texts, family = _corpus()
  brute, sets = _brute_groups(texts, D.THRESHOLD, D.JACCARD)
  g = D.groups([D.line_set(t) for t in texts])
  assert g.rep.tolist() == brute  # every near-duplicate pair found, nothing else joined
  for f in set(family) - {-1}:  # each planted family is one group, led by its first member
    idx = [i for i, x in enumerate(family) if x == f]
    assert {int(g.rep[i]) for i in idx} == {min(idx)}
  # unrelated documents and the short excerpts stay alone (the excerpts share 90% of their
  # lines with a document four times longer: Jaccard 0.22, not a near-copy)
  alone = [i for i, x in enumerate(family) if x == -1]
  assert all(g.rep[i] == i and (g.sizes()[i] == 1) for i in alone)
  s = g.summary()
  assert s["grouped_documents"] == sum(1 for x in family if x != -1)
  assert s["joined_pairs"] <= s["candidate_pairs"]


def _brute_leak(sets, heldout, t):
  train = [sets[i] for i, h in enumerate(heldout) if not h]
  return [bool(h and sets[i] and any(len(sets[i] & b) >= t * len(sets[i]) for b in train))
          for i, h in enumerate(heldout)]


@pytest.mark.parametrize("t", [0.8, 0.5, 1.0])
def test_contained_in_training_matches_brute_force(t):
  texts, _ = _corpus(seed=1, families=25)
  rng = np.random.default_rng(2)
  heldout = list(rng.random(len(texts)) < 0.3)
  sets = [_lines(x) for x in texts]
  got = D.contained_in_training([D.line_set(x) for x in texts], heldout, t)
  want = _brute_leak(sets, heldout, t)
  assert got.tolist() == want and sum(want) > 0


def test_leakage_bytes_and_lines_against_brute_force():
  texts, _ = _corpus(seed=3, families=25)
  rng = np.random.default_rng(4)
  heldout = list(rng.random(len(texts)) < 0.3)
  sets = [_lines(x) for x in texts]
  nbytes = [len(x.encode()) for x in texts]
  got = D.leakage([D.line_set(x) for x in texts], nbytes, heldout)
  total = sum(b for b, h in zip(nbytes, heldout) if h)
  for t in (0.8, 0.5):
    leak = _brute_leak(sets, heldout, t)
    assert got[f"bytes_at_{t:g}"] == pytest.approx(
        sum(b for b, x in zip(nbytes, leak) if x) / total, rel=1e-12)
  train_lines = set().union(*(s for s, h in zip(sets, heldout) if not h))
  held = [s for s, h in zip(sets, heldout) if h]
  assert got["lines_in_training"] == pytest.approx(
      sum(len(s & train_lines) for s in held) / sum(map(len, held)), rel=1e-12)
  assert got["heldout_bytes"] == total


def test_split_by_group_keeps_near_copies_together_and_removes_the_leak():
  """prepare's rule on each document's key digest leaks near-copies; on the group
  representative's digest nothing at >= 80% leaks, and a group is held out as often as a
  document (its first member's digest: no bias towards large groups)."""
  texts, family = _corpus(seed=5, families=60, excerpts=0)
  sets = [D.line_set(t) for t in texts]
  nbytes = [len(t.encode()) for t in texts]
  digests = [D.key_digest(t.encode()) for t in texts]
  for f, d in zip((0.3, 0.05), (digests, digests)):
    before = D.summarize(sets, nbytes, d, f)
    g = D.groups(sets)
    after = D.summarize(sets, nbytes, d, f, g.rep)
    held = D.split_by_group(d, g.rep, f)
    for fam in set(family) - {-1}:
      assert len({held[i] for i, x in enumerate(family) if x == fam}) == 1
    if f == 0.3:
      assert before["bytes_at_0.8"] > 0.2
    assert after["bytes_at_0.8"] == 0.0
  # a short excerpt inside a long training document is no near-copy: it still leaks
  texts, _ = _corpus(seed=5, families=0, excerpts=40)
  sets = [D.line_set(t) for t in texts]
  digests = [D.key_digest(t.encode()) for t in texts]
  rep = D.groups(sets).rep
  assert (rep == np.arange(len(texts))).all()
  assert D.summarize(sets, [1] * len(texts), digests, 0.3, rep)["bytes_at_0.8"] > 0
  # the representative's digest is uniform: over many groups, the held-out share is f
  digest = [D.key_digest(str(i).encode()) for i in range(40000)]
  rep = np.repeat(np.arange(0, 40000, 4), 4)  # groups of four, led by their first member
  share = D.split_by_group(digest, rep, 0.1)[::4].mean()
  assert abs(share - 0.1) < 3 * math.sqrt(0.1 * 0.9 / 10000)


def test_group_and_leak_thresholds_at_their_boundaries():
  """Exactly 80% of the smaller's lines shared joins, 78% does not; Jaccard exactly 0.4 joins,
  40/101 does not (the exact check, on every pair); a held-out document sharing exactly 80% of
  its lines leaks even when its other lines are the rarest (the prefix filter's length)."""
  def doc(tag, n):
    return [f"{tag} line {k}" for k in range(n)]
  base = doc("base", 50)
  other = doc("other", 50)
  long40 = doc("sub", 40)
  texts = ["\n".join(x) for x in (
      base, base[:40] + doc("new1", 10),  # 40 of 50 shared: joined
      other, other[:39] + doc("new2", 11),  # 39 of 50: not joined
      long40, long40 + doc("more", 60),  # 40 of 40, Jaccard 40/100: joined
      doc("sub2", 40), doc("sub2", 40) + doc("more2", 61))]  # Jaccard 40/101: not joined
  sets = [D.line_set(t) for t in texts]
  every = set(itertools.combinations(range(len(texts)), 2))
  g = D.groups(sets, threshold=0.8, jaccard=0.4, pairs=every)
  assert g.rep.tolist() == [0, 0, 2, 3, 4, 4, 6, 7]
  assert D.groups(sets, threshold=0.8, jaccard=0.4).rep.tolist()[:4] == [0, 0, 2, 3]  # LSH
  assert D.contained_in_training(sets[:4], [False, True, False, True], 0.8).tolist() == [
      False, True, False, False]


# ---------------------------------------------------------------------------------------------
# scaleopt data prepare --dedup, end to end: the leak measured on the shards it writes.


def _shard_docs(out, split):
  """The documents of a split, decoded from its byte-token shards (separator 0)."""
  from scaleopt.train import data
  arrays, _ = data.load_shards(out, split)
  raw = b"".join(bytes(np.asarray(a, np.uint8)) for a in arrays)
  return [d.decode() for d in raw.split(b"\0") if d]


def _prepare(src, out, *extra):
  from scaleopt import cli
  return cli.main(["data", "prepare", "--input", str(src), "--out", str(out), "--tokenizer",
                   "bytes", "--val-fraction", "0.3", "--quiet", *extra])


def test_data_prepare_dedup_keeps_near_copies_on_one_side(tmp_path):
  import json
  texts, family = _corpus(seed=7, families=30, excerpts=0)
  src = tmp_path / "src"
  src.mkdir()
  for i, t in enumerate(texts):  # a folder of files: the key is the path, not the text
    (src / f"doc{i:03d}.py").write_text(t)
  leak, manifests = {}, {}
  for name, extra in (("plain", ()), ("dedup", ("--dedup",))):
    out = tmp_path / name
    assert _prepare(src, out, *extra) == 0
    manifests[name] = json.loads((out / "manifest.json").read_text())
    val, train = _shard_docs(out, "val"), _shard_docs(out, "train")
    assert sorted(val + train) == sorted(texts)  # every document once, whole
    train_sets = [_lines(t) for t in train]
    leaked = [t for t in val if any(len(_lines(t) & b) >= 0.8 * len(_lines(t))
                                    for b in train_sets)]
    leak[name] = sum(len(t.encode()) for t in leaked) / sum(len(t.encode()) for t in val)
  assert leak["plain"] > 0.1 and leak["dedup"] == 0.0, leak
  rec = manifests["dedup"]["dedup"]
  assert rec["threshold"] == 0.8 and rec["grouped_documents"] == sum(x != -1 for x in family)
  assert "dedup" not in manifests["plain"]
  assert manifests["dedup"]["content_hash"] != manifests["plain"]["content_hash"]


@pytest.mark.parametrize("flag", ["0", "1.5"])
def test_data_prepare_bad_dedup_share_is_one_line(tmp_path, capsys, flag):
  src = tmp_path / "src"
  src.mkdir()
  (src / "a.txt").write_text("x\n")
  (src / "b.txt").write_text("y\n")
  assert _prepare(src, tmp_path / "out", "--dedup", flag) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "--dedup" in err[0] and not (tmp_path / "out").exists()


def test_data_prepare_dedup_refuses_a_lone_text_file(tmp_path, capsys):
  (tmp_path / "a.txt").write_text("x\n" * 10)
  assert _prepare(tmp_path / "a.txt", tmp_path / "out", "--dedup") == 2
  assert "one text file" in capsys.readouterr().err


def test_offline_corpus_recipe_passes_dedup(tmp_path):
  import json
  import subprocess
  import sys
  root = __import__("pathlib").Path(__file__).resolve().parents[2]
  texts, _ = _corpus(seed=9, families=12, excerpts=0)
  src = tmp_path / "site"
  src.mkdir()
  for i, t in enumerate(texts):
    (src / f"m{i:03d}.py").write_text(t)
  r = subprocess.run(
      [sys.executable, str(root / "scripts" / "offline_corpus.py"), "--out", str(tmp_path / "c"),
       "--roots", str(src), "--vocab", "300", "--bpe-sample-mb", "0.05", "--val-fraction", "0.3",
       "--min-tokens", "1000", "--min-vocab", "256", "--work", str(tmp_path), "--dedup", "0.9"],
      capture_output=True, text=True, timeout=300, env={**__import__("os").environ,
                                                        "PYTHONPATH": str(root)})
  assert r.returncode == 0, r.stderr
  rec = json.loads((tmp_path / "c" / "manifest.json").read_text())["dedup"]
  assert rec["threshold"] == 0.9 and rec["documents"] == len(set(texts))  # exact copies: once


def test_leakage_script_prints_both_splits(tmp_path, capsys):
  import importlib.util
  import pathlib
  root = pathlib.Path(__file__).resolve().parents[2]
  spec = importlib.util.spec_from_file_location("dedup_leakage",
                                                root / "scripts" / "dedup_leakage.py")
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  texts, _ = _corpus(seed=11, families=20, excerpts=0)
  for i, t in enumerate(texts):
    (tmp_path / f"d{i:03d}.py").write_text(t)
  assert script.main(["--input", str(tmp_path), "--val-fraction", "0.3"]) == 0
  rows = [ln.split("|") for ln in capsys.readouterr().out.splitlines() if ln.startswith(
      f"| {tmp_path} |")]
  sets = [D.line_set(t) for t in texts]  # the keys of a folder's files are their paths
  digests = [D.key_digest(f"d{i:03d}.py".encode()) for i in range(len(texts))]
  want = [D.summarize(sets, [len(t.encode()) for t in texts], digests, 0.3, rep)
          for rep in (None, D.groups(sets).rep)]
  assert len(rows) == 2 and want[0]["bytes_at_0.8"] > 0 and want[1]["bytes_at_0.8"] == 0
  for row, w in zip(rows, want):
    assert row[5].strip() == f"{100 * w['bytes_at_0.8']:.2f}%"
    assert row[6].strip() == f"{100 * w['bytes_at_0.5']:.2f}%"
