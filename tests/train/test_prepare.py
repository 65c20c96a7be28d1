"""`scaleopt data prepare` inputs: text, JSONL(.gz), Parquet, Arrow; bounded memory; the
document split; restarts; identical shards (hence identical, resumable batches) across formats."""

import gzip
import json
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest

from scaleopt.train import data as D
from scaleopt.train import prepare as P
from scaleopt.train import tokenizers
from train_helpers import heldout

tk = pytest.importorskip("tokenizers")
try:  # the `data` extra; without it the Parquet and Arrow cases are left out
  import pyarrow as pa
  import pyarrow.parquet as pq
except ImportError:
  pa = pq = None


def _docs(n=120, seed=0):
  """Documents with what breaks naive readers: escaped newlines and quotes, unicode, braces."""
  rng = np.random.default_rng(seed)
  words = ["alpha", "beta", '"quoted"', "{brace}", "é", "ß", "日本", "\n", "\t", "x\\y", "  "]
  docs = [" ".join(rng.choice(words, int(rng.integers(5, 60)))) for _ in range(n)]
  return docs + [docs[3], docs[3]]  # duplicates fall on one side of the split


def _write_jsonl(path, docs, field="text", opener=open):
  with opener(path, "wt", encoding="utf-8") as f:
    for i, d in enumerate(docs):
      f.write(json.dumps({"id": i, field: d, "meta": {"src": "x"}}) + "\n")


