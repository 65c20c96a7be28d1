"""Near-duplicate documents, and how much of a held-out split leaks into training.

A document's **lines** are its distinct lines with surrounding white space stripped, blank ones
left out, each hashed to 64 bits (blake2b): a sorted ``uint64`` array (``line_set``).

**Near-duplicates** (``groups``): two documents whose smaller line set shares at least
``threshold`` (default 0.8) of its lines with the other, ``|A & B| >= threshold min(|A|, |B|)``,
and whose Jaccard index ``|A & B| / |A | B|`` is at least ``jaccard`` (default 0.4): near-copies
of similar length (at the defaults, line counts within a factor 1.8; 2.5 when one holds the
other whole). A short document inside a much longer one is not grouped with it: that would
chain unrelated long documents through one boilerplate file into one group.

Candidate pairs come from MinHash signatures (``datasketch``, ``NUM_PERM`` permutations of the
64-bit line hashes) in a locality-sensitive-hashing index at Jaccard ``LSH_JACCARD`` (0.3: 37
bands of 3 rows, so a pair of Jaccard J is a candidate with probability 1 - (1 - J^3)^37, 0.91
at J = 0.4, 0.993 at 0.5, 1 - 4e-7 at 0.667); each candidate is then checked exactly on the
two line sets. Pairs join into groups (connected components, union-find); a group's
**representative** is its first document in input order, so a caller that puts a group on the
side of its representative keeps each group on one side of a split with the same probability
as a single document. Exact duplicates have equal line sets and always group.

**Leakage** (``leakage``), independent of the MinHash: the share of held-out bytes in documents
that share at least ``t`` of their lines with one training document, ``|A & B| >= t |A|``,
found exactly (candidates by a prefix filter on the rarest lines, then intersected), and the
share of held-out lines (per document) that occur in some training document.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Iterable, Optional, Sequence

import numpy as np

NUM_PERM = 128
LSH_JACCARD = 0.3  # the index's threshold: below JACCARD, so pairs near it are found
JACCARD = 0.4
THRESHOLD = 0.8
_EMPTY = np.zeros(0, np.uint64)


def line_set(text: str | bytes) -> np.ndarray:
  """The sorted distinct 64-bit hashes of a document's stripped, non-blank lines."""
  if isinstance(text, str):
    text = text.encode("utf-8", "surrogatepass")
  hs = {int.from_bytes(hashlib.blake2b(ln, digest_size=8).digest(), "little")
        for ln in (x.strip() for x in text.split(b"\n")) if ln}
  return np.array(sorted(hs), np.uint64) if hs else _EMPTY


def shared(a: np.ndarray, b: np.ndarray) -> int:
  """|a & b| of two sorted distinct arrays."""
  if a.size == 0 or b.size == 0:
    return 0
  return int(np.intersect1d(a, b, assume_unique=True).size)


class _UnionFind:
  def __init__(self, n: int):
    self.parent = np.arange(n)

  def find(self, i: int) -> int:
    root = i
    while self.parent[root] != root:
      root = self.parent[root]
    while self.parent[i] != root:  # path compression
      self.parent[i], i = root, self.parent[i]
    return int(root)

  def union(self, i: int, j: int) -> None:
    ri, rj = self.find(i), self.find(j)
    if ri != rj:  # the smaller index (earlier document) stays the root
      self.parent[max(ri, rj)] = min(ri, rj)


def _signatures(sets: Sequence[np.ndarray], num_perm: int, seed: int):
  from datasketch import MinHash
  proto = MinHash(num_perm=num_perm, seed=seed, scheme="affine64", hashfunc=int)
  for s in sets:
    m = MinHash(num_perm=num_perm, seed=seed, scheme="affine64", hashfunc=int,
                permutations=proto.permutations)
    if s.size:
      m.update_batch(s.tolist())
    yield m


