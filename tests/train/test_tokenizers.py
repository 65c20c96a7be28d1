"""Tokenizers (Hugging Face `tokenizers`) and `scaleopt data prepare` on real-looking corpora."""

import json
import pathlib

import numpy as np
import pytest
import yaml

tk = pytest.importorskip("tokenizers")

from scaleopt.train import data as D
from scaleopt.train import tokenizers as T
from scaleopt.train.main import train_main
from train_helpers import heldout


def _name_in(split, i):
  """A file name whose hash puts it in ``split`` (the default 5% rule, from its definition)."""
  while True:
    name = f"f{i:03d}.txt"
    if heldout(name) == (split == "val"):
      return name, i + 1
    i += 1


def _corpus(tmp_path, n_train=20, n_val=2):
  src = tmp_path / "src"
  src.mkdir()
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "delta", "def", "return", "(", ")", ":", "\n", "é", "ß"]
  names, i = {"train": [], "val": []}, 0
  for split, n in (("train", n_train), ("val", n_val)):
    for _ in range(n):
      name, i = _name_in(split, i)
      (src / name).write_text(" ".join(rng.choice(words, 300)), encoding="utf-8")
      names[split].append(name)
  return src, {k: sorted(v) for k, v in names.items()}


def _shard_ids(out, split):
  arrs, vocab = D.load_shards(out, split)
  return np.concatenate([np.asarray(a) for a in arrs]), vocab


def test_bpe_trained_with_hf_tokenizers_roundtrips_the_files(tmp_path):
  src, names = _corpus(tmp_path)
  out = tmp_path / "bpe"
  assert D.prepare_main(str(src), str(out), "bpe:400") == 0
  head = json.loads((out / "train_000.json").read_text())
  hf = tk.Tokenizer.from_file(str(out / "tokenizer.json"))  # read back by the library itself
  vocab = max(hf.get_vocab(with_added_tokens=True).values()) + 1
  assert head["vocab_size"] == vocab and 257 < vocab <= 400 and head["dtype"] == "uint16"
  sep = hf.token_to_id("<|endoftext|>")
  assert head["separator"] == sep
  ids, shard_vocab = _shard_ids(out, "train")
  assert shard_vocab == vocab and int(ids.max()) < vocab
  # decoding the shard gives back every training file, separated by the end-of-text token
  texts = [(src / n).read_text(encoding="utf-8") for n in names["train"]]
  assert hf.decode(ids.tolist(), skip_special_tokens=False) == "".join(
      t + "<|endoftext|>" for t in texts)
  assert ids.size < 0.5 * sum(len(t.encode()) for t in texts)  # the merges compress
  assert int((ids == sep).sum()) == len(names["train"])
  val, _ = _shard_ids(out, "val")
  assert int((val == sep).sum()) == len(names["val"])


def _big_vocab_tokenizer(path, vocab=151_936):
  """A word-level tokenizer.json with Qwen2.5's vocabulary size; words map to high ids."""
  v = {f"w{i}": i for i in range(vocab - 1)}
  v["<|endoftext|>"] = vocab - 1
  tok = tk.Tokenizer(tk.models.WordLevel(v, unk_token="w0"))
  tok.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(["<|endoftext|>"])
  tok.save(str(path))
  return v


def test_loaded_tokenizer_json_with_a_151936_vocabulary_writes_uint32(tmp_path):
  tj = tmp_path / "tokenizer.json"
  _big_vocab_tokenizer(tj)
  src, names = _corpus(tmp_path)
  rng = np.random.default_rng(1)
  words = {}
  for split in ("train", "val"):
    for n in names[split]:
      w = rng.integers(0, 151_935, 50)
      words[n] = w
      (src / n).write_text(" ".join(f"w{i}" for i in w))
  out = tmp_path / "q"
  assert D.prepare_main(str(src), str(out), str(tj)) == 0
  head = json.loads((out / "train_000.json").read_text())
  assert head["dtype"] == "uint32" and head["vocab_size"] == 151_936
  assert head["separator"] == 151_935 and head["tokenizer"] == f"file:{tj}"
  ids, vocab = _shard_ids(out, "train")
  expect = np.concatenate([np.append(words[n], 151_935) for n in names["train"]])
  assert vocab == 151_936 and np.array_equal(ids, expect)
  assert ids.max() > 65_535