def _write_hf_arrow_folder(folder, docs):
  """What datasets.save_to_disk writes: Arrow IPC stream files + state.json + dataset_info.json."""
  folder.mkdir()
  table = pa.table({"text": docs, "id": list(range(len(docs)))})
  half = len(docs) // 2
  names = []
  for k, part in enumerate((table.slice(0, half), table.slice(half))):
    name = f"data-{k:05d}-of-00002.arrow"
    with pa.OSFile(str(folder / name), "wb") as sink:
      with pa.ipc.new_stream(sink, part.schema) as w:
        for b in part.to_batches(max_chunksize=17):
          w.write_batch(b)
    names.append(name)
  (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
  (folder / "dataset_info.json").write_text(json.dumps({"features": {"text": "string"}}))


def _inputs(tmp_path, docs):
  """The same documents in every supported format: {name: input path}."""
  src = {}
  src["jsonl"] = tmp_path / "docs.jsonl"
  _write_jsonl(src["jsonl"], docs)
  src["jsonl.gz"] = tmp_path / "docs.jsonl.gz"
  _write_jsonl(src["jsonl.gz"], docs, opener=gzip.open)
  if pa is None:
    return src
  src["parquet"] = tmp_path / "docs.parquet"
  pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), src["parquet"],
                 row_group_size=13)
  src["arrow-file"] = tmp_path / "docs.arrow"
  with pa.ipc.new_file(str(src["arrow-file"]), pa.schema([("text", pa.string())])) as w:
    w.write_table(pa.table({"text": docs}))
  src["hf-folder"] = tmp_path / "hf"  # a DatasetDict with one split
  src["hf-folder"].mkdir()
  (src["hf-folder"] / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
  _write_hf_arrow_folder(src["hf-folder"] / "train", docs)
  try:
    import zstandard
  except ImportError:
    return src
  src["jsonl.zst"] = tmp_path / "docs.jsonl.zst"
  data = b"".join((json.dumps({"text": d}) + "\n").encode() for d in docs)
  src["jsonl.zst"].write_bytes(zstandard.ZstdCompressor().compress(data))
  return src


def _ids(out, split):
  arrs, _ = D.load_shards(out, split)
  return np.concatenate([np.asarray(a) for a in arrs]).astype(np.int64)


def _bpe_file(tmp_path, docs):
  """A BPE tokenizer.json trained here with the library itself (the reference encoder)."""
  tok = tk.Tokenizer(tk.models.BPE())
  tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = tk.decoders.ByteLevel()
  tok.train_from_iterator(docs, tk.trainers.BpeTrainer(
      vocab_size=400, special_tokens=["<|endoftext|>"],
      initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  path = tmp_path / "bpe.json"
  tok.save(str(path))
  return path, tok


@pytest.mark.parametrize("spec", ["bytes", "bpe-file"])
def test_every_format_gives_exactly_the_documents_tokens(tmp_path, spec):
  docs = _docs()
  if spec == "bytes":
    encode, sep, tokenizer = (lambda d: list(d.encode())), 0, "bytes"
  else:
    path, ref = _bpe_file(tmp_path, docs)
    encode = lambda d: ref.encode(d, add_special_tokens=False).ids
    sep, tokenizer = ref.token_to_id("<|endoftext|>"), str(path)
  want = {s: [t for d in docs if heldout(d, 0.1) == (s == "val") for t in encode(d) + [sep]]
          for s in ("train", "val")}
  assert 0 < len(want["val"]) < len(want["train"])
  hashes = set()
  for name, inp in _inputs(tmp_path, docs).items():
    out = tmp_path / f"out-{name}"
    s = D.prepare(inp, out, tokenizer, val_fraction=0.1)
    for split in ("train", "val"):
      np.testing.assert_array_equal(_ids(out, split), want[split], err_msg=name)
    man = json.loads((out / "manifest.json").read_text())
    assert man["splits"]["train"]["tokens"] == len(want["train"]) == s["train_tokens"]
    hashes.add(man["content_hash"])
  assert len(hashes) == 1  # the same corpus in any format: the same shards


def test_text_folder_with_compressed_files_and_long_files_in_pieces(tmp_path, monkeypatch):
  """A long text file is read in pieces; the byte-level BPE still gives the whole file's ids."""
  monkeypatch.setattr(P.readers, "PIECE_BYTES", 200)
  zstd = pytest.importorskip("zstandard")
  docs = _docs(60, seed=1)
  path, ref = _bpe_file(tmp_path, docs)
  src = tmp_path / "txt"
  (src / "sub").mkdir(parents=True)
  texts = {}
  for i in range(40):
    rel = (f"sub/f{i:02d}.txt.gz", f"f{i:02d}.md", f"f{i:02d}.txt.zst")[i % 3]
    text = "\n".join(docs[i:i + 15]) + "\n  indented\n\nlast line"
    texts[rel] = text
    if rel.endswith(".gz"):
      with gzip.open(src / rel, "wt", encoding="utf-8") as f:
        f.write(text)
    elif rel.endswith(".zst"):
      (src / rel).write_bytes(zstd.ZstdCompressor().compress(text.encode()))
    else:
      (src / rel).write_text(text, encoding="utf-8")
  out = tmp_path / "o"
  D.prepare(src, out, str(path), val_fraction=0.2)
  sep = ref.token_to_id("<|endoftext|>")
  for split in ("train", "val"):
    want = [t for rel in sorted(texts) if heldout(rel, 0.2) == (split == "val")
            for t in ref.encode(texts[rel], add_special_tokens=False).ids + [sep]]
    np.testing.assert_array_equal(_ids(out, split), want)
  assert max(len(t) for t in texts.values()) > 5 * P.readers.PIECE_BYTES  # many pieces per file


def test_document_split_fraction_is_by_document_hash(tmp_path):
  docs = [f"document {i}\nbody {i * 7}" for i in range(2000)]
  inp = tmp_path / "d.jsonl"
  _write_jsonl(inp, docs)
  out = tmp_path / "o"
  D.prepare(inp, out, "bytes", val_fraction=0.3)
  val = bytes(_ids(out, "val").astype(np.uint8)).split(b"\0")[:-1]
  want = [d.encode() for d in docs if heldout(d, 0.3)]
  assert val == want
  assert abs(len(val) / len(docs) - 0.3) < 4 * np.sqrt(0.3 * 0.7 / len(docs))


@pytest.mark.parametrize("case,needle", [
    ('{"body": "x"}\n', "line 1 has no field 'text'"),
    ('{"text": "a"}\n{"txt": "b"}\n', "line 2 has no field 'text'"),
    ('{"text": "a"}\nnot json\n', "line 2 is not JSON"),
    ('{"text": 5}\n', "holds int, not text"),
])
def test_jsonl_without_the_text_field_is_a_one_line_error(tmp_path, capsys, case, needle):
  inp = tmp_path / "d.jsonl"
  inp.write_text(case * 30)
  out = tmp_path / "o"
  assert D.prepare_main(str(inp), str(out), "bytes") == 2
  err = capsys.readouterr().err
  assert needle in err and str(inp) in err and err.count("\n") == 1, err
  assert "--text-field" in err or "JSON" in needle
  assert not out.exists()


def test_parquet_without_the_column_is_a_one_line_error(tmp_path, capsys):
  pytest.importorskip("pyarrow")
  inp = tmp_path / "d.parquet"
  pq.write_table(pa.table({"content": ["a", "b"]}), inp)
  assert D.prepare_main(str(inp), str(tmp_path / "o"), "bytes", text_field="text") == 2
  err = capsys.readouterr().err
  assert "no column 'text'" in err and "content" in err and err.count("\n") == 1


def _peak_bytes(fn) -> int:
  tracemalloc.start()
  try:
    fn()
    return tracemalloc.get_traced_memory()[1]
  finally:
    tracemalloc.stop()


@pytest.mark.parametrize("fmt", ["text", "jsonl.gz"])
def test_memory_stays_far_below_the_file_size(tmp_path, monkeypatch, fmt):
  monkeypatch.setattr(P.readers, "PIECE_BYTES", 64 << 10)
  monkeypatch.setattr(P.tokenize, "BATCH_BYTES", 256 << 10)
  line = ("word " * 30 + "\n").encode()
  size = 24 << 20
  if fmt == "text":
    inp = tmp_path / "big.txt"
    with open(inp, "wb") as f:
      for _ in range(size // (64 * len(line))):
        f.write(line * 64)
  else:
    inp = tmp_path / "big.jsonl.gz"
    rec = json.dumps({"text": (line * 40).decode()})
    with gzip.open(inp, "wb", compresslevel=1) as f:
      for i in range(size // len(rec)):
        f.write(f'{rec[:-2]}{i}"}}\n'.encode())  # distinct documents
  out = tmp_path / "o"
  peak = _peak_bytes(lambda: D.prepare(inp, out, "bytes", shard_tokens=1 << 20))
  total = sum(json.loads(p.read_text())["num_tokens"] for p in out.glob("*_*.json"))
  assert total > size * 0.95
  assert peak < size / 4, (peak, size)


def test_an_interrupted_prepare_continues_and_writes_the_same_shards(tmp_path, monkeypatch):
  docs = _docs(400, seed=2)
  inp = tmp_path / "in"  # records, then a binary file (counted once), then more records
  inp.mkdir()
  _write_jsonl(inp / "a.jsonl", docs[:300])
  (inp / "b.txt").write_bytes(b"\x00binary")
  _write_jsonl(inp / "c.jsonl", docs[300:])
  ref = tmp_path / "ref"
  D.prepare(inp, ref, "bytes", shard_tokens=2000)
  saves, real_save = [], P.restart.save_state

  def save_then_die(*a):
    real_save(*a)
    saves.append(1)
    if len(saves) == 15:
      raise KeyboardInterrupt

  monkeypatch.setattr(P.restart, "save_state", save_then_die)
  out = tmp_path / "o"
  with pytest.raises(KeyboardInterrupt):
    D.prepare(inp, out, "bytes", shard_tokens=2000)
  (out / "train_015.bin").write_bytes(b"partial")  # a shard the killed run was writing
  monkeypatch.setattr(P.restart, "save_state", real_save)
  encoded, real_encode = [], tokenizers.Tokenizer.encode_docs
  monkeypatch.setattr(tokenizers.Tokenizer, "encode_docs",
                      lambda self, d, **k: (encoded.extend(d), real_encode(self, d, **k))[1])
  D.prepare(inp, out, "bytes", shard_tokens=2000)
  assert not (out / ".prepare").exists()
  names = sorted(p.name for p in ref.iterdir())
  assert names == sorted(p.name for p in out.iterdir())
  for n in names:
    assert (ref / n).read_bytes() == (out / n).read_bytes(), n
  assert sum(map(len, encoded)) < 0.6 * sum(len(d.encode()) for d in docs)  # not from scratch
  assert json.loads((out / "manifest.json").read_text())["skipped"] == {"binary files": 1}


def test_batches_resume_exactly_on_shards_of_any_format(tmp_path):
  docs = _docs(300, seed=3)
  got = []
  for name, inp in _inputs(tmp_path, docs).items():
    out = tmp_path / f"o-{name}"
    D.prepare(inp, out, "bytes", shard_tokens=3000)
    w, _ = D.open_split("shards", str(out), "train", 32)
    b = D.Batches(w, 8, 2, seed=1)
    first = [b.next()["tokens"] for _ in range(3)]
    b2 = D.Batches(w, 8, 2, seed=1)
    b2.restore(b.state())
    got.append((first, b2.next()["tokens"], b.next()["tokens"]))
  for first, resumed, uninterrupted in got:
    np.testing.assert_array_equal(resumed, uninterrupted)
    for x, y in zip(first, got[0][0]):
      np.testing.assert_array_equal(x, y)


def test_cli_prints_throughput_and_reads_options(tmp_path):
  inp = tmp_path / "d.jsonl"
  _write_jsonl(inp, _docs(50), field="body")
  out = tmp_path / "o"
  r = subprocess.run([sys.executable, "-m", "scaleopt.cli", "data", "prepare", "--input",
                      str(inp), "--out", str(out), "--text-field", "body", "--val-fraction",
                      "0.2"], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  assert "MB/s" in r.stdout and "content hash" in r.stdout
  assert json.loads((out / "manifest.json").read_text())["val_fraction"] == 0.2


def test_ctrl_c_keeps_the_restart_point_and_says_how_to_continue(tmp_path, monkeypatch, capsys):
  inp = tmp_path / "d.jsonl"
  _write_jsonl(inp, _docs(200, seed=4))

  def die(*a):
    raise KeyboardInterrupt

  real_save = P.restart.save_state
  monkeypatch.setattr(P.restart, "save_state", lambda *a: (real_save(*a), die()))
  out = tmp_path / "o"
  assert D.prepare_main(str(inp), str(out), "bytes", shard_tokens=1000) == 130
  assert "run the same command again" in capsys.readouterr().err
  assert (out / ".prepare" / "state.json").is_file() and (out / "train_000.bin").is_file()
