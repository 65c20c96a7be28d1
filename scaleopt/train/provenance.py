"""What produced a run: the ``provenance`` entry of ``summary.json`` and of each study cell.

  {"commit": "40 hex" or null, "dirty": bool or null,   the source tree of the scaleopt imported
   "scaleopt": "0.x",                                   (null outside a git checkout)
   "corpus": {"source", "path", "content_sha256", "manifest_sha256", "tokenizer_sha256"},
   "versions": {"python", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy"},
   "xla_flags": "the XLA_FLAGS of the process", "deterministic": bool,
   "platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3", "devices": 8, "processes": 1,
   "jax_config": {"jax_default_matmul_precision", "jax_enable_x64", "jax_threefry_partitionable"}}

``corpus.content_sha256`` is one hash of the data a run saw: the hashes of every training and
held-out shard (or a URL's file keys) and of the tokenizer, from the run's data record
(``train.identity``, ``data.json``). ``manifest_sha256`` hashes the corpus folder's
``manifest.json`` (written by ``scaleopt data prepare``) when there is one. A study report
refuses cells whose ``content_sha256`` differ.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import pathlib
import subprocess
import sys
from typing import Optional

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy")
JAX_CONFIG = ("jax_default_matmul_precision", "jax_enable_x64", "jax_threefry_partitionable")
_SOURCE = pathlib.Path(__file__).resolve().parents[2]  # the folder above the package


def _git(*args: str) -> Optional[str]:
  try:
    out = subprocess.run(["git", "-C", str(_SOURCE), *args], capture_output=True, text=True,
                         timeout=20, check=True)
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout


def source_state(environ=os.environ) -> dict:
  """``{"commit", "dirty"}``: ``SCALEOPT_COMMIT`` and ``SCALEOPT_DIRTY`` (``1``/``0``) when the
  launcher sets the commit (a copied tree, whose ``.git``, if any, may be older than its
  files); else the git checkout holding the imported scaleopt (dirty: a tracked file differs
  from the commit); else (an installed wheel) None."""
  if environ.get("SCALEOPT_COMMIT") or not (_SOURCE / ".git").exists():
    dirty = environ.get("SCALEOPT_DIRTY")
    return {"commit": environ.get("SCALEOPT_COMMIT") or None,
            "dirty": None if dirty is None else dirty == "1"}
  head = _git("rev-parse", "HEAD")
  status = _git("status", "--porcelain", "--untracked-files=no")
  return {"commit": head.strip() if head else None,
          "dirty": None if status is None else bool(status.strip())}


def versions() -> dict:
  out = {"python": sys.version.split()[0]}
  for p in PACKAGES:
    try:
      out[p] = importlib.metadata.version(p)
    except importlib.metadata.PackageNotFoundError:
      out[p] = None
  return out


def corpus(record: Optional[dict]) -> dict:
  """The corpus entry from a run's data record (``train.identity.describe``)."""
  if not record:
    return {"source": None, "path": None, "content_sha256": None, "manifest_sha256": None,
            "tokenizer_sha256": None}
  h = hashlib.sha256()
  for split in ("train", "val"):
    for e in record.get("splits", {}).get(split, []):
      h.update(f"{split}|{e['file']}|{e['bytes']}|{e.get('sha256') or e.get('ukey')}\n"
               .encode())
  tok = record.get("tokenizer") or {}
  h.update(f"tokenizer|{tok.get('name')}|{tok.get('sha256')}|{tok.get('separator')}".encode())
  manifest = None
  path = record.get("path")
  if record.get("source") == "shards" and path and "://" not in path:
    m = pathlib.Path(path) / "manifest.json"
    if m.is_file():
      manifest = hashlib.sha256(m.read_bytes()).hexdigest()
  return {"source": record.get("source"), "path": path, "content_sha256": h.hexdigest(),
          "manifest_sha256": manifest, "tokenizer_sha256": tok.get("sha256")}


def devices() -> dict:
  import jax
  d = jax.devices()[0]
  return {"platform": d.platform, "device_kind": d.device_kind, "devices": jax.device_count(),
          "processes": jax.process_count()}


def jax_config() -> dict:
  import jax
  out = {}
  for k in JAX_CONFIG:
    try:
      v = getattr(jax.config, k)
    except AttributeError:
      v = None
    out[k] = v if v is None or isinstance(v, (bool, int, float)) else str(v)
  return out


def collect(deterministic: bool, record: Optional[dict]) -> dict:
  """The provenance of a run in this process (module docstring); ``record``: its data record."""
  from scaleopt import __version__
  return {**source_state(), "scaleopt": __version__, "corpus": corpus(record),
          "versions": versions(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "deterministic": bool(deterministic), **devices(), "jax_config": jax_config()}


def corpus_key(prov: Optional[dict]) -> Optional[str]:
  """The corpus a cell was trained on (its ``content_sha256``); None when not recorded."""
  return ((prov or {}).get("corpus") or {}).get("content_sha256")


def describe_sources(provs: list) -> str:
  """One line: the commits (dirty marked) and cards that a list of provenance entries name,
  e.g. ``commits 1a2b3c4d5e6f (3 cells), 9f8e7d6c5b4a+dirty (1); cards NVIDIA H100 (4)``."""
  def count(keys):
    seen: dict = {}
    for k in keys:
      seen[k] = seen.get(k, 0) + 1
    return ", ".join(f"{k} ({n})" for k, n in seen.items())
  commits, cards = [], []
  for p in provs:
    p = p or {}
    c = p.get("commit")
    commits.append("not recorded" if c is None else c[:12] + ("+dirty" if p.get("dirty") else ""))
    kind = p.get("device_kind")
    cards.append("not recorded" if kind is None else f"{p.get('devices', 1)}x {kind}")
  return f"commits {count(commits)}; cards {count(cards)}"


def run_entry(cfg, record: Optional[dict], state) -> dict:
  """A run's summary entries: ``provenance`` (``collect``) and, for a deterministic run whose
  state this process holds whole, ``state_sha256``: the digest of its final train state
  (parameters, optimizer state, step, key), equal across bitwise-equal runs."""
  out = {"provenance": collect(cfg.run.deterministic, record)}
  if cfg.run.deterministic:
    import jax

    from scaleopt.train import determinism
    whole = all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(state))
    out["state_sha256"] = determinism.state_digest(state) if whole else None
  return out
