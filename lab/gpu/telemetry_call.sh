#!/usr/bin/env bash
# One device call: which setting lets telemetry run at bc_paper_gpt2's step on a GPU. With
# run.telemetry_every set, the decisive study's first cell (gpt2-small, 512 x 1024 tokens as 64
# microbatches of 8) died on one H100 (jax 0.11.2) at its first step, once with a segmentation
# fault and twice with "INTERNAL: detail::cuda_graph_end_capture(fake_stream, &graph_obj)
# failed with capturing stream has unjoined work ... cuda_dnn.cc ... graph.deserialize", also
# with XLA_FLAGS=--xla_gpu_enable_command_buffer=; the same cell without telemetry trained, and
# telemetry at 64 x 1024 tokens (8 microbatches of 8) ran. Since then the trainer copies no
# batch while a program runs for the first time (prefetch.Prefetch.quiet: the suspected cause is
# a batch copy joining cuDNN's stream capture as it loads a graph); `default` tests that, and
# `no_quiet` is the same run with quiet() made a no-op (NO_QUIET=1, patched in this script).
# Each variant below trains 12 steps (telemetry on steps 5 and 10; one-pass LOO unless named)
# in its own process, in order of what they decide, while at least 160 s of SECONDS_MAX (default 560) are left, and prints its
# last lines; from the repo root:
#   [DATA="--set data.source=shards --set data.path=runs/corpus_dedup
#          --set model.vocab_size=32768"] OUT=$OUT bash lab/gpu/telemetry_call.sh
# (DATA defaults to the embedded corpus). Results go to $OUT/telemetry.log.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-/tmp/telemetry_call}
mkdir -p "$out" runs
base="--set data.seq_len=1024 --set data.batch_size=512 --set data.microbatches=64
  --set model.wd_policy=all --set run.steps=12 --set run.log_every=5 --set run.eval_every=0
  --set run.eval_tokens=0 --set run.progress=false --set run.tensorboard=false
  --set run.plot=false --set run.checkpoint_every=0 ${DATA:-}"
loo="--set optimizer.name=adamw_bc --set optimizer.extra.mode=full
  --set optimizer.extra.crossfit=loo"
start=$(date +%s)
launch='import contextlib, os, sys
from scaleopt import cli
from scaleopt.train import prefetch
if os.environ.get("NO_QUIET") == "1":
  prefetch.Prefetch.quiet = lambda self: contextlib.nullcontext()
sys.exit(cli.main(sys.argv[1:]))'
variant() {  # $1 name, then --set arguments
  local name=$1; shift
  local left=$(( ${SECONDS_MAX:-560} - ($(date +%s) - start) ))
  [ "$left" -ge 160 ] || { echo "== $name: skipped ($left s left)" | tee -a "$out/telemetry.log"
    return; }
  echo "== $name: $*" | tee -a "$out/telemetry.log"
  rm -rf "runs/telemetry_$name"
  timeout 150 python -c "$launch" train --config gpt2-small --out "runs/telemetry_$name" \
    $base "$@" 2>&1 | grep -v "^step" | tail -4 | cut -c1-400 | tee -a "$out/telemetry.log"
}
nvidia-smi -L > "$out/telemetry.log"
variant default $loo --set run.telemetry_every=5
NO_QUIET=1 variant no_quiet $loo --set run.telemetry_every=5
variant one_program $loo --set run.telemetry_every=5 --set run.host_phases=off
variant adamw --set optimizer.name=adamw --set run.telemetry_every=5
variant adamw_one_program --set optimizer.name=adamw --set run.telemetry_every=5 \
  --set run.host_phases=off
variant xla_attention $loo --set run.telemetry_every=5 --set model.attention_impl=xla
variant control $loo --set run.telemetry_every=0
