"""Provenance of a run: the source commit, the corpus hash, versions, flags, devices."""

import hashlib
import json
import subprocess

import numpy as np
import pytest

from scaleopt.train import data as D, identity, provenance


def _shards(d, seed, manifest=True):
  rng = np.random.default_rng(seed)
  d.mkdir(parents=True, exist_ok=True)
  for split, n in (("train", 3000), ("val", 1000)):
    toks = rng.integers(1, 256, n)
    toks[::50] = 0
    D.write_shard(d / f"{split}_000", toks, 256, "bytes", separator=0)
  if manifest:
    (d / "manifest.json").write_text(json.dumps({"content_hash": str(seed)}))


def _record(p):
  cfg = type("C", (), {"data": type("D", (), {"source": "shards", "path": str(p)})})
  return identity.describe(cfg)


def test_corpus_hash_follows_contents_not_paths(tmp_path):
  a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
  _shards(a, 0)
  _shards(b, 0)
  _shards(c, 1)
  ca, cb, cc = (provenance.corpus(_record(p)) for p in (a, b, c))
  assert ca["content_sha256"] == cb["content_sha256"] != cc["content_sha256"]
  assert ca["manifest_sha256"] == hashlib.sha256((a / "manifest.json").read_bytes()).hexdigest()
  assert ca["path"] == str(a.resolve()) and ca["source"] == "shards"
  # one changed shard byte changes the hash
  t = b / "train_000.bin"
  raw = bytearray(t.read_bytes())
  raw[-1] ^= 1
  t.write_bytes(bytes(raw))
  assert provenance.corpus(_record(b))["content_sha256"] != ca["content_sha256"]
  # the tokenizer is part of the corpus
  (a / "tokenizer.json").write_text("{}")
  ta = provenance.corpus(_record(a))
  assert ta["content_sha256"] != ca["content_sha256"]
  assert ta["tokenizer_sha256"] == hashlib.sha256(b"{}").hexdigest()
  assert provenance.corpus(None)["content_sha256"] is None


def test_source_state_is_the_checkout_of_the_imported_package():
  if not (provenance._SOURCE / ".git").exists():
    pytest.skip("not a git checkout")
  head = subprocess.run(["git", "-C", str(provenance._SOURCE), "rev-parse", "HEAD"],
                        capture_output=True, text=True, check=True).stdout.strip()
  st = provenance.source_state()
  assert st["commit"] == head and isinstance(st["dirty"], bool)


def test_source_state_outside_a_checkout(monkeypatch, tmp_path):
  monkeypatch.setattr(provenance, "_SOURCE", tmp_path)
  assert provenance.source_state({}) == {"commit": None, "dirty": None}
  env = {"SCALEOPT_COMMIT": "c" * 40, "SCALEOPT_DIRTY": "1"}
  assert provenance.source_state(env) == {"commit": "c" * 40, "dirty": True}


def test_collect_names_versions_flags_and_devices(monkeypatch):
  import jax
  import optax
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
  p = provenance.collect(True, None)
  assert p["versions"]["jax"] == jax.__version__ and p["versions"]["optax"] == optax.__version__
  assert set(provenance.PACKAGES) <= set(p["versions"])
  assert p["xla_flags"] == "--xla_gpu_deterministic_ops=true" and p["deterministic"] is True
  assert p["devices"] == jax.device_count() and p["processes"] == jax.process_count()
  assert p["device_kind"] == jax.devices()[0].device_kind
  assert p["jax_config"]["jax_enable_x64"] is False
  json.dumps(p)  # the summary stores it as JSON


def test_describe_sources_counts_commits_and_cards():
  provs = [{"commit": "a" * 40, "dirty": False, "device_kind": "H100", "devices": 1},
           {"commit": "a" * 40, "dirty": False, "device_kind": "H100", "devices": 1},
           {"commit": "b" * 40, "dirty": True, "device_kind": "H200", "devices": 1}, None]
  line = provenance.describe_sources(provs)
  assert line == (f"commits {'a' * 12} (2), {'b' * 12}+dirty (1), not recorded (1); "
                  "cards 1x H100 (2), 1x H200 (1), not recorded (1)")


def test_the_launchers_commit_wins_over_a_copied_git_folder():
  """A copied tree may carry a ``.git`` older than its files: the commit the launcher names is
  the one recorded."""
  env = {"SCALEOPT_COMMIT": "d" * 40, "SCALEOPT_DIRTY": "0"}
  assert provenance.source_state(env) == {"commit": "d" * 40, "dirty": False}