def candidate_pairs(sets: Sequence[np.ndarray], lsh_jaccard: float = LSH_JACCARD,
                    num_perm: int = NUM_PERM, seed: int = 1) -> set[tuple[int, int]]:
  """Pairs (i < j) of documents whose MinHash signatures collide in an LSH index built for
  Jaccard similarity ``lsh_jaccard`` (empty documents take no part)."""
  from datasketch import MinHashLSH
  lsh = MinHashLSH(threshold=lsh_jaccard, num_perm=num_perm)
  sigs = {}
  for i, m in enumerate(_signatures(sets, num_perm, seed)):
    if sets[i].size:
      sigs[i] = m
      lsh.insert(i, m, check_duplication=False)
  pairs = set()
  for i, m in sigs.items():
    pairs.update((min(i, j), max(i, j)) for j in lsh.query(m) if j != i)
  return pairs


@dataclasses.dataclass(frozen=True)
class Groups:
  """``rep[i]``: the representative (first member) of document i's group; ``pairs``: the
  candidate pairs checked, ``joined``: those that passed."""
  rep: np.ndarray
  pairs: int
  joined: int

  def sizes(self) -> np.ndarray:
    return np.bincount(self.rep, minlength=self.rep.size)

  def summary(self) -> dict:
    size = self.sizes()
    return {"documents": int(self.rep.size), "groups": int((size > 0).sum()),
            "grouped_documents": int(size[size > 1].sum()), "largest_group": int(size.max(
                initial=0)), "candidate_pairs": self.pairs, "joined_pairs": self.joined}


def groups(sets: Sequence[np.ndarray], threshold: float = THRESHOLD,
           jaccard: float = JACCARD, num_perm: int = NUM_PERM,
           pairs: Optional[set] = None) -> Groups:
  """Near-duplicate groups of documents ``sets`` (``line_set`` each), in input order: the
  pairs with ``|A & B| >= threshold min(|A|, |B|)`` and Jaccard ``>= jaccard``, among the
  candidates of an LSH index at ``LSH_JACCARD`` (or the given ``pairs``)."""
  uf = _UnionFind(len(sets))
  pairs = candidate_pairs(sets, LSH_JACCARD, num_perm) if pairs is None else pairs
  joined = 0
  for i, j in sorted(pairs):
    a, b = sets[i], sets[j]
    both = shared(a, b)
    if both >= threshold * min(a.size, b.size) and both >= jaccard * (a.size + b.size - both):
      uf.union(i, j)
      joined += 1
  rep = np.array([uf.find(i) for i in range(len(sets))], np.int64)
  return Groups(rep, len(pairs), joined)


# ---------------------------------------------------------------------------------------------
# Leakage of a split.


def _postings(sets: Sequence[np.ndarray], docs: Iterable[int]):
  """(sorted line hashes, their documents): every (line, document) pair of ``docs``."""
  docs = list(docs)
  lines = np.concatenate([sets[d] for d in docs] or [_EMPTY])
  owner = np.concatenate([np.full(sets[d].size, d, np.int64) for d in docs] or
                         [np.zeros(0, np.int64)])
  order = np.argsort(lines, kind="stable")
  return lines[order], owner[order]


def contained_in_training(sets: Sequence[np.ndarray], heldout: Sequence[bool],
                          threshold: float) -> np.ndarray:
  """For each held-out document A (others: False): some training document B has
  ``|A & B| >= threshold |A|``. Exact: B must hold one of A's ``|A| - ceil(threshold |A|) + 1``
  rarest lines (else A would miss too many), so only those lines' documents are intersected."""
  train = [i for i, h in enumerate(heldout) if not h]
  lines, owner = _postings(sets, train)
  out = np.zeros(len(sets), bool)
  for i in (i for i, h in enumerate(heldout) if h):
    a = sets[i]
    if a.size == 0:
      continue
    need = int(np.ceil(threshold * a.size - 1e-9))
    lo, hi = np.searchsorted(lines, a, "left"), np.searchsorted(lines, a, "right")
    prefix = np.argsort(hi - lo, kind="stable")[:a.size - need + 1]
    cands = np.unique(np.concatenate([owner[lo[k]:hi[k]] for k in prefix]))
    out[i] = any(shared(a, sets[b]) >= need for b in cands)
  return out