def test_prepare_skips_git_pyc_and_binary_files_with_a_count(tmp_path, capsys):
  src, names = _corpus(tmp_path)
  (src / ".git" / "objects").mkdir(parents=True)
  (src / ".git" / "objects" / "ab").write_text("not corpus text")
  (src / ".git" / "HEAD").write_text("ref: refs/heads/main")
  (src / "sub").mkdir()
  (src / "sub" / ".git").write_text("gitdir: ../.git/modules/sub")  # a submodule's .git file
  (src / "pkg" / "__pycache__").mkdir(parents=True)
  (src / "pkg" / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"\x00\x01compiled")
  (src / "pkg" / "m2.pyc").write_bytes(b"compiled")
  (src / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
  (src / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
  (src / "nul.dat").write_bytes(b"valid utf-8 text" * 10 + b"\x00" + b"tail")  # a NUL byte
  out = tmp_path / "b"
  assert D.prepare_main(str(src), str(out), "bytes") == 0
  msg = capsys.readouterr().out
  for what in ("1 .git/ directories", "1 .git files", "2 .pyc files", "3 binary files"):
    assert what in msg, msg
  ids, _ = _shard_ids(out, "train")
  expect = b"".join((src / n).read_bytes() + b"\0" for n in names["train"])
  assert bytes(ids.astype(np.uint8)) == expect  # none of the skipped bytes got in


def test_prepare_refuses_an_empty_validation_split(tmp_path, capsys):
  src, _ = _corpus(tmp_path, n_train=5, n_val=0)
  out = tmp_path / "o"
  assert D.prepare_main(str(src), str(out), "bytes") == 2
  err = capsys.readouterr().err
  assert "validation split would be empty" in err and str(src) in err
  assert not list(out.glob("*.bin")) if out.exists() else True
  one = tmp_path / "one.txt"
  one.write_text("a single line, nothing left for validation\n")
  assert D.prepare_main(str(one), str(out), "bytes") == 2
  assert "validation split would be empty" in capsys.readouterr().err


@pytest.mark.parametrize("spec, needle", [("bpe:abc", "bpe:VOCAB_SIZE"),
                                          ("bpe:100", "not allowed"),
                                          ("nope/tokenizer.json", "does not exist")])
def test_bad_tokenizer_specs_are_one_line_errors(tmp_path, capsys, spec, needle):
  src, _ = _corpus(tmp_path, n_train=3, n_val=1)
  assert D.prepare_main(str(src), str(tmp_path / "o"), spec) == 2
  err = capsys.readouterr().err.strip()
  assert needle in err and "\n" not in err and "Traceback" not in err


def test_training_refuses_a_model_vocabulary_smaller_than_the_shards(tmp_path, capsys):
  src, _ = _corpus(tmp_path)
  out = tmp_path / "bpe"
  assert D.prepare_main(str(src), str(out), "bpe:400") == 0
  vocab = json.loads((out / "train_000.json").read_text())["vocab_size"]
  cfg = tmp_path / "c.yaml"
  cfg.write_text(yaml.safe_dump({
      "run": {"steps": 1, "progress": False, "plot": False},
      "model": {"preset": "tiny", "vocab_size": 256},
      "data": {"source": "shards", "path": str(out), "seq_len": 16, "batch_size": 4,
               "microbatches": 1},
      "optimizer": {"name": "adamw"}}))
  assert train_main(str(cfg), str(tmp_path / "run")) == 2
  err = capsys.readouterr().err
  assert f"({vocab} tokens)" in err and "model.vocab_size=256" in err


QWEN_TOK = pathlib.Path(__file__).parents[1] / "models" / "fixtures" / "qwen2_tokenizer"


def test_qwen2_format_tokenizer_json_encodes_like_transformers(tmp_path):
  """The fixture's ids come from transformers' Qwen2Tokenizer (scripts/make_hf_fixture.py)."""
  ref = json.loads((QWEN_TOK / "reference.json").read_text(encoding="utf-8"))
  tj = json.loads((QWEN_TOK / "tokenizer.json").read_text(encoding="utf-8"))
  sep = next(t["id"] for t in tj["added_tokens"] if t["content"] == "<|endoftext|>")
  src = tmp_path / "src"
  src.mkdir()
  i = 0
  for doc, split in zip(ref["docs"], ("train", "train", "val")):
    name, i = _name_in(split, i)
    (src / name).write_text(doc, encoding="utf-8")
  out = tmp_path / "q"
  assert D.prepare_main(str(src), str(out), str(QWEN_TOK / "tokenizer.json")) == 0
  train, vocab = _shard_ids(out, "train")
  val, _ = _shard_ids(out, "val")
  a, b, c = ref["ids"]
  assert train.tolist() == a + [sep] + b + [sep] and val.tolist() == c + [sep]
  assert vocab == 1 + max(t["id"] for t in tj["added_tokens"])
