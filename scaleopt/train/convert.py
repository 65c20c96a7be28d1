"""``scaleopt convert``: Hugging Face safetensors <-> scaleopt parameters, and ``model.init_from``.

  scaleopt convert import --hf HF_DIR --out PARAMS_DIR
  scaleopt convert export --from SOURCE --out HF_DIR [--step N] [--dtype float32|bfloat16]

A converted directory (``import``) holds ``model.json`` (the ModelConfig fields), ``params/``
(an Orbax checkpoint of the parameter tree, float32) and ``hf/`` (the source's config.json and
tokenizer files, copied back on export). A parameter SOURCE is any of

  * a Hugging Face directory (``config.json`` + ``*.safetensors``; Qwen2 / Llama, see
    :mod:`scaleopt.models.hf`),
  * a converted directory,
  * a run directory (its latest checkpoint, or ``--step``; the model from its config.yaml),
  * one checkpoint directory ``RUN/checkpoints/N``.

Training from a source: ``scaleopt train ... --set model.init_from=SOURCE`` starts a fresh run
(step 0, fresh optimizer state) from those parameters; the architecture comes from the source
(``with_architecture``: every architecture field the model section does not set), the
settings that do not change the parameters (dtype, remat, max_seq_len, loss and kernel
choices) from the preset and the section; a field the section sets to another value than the
source's is refused, naming the field. ``--resume`` ignores ``init_from``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
import sys
from typing import Any, Optional

import jax
import numpy as np

from scaleopt import models
from scaleopt.models import hf
from scaleopt.train import config as config_lib
from scaleopt.train.config import ConfigError, architecture_fields

HF_EXTRAS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "vocab.json", "merges.txt")


class SourceError(ConfigError):
  """A parameter source is missing, unreadable or does not match the model."""


@dataclasses.dataclass
class Source:
  kind: str  # hf | converted | checkpoint
  path: pathlib.Path
  cfg: models.ModelConfig
  hf_dir: Optional[pathlib.Path] = None  # where config.json / tokenizer files come from
  run_dir: Optional[pathlib.Path] = None  # a run's folder: its tokenizer and trained context


def _run_source(ckpt: pathlib.Path, run_dir: pathlib.Path) -> Source:
  """A checkpoint of a run: the model from the run's config.yaml; config.json and tokenizer
  files from its ``model.init_from`` when that was a Hugging Face or converted directory."""
  model = config_lib.saved_section(run_dir, "model")  # the recorded section names every field
  if model.config is None:  # a section that left fields to its own source
    model = config_lib.model_spec(with_architecture(model.section))
  hf_dir = None
  if model.init_from:
    try:
      hf_dir = open_source(model.init_from).hf_dir
    except SourceError:
      pass  # moved or deleted since: export without its config.json and tokenizer files
  return Source("checkpoint", ckpt, model.config, hf_dir, run_dir)


def _checkpoint_dir(path: pathlib.Path, step: Optional[int]) -> pathlib.Path:
  ck = path / "checkpoints"
  steps = sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit()
                 and (p / "state").is_dir()) if ck.is_dir() else []
  if not steps:
    raise SourceError(f"run directory {str(path)!r} holds no complete checkpoint")
  if step is None:
    return ck / str(steps[-1])
  if step not in steps:
    raise SourceError(f"run directory {str(path)!r} has no checkpoint {step}; it has {steps}")
  return ck / str(step)


def open_source(path: str | pathlib.Path, step: Optional[int] = None) -> Source:
  """Identifies a parameter source and reads its model config (no tensors yet)."""
  p = pathlib.Path(path)
  try:
    if (p / "model.json").is_file() and (p / "params").is_dir():
      fields = json.loads((p / "model.json").read_text())
      hf_dir = p / "hf" if (p / "hf").is_dir() else None
      return Source("converted", p, models.ModelConfig(**fields), hf_dir)
    if (p / "config.json").is_file() and list(p.glob("*.safetensors")):
      return Source("hf", p, hf.config_from_hf(json.loads((p / "config.json").read_text())), p)
    if (p / "config.yaml").is_file() and (p / "checkpoints").is_dir():
      return _run_source(_checkpoint_dir(p, step), p)
    if (p / "state").is_dir() and (p.parent.parent / "config.yaml").is_file():
      return _run_source(p, p.parent.parent)
  except (ValueError, TypeError, KeyError, OSError) as e:
    raise SourceError(f"parameter source {str(p)!r} cannot be read: {e}") from None
  raise SourceError(f"parameter source {str(p)!r} is none of: a Hugging Face directory "
                    "(config.json + *.safetensors), a `scaleopt convert import` directory, a run "
                    "directory or a checkpoint directory RUN/checkpoints/N")


def _restore_params(directory: pathlib.Path) -> dict:
  """The parameter tree of an Orbax PyTree checkpoint (the ``params`` entry if it is a
  TrainState), as numpy arrays; nothing else is read."""
  import orbax.checkpoint as ocp
  ckptr = ocp.PyTreeCheckpointer()
  tree = ckptr.metadata(directory).item_metadata.tree
  sub = "params" in tree and "opt_state" in tree
  meta = tree["params"] if sub else tree
  abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), meta)
  rargs = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), abstract)
  if sub:
    out = ckptr.restore(directory, args=ocp.args.PyTreeRestore(
        item={"params": abstract}, restore_args={"params": rargs}, partial_restore=True))
    return out["params"]
  return ckptr.restore(directory, args=ocp.args.PyTreeRestore(item=abstract,
                                                                restore_args=rargs))


def read_params(src: Source) -> dict:
  """The source's parameters as a nested dict of float32 numpy arrays."""
  try:
    if src.kind == "hf":
      return hf.load_hf(src.path)[1]
    if src.kind == "converted":
      return _restore_params((src.path / "params").absolute())
    return _restore_params((src.path / "state").absolute())
  except hf.ConversionError:
    raise
  except (ValueError, KeyError, OSError) as e:
    raise SourceError(f"parameters of {str(src.path)!r} cannot be read: {e}") from None


