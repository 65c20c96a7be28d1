r"""Inputs for the spectral diagnostic: byte statistics, a project language model, a byte MLP.

Corpus: the Python standard library's own .py sources, read from the running interpreter's
stdlib directory (sorted paths, first `max_bytes` bytes) — the project's embedded text corpus.

Token statistics (choice, documented in docs/scaling.md): the covariance of one-hot token
vectors. For a one-hot x with probabilities p, Cov = diag(p) - p p^T, whose eigenvalues
interlace with the sorted p, so the spectrum is the rank-frequency (Zipf) curve:
  * "unigram": x = one-hot of the byte (256 dims; exact eigvalsh of diag(p) - p p^T);
  * "bigram":  x = one-hot of the (previous byte, byte) pair (65536 dims; the sorted pair
    frequencies, equal to the eigenvalues up to the one rank-one correction).

Language model (the project's own): the `tiny` preset of `scaleopt.models` (2 layers, d_model
64, byte vocabulary), freshly initialised or trained briefly with AdamW on the embedded corpus
(`scaleopt.train.data.embedded_tokens`, train split). Its activations are the final residual
stream as the unembedding reads it, Norm(x_L) (before the final scale vector), one row per token
of held-out (val split) windows: `lm_activations`.

Plain-JAX alternative (choice): an MLP next-byte predictor, context of `context`
previous bytes -> embeddings (16 each) -> one ReLU hidden layer (`hidden` units) -> 256 logits,
trained with optax.adam on cross-entropy for a few hundred steps. Its hidden activations on
held-out text are the "activations of a small trained model" handed to `diagnose`.
"""

from __future__ import annotations

import functools
import pathlib
import sysconfig
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx


