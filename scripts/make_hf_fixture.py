"""Writes tiny random Hugging Face checkpoints and the logits transformers computes for them.

The reference for ``tests/models/test_hf_convert.py``: the test converts these safetensors
files with ``scaleopt.models.hf`` and compares scaleopt's logits with the ones stored here,
which come from transformers alone. Two architectures, one fixture each:

  qwen2   Qwen2ForCausalLM: q/k/v biases, GQA 4/2, RoPE theta 1e6, eps 1e-6, untied head
  llama   LlamaForCausalLM: no biases, GQA 4/2, RoPE theta 1e4, eps 1e-5, tied head

and a Qwen2-format tokenizer (``qwen2_tokenizer``: a byte-level BPE of 400 merges put into
transformers' ``Qwen2Tokenizer``, i.e. Qwen2's NFC normalizer, digit-splitting pre-tokenizer
regex and special tokens) with the ids transformers gives a few documents, the reference for
``tests/train/test_tokenizers.py``.

Every parameter is drawn at random (norm weights 1 + N(0, 0.2^2), biases N(0, 0.5^2)), so a
mapping that drops, transposes or misplaces any tensor changes the logits visibly.

Needs torch and transformers, which `make test` does not install:

  python3.11 -m venv /tmp/hfvenv
  /tmp/hfvenv/bin/pip install torch==2.13.0 transformers safetensors
  /tmp/hfvenv/bin/python scripts/make_hf_fixture.py --out tests/models/fixtures
"""

import argparse
import json
import pathlib

import numpy as np
import torch
import transformers

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
MODELS = {
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=True,
                   attention_bias=False, mlp_bias=False)),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
  g = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      z = torch.randn(p.shape, generator=g, dtype=p.dtype)
      if name.endswith("norm.weight") or "layernorm" in name:
        p.copy_(1 + 0.2 * z)
      elif name.endswith("bias"):
        p.copy_(0.5 * z)
      elif "embed_tokens" in name:
        p.copy_(z)
      else:  # Linear weight [out, in]
        p.copy_(z / p.shape[1] ** 0.5)


def make(name: str, out: pathlib.Path) -> None:
  cfg_cls, model_cls, extra = MODELS[name]
  cfg = cfg_cls(**COMMON, **extra, torch_dtype="float32")
  torch.manual_seed(0)
  model = model_cls(cfg).eval()
  model.config._attn_implementation = "eager"
  randomize(model, seed=1)
  d = out / name
  d.mkdir(parents=True, exist_ok=True)
  model.save_pretrained(d, safe_serialization=True)
  (d / "generation_config.json").unlink(missing_ok=True)
  tokens = np.random.default_rng(2).integers(0, COMMON["vocab_size"], (2, 12)).astype(np.int32)
  with torch.no_grad():
    logits = model(torch.from_numpy(tokens).long()).logits.float().numpy()
  np.savez(d / "reference.npz", tokens=tokens, logits=logits)
  print(f"{d}: {sum(p.numel() for p in model.parameters())} parameters, logits std "
        f"{logits.std():.2f}, transformers {transformers.__version__}, torch {torch.__version__}")


TOKENIZER_TEXT = """def add(x, y):
    return x + y  # 12345 numbers are split digit by digit
The quick brown fox jumps over the lazy dog. Café, naïve, 中文, emoji-free text.
    if __name__ == "__main__":
        print(add(1, 2))
"""
DOCS = ["def main():\n    print('hello world')  # 2026\n",
        "Une phrase en français: été, déjà.\n中文 and   multiple   spaces\t\ttabs\n",
        "<|im_start|>user\nwhat is 7 * 6?<|im_end|>\n"]


def make_tokenizer(out: pathlib.Path) -> None:
  import tokenizers as tk
  t = tk.Tokenizer(tk.models.BPE())
  t.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
  t.train_from_iterator([TOKENIZER_TEXT * 3], trainer=tk.trainers.BpeTrainer(
      vocab_size=400, initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False))
  model = json.loads(t.to_str())["model"]
  merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
  q = transformers.Qwen2Tokenizer(vocab=model["vocab"], merges=merges)
  q.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
  d = out / "qwen2_tokenizer"
  q.save_pretrained(str(d))
  ids = [q(doc, add_special_tokens=False)["input_ids"] for doc in DOCS]
  (d / "reference.json").write_text(json.dumps({"docs": DOCS, "ids": ids}, ensure_ascii=False))
  print(f"{d}: {len(q)} ids")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default="tests/models/fixtures")
  args = ap.parse_args()
  for name in MODELS:
    make(name, pathlib.Path(args.out))
  make_tokenizer(pathlib.Path(args.out))


if __name__ == "__main__":
  main()
