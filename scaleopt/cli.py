"""The one command line of scaleopt.

  scaleopt train --config NAME_OR_YAML --out RUN_DIR [--set a.b=v ...] [--resume]
                 [--print-config] [--dry-run]
  scaleopt sweep --config NAME_OR_YAML --out DIR [--set a.b=v ...]
  scaleopt study --config NAME_OR_YAML --out DIR [--set a.b=v ...] [--cells GLOB ...]
                 [--max-minutes M] [--shard i/n] [--claim TOKEN] [--report-only] [--list]
  scaleopt data prepare --input FILE_OR_DIR --out DIR [--tokenizer bytes|bpe:VOCAB|tokenizer.json]
                        [--text-field text] [--val-fraction 0.05] [--include GLOB ...]
                        [--skip-bad-records [--max-bad-records N]]
  scaleopt convert import --hf HF_DIR --out PARAMS_DIR      (Qwen2/Llama safetensors -> Orbax)
  scaleopt convert export --from RUN_OR_PARAMS_DIR --out HF_DIR [--step N] [--dtype bfloat16]
  scaleopt bias-study [--out results/bias_reduction.md]
  scaleopt run-default --out results        (what `make run` runs)

--config takes a file or a shipped config's name (`tiny`, `optim/adamw`, `small`,
`studies/bc_tiny`; see scaleopt/config.py). Subcommands import their package lazily so that
`scaleopt --help` is instant. Bad input (config, data, paths, a full disk) ends with one line
`error: ...` on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import pathlib
import sys


def _config(args: argparse.Namespace, kind: str) -> str | None:
  """``args.config`` resolved to a file (a path, or a shipped config's name); None after
  printing the one-line error."""
  from scaleopt.config import ConfigError, resolve_config
  try:
    return str(resolve_config(args.config, kind))
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return None


def _print_config(path: str, overrides: list[str]) -> int:
  import dataclasses

  import yaml

  from scaleopt.config import to_dict
  from scaleopt.train.bridge import with_source_architecture
  from scaleopt.train.config import ConfigError, load_config
  try:  # a model.init_from source's architecture is read as the trainer would
    cfg = with_source_architecture(load_config(path, overrides))
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"# resolved from {path}" + (f" with {' '.join(overrides)}" if overrides else ""))
  print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
  built = to_dict(dataclasses.asdict(cfg.model.config))
  print("# the model as built (scaleopt.models.ModelConfig: preset, variant, overrides):")
  print("".join(f"#   {l}\n" for l in yaml.safe_dump(built, sort_keys=False).splitlines()),
        end="")
  return 0


def _train(args: argparse.Namespace) -> int:
  from scaleopt.train.mesh import set_launch_xla_flags
  set_launch_xla_flags()  # before JAX starts a backend
  from scaleopt.train.main import train_main

  args.config = _config(args, "train")
  if args.config is None:
    return 2
  if args.print_config:
    return _print_config(args.config, args.set)
  if not args.out:
    print("error: scaleopt train needs --out RUN_DIR (or --print-config)", file=sys.stderr)
    return 2
  return train_main(args.config, args.out, overrides=args.set, resume=args.resume,
                    dry_run=args.dry_run) or 0


def _sweep(args: argparse.Namespace) -> int:
  from scaleopt.scaling.sweep import sweep_main

  args.config = _config(args, "sweep")
  if args.config is None:
    return 2
  return sweep_main(args.config, args.out, overrides=args.set) or 0


def _study(args: argparse.Namespace) -> int:
  from scaleopt.train.mesh import set_launch_xla_flags
  set_launch_xla_flags()  # its cells are training runs: the same flags as `scaleopt train`
  from scaleopt.study.runner import study_main

  args.config = _config(args, "study")
  if args.config is None:
    return 2
  return study_main(args.config, args.out, overrides=args.set, cells=args.cells,
                    max_minutes=args.max_minutes, shard=args.shard,
                    report_only=args.report_only, list_only=args.list,
                    claim=args.claim) or 0


def _data_prepare(args: argparse.Namespace) -> int:
  from scaleopt.train.data import prepare_main

  return prepare_main(args.input, args.out, tokenizer=args.tokenizer, text_field=args.text_field,
                      val_fraction=args.val_fraction, shard_tokens=args.shard_tokens,
                      include=tuple(args.include), bpe_sample_mb=args.bpe_sample_mb,
                      progress=not args.quiet, skip_bad_records=args.skip_bad_records,
                      max_bad_records=args.max_bad_records, dedup=args.dedup) or 0


def _convert(args: argparse.Namespace) -> int:
  from scaleopt.train.convert import convert_main

  if args.direction == "import":
    return convert_main("import", args.hf, args.out) or 0
  return convert_main("export", args.source, args.out, step=args.step, dtype=args.dtype) or 0


def _bias_study(args: argparse.Namespace) -> int:
  from scaleopt.optim import bias_study

  return bias_study.main(["--out", args.out] + (["--quick"] if args.quick else [])
                        + (["--trials", str(args.trials)] if args.trials else [])) or 0


def _run_default(args: argparse.Namespace) -> int:
  """The main job on the embedded default: every capability that has landed, small."""
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  ran = []
  try:
    from scaleopt.train.demo import run_default as train_demo
  except ImportError:
    train_demo = None
  if train_demo is not None:
    train_demo(out)
    ran.append("train")
  try:
    from scaleopt.scaling.demo import run_default as sweep_demo
  except ImportError:
    sweep_demo = None
  if sweep_demo is not None:
    sweep_demo(out)
    ran.append("sweep")
  from scaleopt.optim import bias_study

  bias_study.main(["--out", str(out / "bias_reduction.md"), "--quick"])
  ran.append("bias-study")
  print(f"\nmake run finished: {', '.join(ran)}; outputs in {out}/")
  return 0


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="scaleopt", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)

  t = sub.add_parser("train", help="pretrain a language model from a config file")
  t.add_argument("--config", required=True, help="a YAML file or a shipped config's name, "
                 "e.g. tiny, tiny_adamw_bc, gpt2-small (configs/train/)")
  t.add_argument("--out", help="run directory (required unless --print-config)")
  t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                 help="dotted override, e.g. --set optimizer.learning_rate=3e-4 (repeatable)")
  t.add_argument("--resume", action="store_true", help="continue from RUN_DIR's last checkpoint")
  t.add_argument("--print-config", action="store_true",
                 help="print the resolved config (file + overrides + defaults) and exit")
  t.add_argument("--dry-run", action="store_true",
                 help="check config, data, --out and the traced step; train and write nothing")
  t.set_defaults(fn=_train)

  s = sub.add_parser("sweep", help="run a scaling-exponent sweep from a config file")
  s.add_argument("--config", required=True, help="a YAML file or a shipped sweep's name "
                 "(small, paper)")
  s.add_argument("--out", required=True)
  s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  s.set_defaults(fn=_sweep)

  st = sub.add_parser("study", help="run a study (arms x learning rates x seeds) and report it")
  st.add_argument("--config", required=True, help="a YAML file or a shipped study's name "
                  "(e.g. bc_tiny)")
  st.add_argument("--out", required=True)
  st.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                  help="study override, e.g. seeds=[0,1,2] or run.steps=100 (repeatable)")
  st.add_argument("--cells", nargs="+", default=None, metavar="GLOB",
                  help="only cells whose id matches, e.g. 'adamw_bc/*'")
  st.add_argument("--max-minutes", type=float, default=None,
                  help="checkpoint and stop after this long (rerun to continue)")
  st.add_argument("--shard", default=None, metavar="i/n", help="this machine's share of the "
                  "conditions (arm x grid point): condition k runs where k mod n == i")
  st.add_argument("--claim", default=None, metavar="TOKEN", help="one of several workers "
                  "sharing --out on one machine (one per GPU): take whole conditions (single "
                  "cells with the loop engine), claimed under DIR/claims/TOKEN; give every "
                  "worker of one launch the same TOKEN "
                  "(and a new TOKEN to the next launch)")
  st.add_argument("--report-only", action="store_true", help="rebuild the report, train nothing")
  st.add_argument("--list", action="store_true", help="print the cells left, train nothing")
  st.set_defaults(fn=_study)

  d = sub.add_parser("data", help="data utilities")
  dsub = d.add_subparsers(dest="data_command", required=True)
  dp = dsub.add_parser("prepare", help="tokenize text, JSONL, Parquet or Arrow into token "
                       "shards (rerun the same command to continue an interrupted one)")
  dp.add_argument("--input", required=True, help="a file or folder: text (.gz, .zst), "
                  ".jsonl/.ndjson (.gz, .zst), .parquet, .arrow (a datasets.save_to_disk folder)")
  dp.add_argument("--out", required=True, help="local folder for the shards")
  dp.add_argument("--text-field", default="text",
                  help="JSONL field / Parquet and Arrow column holding the text (default: text)")
  dp.add_argument("--val-fraction", type=float, default=0.05,
                  help="share of documents held out, chosen by a hash of each (default 0.05)")
  dp.add_argument("--include", action="append", default=[], metavar="GLOB",
                  help="read only files whose name matches, e.g. '*.py' (repeatable)")
  dp.add_argument("--shard-tokens", type=int, default=1 << 28,
                  help="training tokens per shard (and per restart point; default 2**28)")
  dp.add_argument("--bpe-sample-mb", type=float, default=None,
                  help="train bpe:VOCAB on about this much training text, sampled across the "
                  "inputs (default: all of it)")
  dp.add_argument("--dedup", nargs="?", type=float, const=0.8, default=None, metavar="SHARE",
                  help="keep near-duplicate documents (sharing >= SHARE of their lines, default "
                  "0.8) on one side of the split (MinHash LSH; needs datasketch)")
  dp.add_argument("--quiet", action="store_true", help="no progress lines")
  dp.add_argument("--skip-bad-records", action="store_true",
                  help="leave out records that cannot be read (a JSONL line that is not a JSON "
                  "object, a text field that is missing, null or not a string), counted in the "
                  "summary and manifest.json, instead of stopping at the first")
  dp.add_argument("--max-bad-records", type=int, default=None, metavar="N",
                  help="with --skip-bad-records: stop once more than N records were left out "
                  "(default 1000)")
  dp.add_argument("--tokenizer", default="bytes",
                  help="bytes | bpe:VOCAB_SIZE (train a byte-level BPE on the training split) | "
                  "PATH/tokenizer.json[#SEPARATOR_TOKEN] (e.g. Qwen2.5's); default: bytes "
                  "(one token per UTF-8 byte, vocabulary 256)")
  dp.set_defaults(fn=_data_prepare)

  c = sub.add_parser("convert", help="Hugging Face safetensors <-> scaleopt parameters")
  csub = c.add_subparsers(dest="direction", required=True)
  ci = csub.add_parser("import", help="a Qwen2/Llama safetensors directory -> Orbax params")
  ci.add_argument("--hf", required=True, help="directory with config.json and *.safetensors")
  ci.add_argument("--out", required=True)
  ci.set_defaults(fn=_convert)
  ce = csub.add_parser("export", help="a run, checkpoint or converted directory -> safetensors")
  ce.add_argument("--from", dest="source", required=True,
                  help="run directory, RUN/checkpoints/N, or a `convert import` directory")
  ce.add_argument("--out", required=True,
                  help="the Hugging Face folder to write (config.json, model.safetensors, "
                  "tokenizer files): a new or empty folder, or an earlier export, which is "
                  "replaced as a whole")
  ce.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  ce.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  ce.set_defaults(fn=_convert)

  b = sub.add_parser("bias-study", help="measure the bias of std/cf/inv/full updates")
  b.add_argument("--out", default="results/bias_reduction.md")
  b.add_argument("--quick", action="store_true")
  b.add_argument("--trials", type=int, default=None, help="Monte Carlo trials per row")
  b.set_defaults(fn=_bias_study)

  r = sub.add_parser("run-default", help="what `make run` runs")
  r.add_argument("--out", default="results")
  r.set_defaults(fn=_run_default)
  return p


def _is_user_error(e: BaseException) -> bool:
  """Errors that name a bad input or a full / read-only disk rather than a bug."""
  from scaleopt.train.checkpoint import CheckpointError
  from scaleopt.train.config import ConfigError
  from scaleopt.train.data import DataError
  return isinstance(e, (ConfigError, DataError, CheckpointError, OSError))


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    return args.fn(args)
  except Exception as e:  # a user error no subcommand reported itself: one line, exit 2
    if not _is_user_error(e):
      raise
    print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