def with_architecture(section: dict) -> dict:
  """A model section with ``init_from``: every architecture field it does not set taken from
  the source (the source's config is read, no tensors), so the run's recorded config names
  the whole architecture and resumes without the source. Fields the section sets stay; where
  they differ from the source, ``check_matches`` refuses them."""
  path = section.get("init_from")
  missing = [f for f in architecture_fields() if f not in section] if path else []
  if not missing:
    return section
  src = open_source(path)
  vals = {f: getattr(src.cfg, f) for f in missing}
  return {**section, **{k: list(v) if isinstance(v, tuple) else v for k, v in vals.items()}}


def check_matches(src: Source, cfg: models.ModelConfig) -> None:
  """Raises SourceError naming every architecture field that differs from the source's (the
  model section set them; the others come from the source, ``with_architecture``)."""
  diff = [(f, getattr(cfg, f), getattr(src.cfg, f)) for f in architecture_fields()
          if getattr(cfg, f) != getattr(src.cfg, f)]
  if diff:
    raise SourceError("; ".join(f"model.{f}={a!r}, but model.init_from={str(src.path)!r} has "
                                f"{b!r}" for f, a, b in diff)
                      + " (leave these keys out to take the source's values)")


def init_params(path: str, cfg: models.ModelConfig, shardings: Any) -> Any:
  """The parameters of ``path`` placed with ``shardings`` (a tree like the parameters)."""
  src = open_source(path)
  check_matches(src, cfg)
  try:
    params = read_params(src)
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i: np.asarray(x[i],
                                                                                  np.float32)),
        params, shardings)
  except SourceError:
    raise
  except (hf.ConversionError, ValueError) as e:
    raise SourceError(f"parameters of {path!r} do not fit the model: {e}") from None