def leakage(sets: Sequence[np.ndarray], nbytes: Sequence[int], heldout: Sequence[bool],
            thresholds: Sequence[float] = (0.8, 0.5)) -> dict:
  """Per threshold t: the share of held-out bytes in documents sharing >= t of their lines
  with one training document; ``lines_in_training``: the share of held-out lines (distinct per
  document) that occur in some training document; ``heldout_documents`` / ``heldout_bytes``."""
  held = np.asarray(heldout, bool)
  nb = np.asarray(nbytes, np.float64)
  total = float(nb[held].sum())
  out: dict = {"heldout_documents": int(held.sum()), "heldout_bytes": int(total)}
  for t in thresholds:
    leaked = contained_in_training(sets, held, t)
    out[f"bytes_at_{t:g}"] = float(nb[leaked].sum()) / total if total else 0.0
  train_lines = np.unique(np.concatenate([sets[i] for i in np.nonzero(~held)[0]] or [_EMPTY]))
  held_lines = [sets[i] for i in np.nonzero(held)[0]]
  n = sum(s.size for s in held_lines)
  hit = sum(int(np.isin(s, train_lines, assume_unique=True).sum()) for s in held_lines)
  out["lines_in_training"] = hit / n if n else 0.0
  return out


def split_by_group(digests: Sequence[int], rep: np.ndarray, fraction: float) -> np.ndarray:
  """Held out per document: its group representative's 64-bit key digest below
  ``fraction * 2**64`` (``prepare.is_heldout``'s rule, applied to the representative)."""
  d = np.asarray(digests, dtype=object)
  return np.array([int(d[r]) < fraction * 2.0 ** 64 for r in rep], bool)


def key_digest(key: bytes) -> int:
  """The 64-bit value ``prepare.is_heldout`` compares (blake2b, big-endian)."""
  return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


def summarize(sets: Sequence[np.ndarray], nbytes: Sequence[int], digests: Sequence[int],
              fraction: float, rep: Optional[np.ndarray] = None) -> dict:
  """``leakage`` of the split that ``prepare`` makes: each document on the side of its key
  digest, or (``rep``) of its group representative's."""
  rep = np.arange(len(sets)) if rep is None else rep
  return leakage(sets, nbytes, split_by_group(digests, rep, fraction))


# ---------------------------------------------------------------------------------------------
# Documents of a split: what ``scaleopt data prepare --dedup`` reads first.


@dataclasses.dataclass
class Documents:
  """The documents of a stream of pieces, in order of first appearance: each one's key digest
  (``key_digest``), ``line_set`` (over all its pieces) and bytes (all its pieces, repeats of a
  duplicated record included)."""
  digests: list
  sets: list
  nbytes: list

  @classmethod
  def read(cls, pieces: Iterable[tuple[bytes, bytes]]) -> "Documents":
    """From (key, text) pieces; pieces of one key (of one key digest) are one document."""
    index: dict = {}
    digests, parts, nbytes = [], [], []
    for key, text in pieces:
      d = key_digest(key)
      i = index.get(d)
      if i is None:
        i = index[d] = len(digests)
        digests.append(d)
        parts.append([])
        nbytes.append(0)
      parts[i].append(line_set(text))
      nbytes[i] += len(text)
    sets = [p[0] if len(p) == 1 else np.unique(np.concatenate(p)) for p in parts]
    return cls(digests, sets, nbytes)


def heldout_by_digest(docs: Documents, rep: np.ndarray, fraction: float) -> dict:
  """key digest -> held out, each document on its group representative's side."""
  held = split_by_group(docs.digests, rep, fraction)
  return dict(zip(docs.digests, held.tolist()))
