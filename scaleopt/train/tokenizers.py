"""Tokenizers for ``scaleopt data prepare``: bytes, a trained byte-level BPE, any tokenizer.json.

A tokenizer is named by a spec string:

  bytes            one token per byte (vocab 256); documents are separated by token 0
  bpe:VOCAB        a byte-level BPE trained with Hugging Face ``tokenizers`` on the training
                   split (GPT-2 pre-tokenization, all 256 byte symbols in the alphabet, the
                   special token ``<|endoftext|>`` = id 0 separates documents); VOCAB counts
                   the bytes and the special token, up to 1,048,576
  PATH             an existing ``tokenizer.json`` of ``tokenizers`` (Qwen2.5's, Llama's, ...);
                   documents are separated by its end-of-text token (the first of
                   ``SEPARATORS`` it knows; ``PATH#TOKEN`` names another one)

Encoding never adds the tokenizer's own BOS/EOS templates (``add_special_tokens=False``): the
separator is the only special token in the stream. The vocabulary size recorded in the shards
is ``max id + 1`` (added tokens included), which may be smaller than a model's padded
vocabulary (Qwen2.5: 151,665 ids for 151,936 embedding rows).
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np

MAX_BPE_VOCAB = 1 << 20
SEPARATORS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
BPE_SEPARATOR = "<|endoftext|>"
_BATCH = 256  # documents per encode_batch call (the Rust side runs them in parallel)


class TokenizerError(ValueError):
  """A bad tokenizer spec or file; the message names it."""


@dataclasses.dataclass
class Tokenizer:
  """``kind`` is ``bytes``, ``bpe`` (trained here) or ``file`` (loaded); ``hf`` the
  ``tokenizers.Tokenizer`` (None for bytes); ``sep`` the document separator id."""
  kind: str
  vocab_size: int
  sep: int
  hf: Any = None
  source: Optional[str] = None

  @property
  def name(self) -> str:
    return self.kind if self.source is None else f"{self.kind}:{self.source}"

  def encode(self, text: bytes) -> np.ndarray:
    """Token ids of one document (no separator), uint32."""
    return next(iter(self.encode_docs([text], separators=False)))

  def encode_docs(self, docs: Iterable[bytes], separators: bool = True
                  ) -> Iterator[np.ndarray]:
    """Yields the ids of each document followed by the separator (uint32 arrays).

    Documents must be UTF-8 for the BPE kinds (``data.prepare`` skips the others).
    """
    sep = np.array([self.sep] if separators else [], np.uint32)
    if self.hf is None:
      for d in docs:
        yield np.concatenate([np.frombuffer(d, np.uint8).astype(np.uint32), sep])
      return
    batch: list[str] = []
    for d in docs:
      batch.append(d.decode("utf-8"))
      if len(batch) == _BATCH:
        yield from self._encode_batch(batch, sep)
        batch = []
    if batch:
      yield from self._encode_batch(batch, sep)

  def _encode_batch(self, texts: list[str], sep: np.ndarray) -> Iterator[np.ndarray]:
    for enc in self.hf.encode_batch(texts, add_special_tokens=False):
      yield np.concatenate([np.asarray(enc.ids, np.uint32), sep])

  def decode(self, ids) -> bytes:
    """Bytes of a token sequence (special tokens included, as text)."""
    ids = [int(i) for i in np.asarray(ids).ravel()]
    if self.hf is None:
      return bytes(ids)
    return self.hf.decode(ids, skip_special_tokens=False).encode("utf-8")

  def save(self, directory: str | pathlib.Path) -> Optional[pathlib.Path]:
    """Writes ``DIR/tokenizer.json`` (BPE kinds; the bytes tokenizer needs no file)."""
    if self.hf is None:
      return None
    path = pathlib.Path(directory) / "tokenizer.json"
    self.hf.save(str(path))
    return path


def _hf():
  try:
    import tokenizers
  except ImportError:
    raise TokenizerError("BPE tokenizers need the `tokenizers` package "
                         "(pip install tokenizers)") from None
  return tokenizers


def _vocab_size(tok) -> int:
  return max(tok.get_vocab(with_added_tokens=True).values()) + 1


def bytes_tokenizer() -> Tokenizer:
  return Tokenizer(kind="bytes", vocab_size=256, sep=0)


def train_bpe(texts: Iterable[bytes], vocab_size: int) -> Tokenizer:
  """A byte-level BPE of ``vocab_size`` ids (or fewer if the corpus has fewer merges)."""
  if not 257 < vocab_size <= MAX_BPE_VOCAB:
    raise TokenizerError(f"bpe vocab size {vocab_size} is not allowed; it must be in "
                         f"(257, {MAX_BPE_VOCAB}] (256 bytes + the separator + merges)")
  tk = _hf()
  tok = tk.Tokenizer(tk.models.BPE())
  tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.decoder = tk.decoders.ByteLevel()
  trainer = tk.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=[BPE_SEPARATOR], show_progress=False,
      initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator((t.decode("utf-8") for t in texts), trainer=trainer)
  return Tokenizer(kind="bpe", vocab_size=_vocab_size(tok), sep=tok.token_to_id(BPE_SEPARATOR),
                   hf=tok, source=str(vocab_size))


def load_tokenizer(path: str | pathlib.Path, separator: Optional[str] = None) -> Tokenizer:
  """A ``tokenizer.json``; the separator is ``separator`` or the first of ``SEPARATORS``."""
  p = pathlib.Path(path)
  if p.is_dir():
    p = p / "tokenizer.json"
  if not p.is_file():
    raise TokenizerError(f"tokenizer file {str(p)!r} does not exist; choose bytes, "
                         "bpe:VOCAB_SIZE or the path of a tokenizer.json")
  tk = _hf()
  try:
    tok = tk.Tokenizer.from_file(str(p))
  except Exception as e:  # pylint: disable=broad-except  (tokenizers raises plain Exception)
    raise TokenizerError(f"tokenizer file {str(p)!r} cannot be read: {e}") from None
  names = (separator,) if separator else SEPARATORS
  sep = next((tok.token_to_id(n) for n in names if tok.token_to_id(n) is not None), None)
  if sep is None:
    raise TokenizerError(f"tokenizer file {str(p)!r} has none of the separator tokens {names}; "
                         f"name one as {p}#TOKEN")
  return Tokenizer(kind="file", vocab_size=_vocab_size(tok), sep=int(sep), hf=tok,
                   source=str(p))


def from_spec(spec: str, train_texts: Optional[Callable] = None) -> Tokenizer:
  """The tokenizer of a spec string (module docstring). ``train_texts()`` yields the
  training documents (bytes) for ``bpe:VOCAB``."""
  if spec == "bytes":
    return bytes_tokenizer()
  if spec.startswith("bpe:"):
    try:
      vocab = int(spec[4:])
    except ValueError:
      raise TokenizerError(f"tokenizer {spec!r}: expected bpe:VOCAB_SIZE, e.g. bpe:32000") from None
    return train_bpe(train_texts() if train_texts else [], vocab)
  path, _, sep = spec.partition("#")
  return load_tokenizer(path, sep or None)