def stdlib_bytes(max_bytes: int = 2_000_000) -> np.ndarray:
  """uint8 array: the concatenated .py files of the running interpreter's standard library."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  chunks, total = [], 0
  for path in sorted(root.rglob("*.py")):
    if "site-packages" in path.parts or "test" in path.parts:
      continue
    try:
      b = path.read_bytes()
    except OSError:
      continue
    chunks.append(b)
    total += len(b)
    if total >= max_bytes:
      break
  return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def onehot_spectrum(data: np.ndarray, order: str = "unigram") -> np.ndarray:
  """Descending eigenvalues of the one-hot token covariance ("unigram" or "bigram")."""
  data = np.asarray(data, np.int64)
  if order == "unigram":
    p = np.bincount(data, minlength=256) / len(data)
    return np.sort(np.linalg.eigvalsh(np.diag(p) - np.outer(p, p)))[::-1]
  if order == "bigram":
    pairs = data[:-1] * 256 + data[1:]
    p = np.bincount(pairs, minlength=65536) / len(pairs)
    return np.sort(p[p > 0])[::-1]
  raise ValueError(f"order {order!r}: allowed values are unigram, bigram")


class ByteMLP(NamedTuple):
  embed: jax.Array  # (256, e)
  w1: jax.Array     # (context * e, hidden)
  b1: jax.Array
  w2: jax.Array     # (hidden, 256)
  b2: jax.Array


def _windows(data: np.ndarray, context: int) -> tuple[np.ndarray, np.ndarray]:
  idx = np.arange(context)[None, :] + np.arange(len(data) - context)[:, None]
  return data[idx], data[context:]


def hidden_activations(params: ByteMLP, ctx: jax.Array) -> jax.Array:
  """ReLU hidden layer of the byte MLP for contexts (B, context)."""
  e = params.embed[ctx].reshape(ctx.shape[0], -1)
  return jax.nn.relu(e @ params.w1 + params.b1)


def train_byte_mlp(data: np.ndarray, steps: int = 300, context: int = 4, embed: int = 16,
                   hidden: int = 256, batch: int = 256, lr: float = 3e-3, seed: int = 0
                   ) -> tuple[ByteMLP, list[float]]:
  """Train the next-byte MLP with Adam on random windows; returns params and the loss curve."""
  x, y = _windows(np.asarray(data, np.int32), context)
  k = jax.random.split(jax.random.key(seed), 4)
  params = ByteMLP(
      jax.random.normal(k[0], (256, embed)) * 0.1,
      jax.random.normal(k[1], (context * embed, hidden)) / np.sqrt(context * embed),
      jnp.zeros(hidden),
      jax.random.normal(k[2], (hidden, 256)) / np.sqrt(hidden),
      jnp.zeros(256))
  tx = optax.adam(lr)

  def loss_fn(p, xb, yb):
    logits = hidden_activations(p, xb) @ p.w2 + p.b2
    return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

  @jax.jit
  def step(p, st, xb, yb):
    l, g = jax.value_and_grad(loss_fn)(p, xb, yb)
    upd, st = tx.update(g, st, p)
    return optax.apply_updates(p, upd), st, l

  rng = np.random.default_rng(seed)
  st = tx.init(params)
  losses = []
  for _ in range(steps):
    i = rng.integers(0, len(x), batch)
    params, st, l = step(params, st, jnp.asarray(x[i]), jnp.asarray(y[i]))
    losses.append(float(l))
  return params, losses


def model_activations(params: ByteMLP, data: np.ndarray, n: int = 8192, context: int = 4,
                      seed: int = 1) -> np.ndarray:
  """(n, hidden) hidden activations on n random windows of `data` (e.g. held-out bytes)."""
  x, _ = _windows(np.asarray(data, np.int32), context)
  i = np.random.default_rng(seed).integers(0, len(x), n)
  return np.asarray(jax.jit(hidden_activations)(params, jnp.asarray(x[i])))


# --------------------------------------------------------------------- scaleopt.models LM


def lm_hidden_states(cfg, params, tokens_BxT: jax.Array) -> jax.Array:
  """Norm(x_L) of a `scaleopt.models` Transformer (B, T, d_model), float32: the trunk of
  `Transformer.__call__` (`Transformer.features`); the logits are these states times the
  (scale-folded) unembedding, which the tests check.
  """
  from scaleopt.models.transformer import Transformer

  graphdef, _ = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  return nnx.merge(graphdef, params).features(tokens_BxT)[0].astype(jnp.float32)


def train_tiny_lm(steps: int = 150, batch: int = 16, seq_len: int = 64, lr: float = 3e-3,
                  seed: int = 0, preset: str = "tiny") -> tuple[object, dict, list[float]]:
  """(cfg, params, loss curve): a `scaleopt.models` preset trained with AdamW on random
  windows of the embedded corpus's train split (steps = 0: fresh initialisation)."""
  from scaleopt.models import functional, get_preset, lm_loss
  from scaleopt.train.data import embedded_tokens

  cfg = get_preset(preset)
  init_fn, apply_fn = functional(cfg)
  params = jax.jit(init_fn)(jax.random.key(seed))
  tx = optax.adamw(lr, weight_decay=0.0)

  def loss_fn(p, xb):
    logits, _ = apply_fn(p, xb[:, :-1])
    return lm_loss(logits, xb[:, 1:])

  @jax.jit
  def step(p, st, xb):
    l, g = jax.value_and_grad(loss_fn)(p, xb)
    upd, st = tx.update(g, st, p)
    return optax.apply_updates(p, upd), st, l

  data = np.asarray(embedded_tokens("train"), np.int32)
  rng = np.random.default_rng(seed)
  st, losses = tx.init(params), []
  for _ in range(steps):
    start = rng.integers(0, len(data) - seq_len - 1, batch)
    xb = data[start[:, None] + np.arange(seq_len + 1)[None, :]]
    params, st, l = step(params, st, jnp.asarray(xb))
    losses.append(float(l))
  return cfg, params, losses


def lm_activations(cfg, params, n_windows: int = 64, seq_len: int = 64, seed: int = 1
                   ) -> np.ndarray:
  """(n_windows * seq_len, d_model) final hidden states on random val-split windows."""
  from scaleopt.train.data import embedded_tokens

  data = np.asarray(embedded_tokens("val"), np.int32)
  start = np.random.default_rng(seed).integers(0, len(data) - seq_len, n_windows)
  xb = jnp.asarray(data[start[:, None] + np.arange(seq_len)[None, :]])
  h = jax.jit(functools.partial(lm_hidden_states, cfg))(params, xb)
  return np.asarray(h).reshape(-1, h.shape[-1])