def import_hf(hf_dir: str | pathlib.Path, out: str | pathlib.Path) -> models.ModelConfig:
  """Writes a converted directory (module docstring) from a Hugging Face directory."""
  import orbax.checkpoint as ocp
  cfg, params = hf.load_hf(hf_dir)
  out = pathlib.Path(out).absolute()
  if (out / "params").exists():
    raise SourceError(f"{str(out)!r} already holds converted parameters; choose another --out")
  out.mkdir(parents=True, exist_ok=True)
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(out / "params", params)
  ckptr.wait_until_finished()
  (out / "model.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
  _copy_extras(pathlib.Path(hf_dir), out / "hf")
  return cfg


def _copy_extras(src: pathlib.Path, dst: pathlib.Path) -> None:
  dst.mkdir(parents=True, exist_ok=True)
  for name in HF_EXTRAS:
    if (src / name).is_file():
      shutil.copyfile(src / name, dst / name)


BYTES_NOTE = """# Tokenizer

This model was trained on UTF-8 bytes: token id = byte value (0-255), no merges, so there is
no `tokenizer.json`. Encode with `list(text.encode("utf-8"))`, decode with
`bytes(ids).decode("utf-8", "replace")`. Id {sep} separates documents (`bos_token_id` and
`eos_token_id` in config.json): put it before a prompt, stop generating at it.
"""


def _run_tokenizer(run_dir: pathlib.Path, out: pathlib.Path) -> dict:
  """The tokenizer a run trained with, into an export: its ``tokenizer.json`` copied (a
  Hugging Face tokenizer), or ``TOKENIZER.md`` (bytes, or a tokenizer file no longer found).
  Returns the config.json fields it fixes: the document separator as ``bos_token_id`` and
  ``eos_token_id`` (the token before every document and after it)."""
  from scaleopt.train import identity
  tok = (identity.read(run_dir) or {}).get("tokenizer")
  if tok is None:  # a run from before data.json: its config's data section
    d = config_lib.saved_section(run_dir, "data")
    tok = ({"name": "bytes", "file": None, "separator": 0} if d.source == "embedded"
           else identity.tokenizer_record(pathlib.Path(d.path).resolve()))
  out.mkdir(parents=True, exist_ok=True)
  sep = tok.get("separator")
  if tok.get("file") and pathlib.Path(tok["file"]).is_file():
    shutil.copyfile(tok["file"], out / "tokenizer.json")
  elif tok.get("name") == "bytes":
    (out / "TOKENIZER.md").write_text(BYTES_NOTE.format(sep=sep))
  else:
    (out / "TOKENIZER.md").write_text(
        f"# Tokenizer\n\nThe run trained with the tokenizer {tok.get('name')!r} from "
        f"{tok.get('file')!r}, which is no longer there; copy its tokenizer.json here.\n")
  return {} if sep is None else {"bos_token_id": int(sep), "eos_token_id": int(sep)}


def _trained_seq_len(run_dir: pathlib.Path) -> Optional[int]:
  d = config_lib.saved_section(run_dir, "data")
  return None if d is None else d.seq_len


def export_hf(source: str | pathlib.Path, out: str | pathlib.Path, step: Optional[int] = None,
              dtype: str = "float32") -> models.ModelConfig:
  """Writes a Hugging Face directory (config.json, model.safetensors, tokenizer files). From
  a run: its tokenizer (``_run_tokenizer``), bos/eos ids and ``max_position_embeddings`` =
  the trained ``data.seq_len``."""
  src = open_source(source, step)
  params = read_params(src)
  out = pathlib.Path(out)
  base, cfg = None, src.cfg
  if src.hf_dir is not None:
    if out.absolute() != src.hf_dir.absolute():
      _copy_extras(src.hf_dir, out)
    if (src.hf_dir / "config.json").is_file():
      base = json.loads((src.hf_dir / "config.json").read_text())
  if src.run_dir is not None:
    base = {**(base or {}), **_run_tokenizer(src.run_dir, out)}
    cfg = dataclasses.replace(cfg, max_seq_len=_trained_seq_len(src.run_dir) or cfg.max_seq_len)
  hf.save_hf(out, cfg, params, base_config=base, dtype=dtype)
  return cfg


def convert_main(direction: str, src: str, out: str, step: Optional[int] = None,
                 dtype: str = "float32") -> int:
  """``scaleopt convert import|export``; 0 on success, 2 on bad input (one-line error)."""
  try:
    if direction == "import":
      cfg = import_hf(src, out)
    else:
      cfg = export_hf(src, out, step, dtype)
  except (SourceError, hf.ConversionError, ValueError, OSError, KeyError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {out}: {cfg.n_layers} layers x {cfg.d_model}, vocab {cfg.vocab_size}, "
        f"{models.count_params(cfg):,} parameters")
  return 0
