#!/usr/bin/env bash
# Why SOAP stops on the H200 (docs/results.md, "SOAP on the H200"): one device call that runs
# the variants separating the suspects, one variant per GPU (round-robin over the GPUs when
# there are fewer), each a short `scaleopt train` of the bc_paper_gpt2 SOAP arm's step
# (gpt2-small shapes, vocabulary 32,768, 512 x 1024 tokens as 64 microbatches of 8) on the
# embedded corpus, 3 steps (12 for the variants in the studies' setting: the first basis
# refresh by QR is step 10; fewer steps, fewer host-picked programs to compile), and the benchmark's
# stand-in with every step's time printed (the jitted call, then the ahead-of-time executable).
# The environment is a study worker's: no launcher XLA flags (SCALEOPT_XLA_DEFAULTS=0, as
# `scaleopt study` runs cells); the data are the embedded corpus, not the study's shards.
# From the repo root of the device's copy; with 4 GPUs it takes about 2 x SECONDS_PER_VARIANT
# (7 jobs round-robin); fewer GPUs need more calls' time (1 GPU: 7 x):
#   OUT=$OUT bash lab/gpu/soap_gpu_check.sh [SECONDS_PER_VARIANT]   (default 270)
# $OUT/<variant>.log holds each variant's log (7 files); $OUT/summary.txt a line for each.
set -uo pipefail
per=${1:-270}
[[ $per =~ ^[0-9]+$ ]] || { echo "SECONDS_PER_VARIANT=$per is not a number of seconds" >&2; exit 2; }
export PYTHONPATH=. SCALEOPT_XLA_DEFAULTS=0
out=${OUT:-/tmp/soap_check}
mkdir -p "$out" runs/soap_check
rm -rf runs/soap_check/cache*  # every variant starts on an empty cache (variant 5: variant 1's)
n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "$n" -ge 1 ] || n=1
STEP=(--set model.vocab_size=32768 --set model.wd_policy=all --set data.seq_len=1024
      --set data.batch_size=512 --set data.microbatches=64 --set run.steps=3
      --set run.log_every=1 --set run.eval_every=0 --set run.checkpoint_every=0
      --set run.progress=false --set optimizer.schedule.warmup_steps=2
      --set optimizer.schedule.min_lr_ratio=0.0)
# name | extra environment | extra overrides. The studies' workers set a persistent compilation
# cache (JAX_COMPILATION_CACHE_DIR); variant 5 runs variant 1 again on its filled cache (a
# resumed cell). Round-robin: with 4 GPUs, 0 and 4 share GPU 0, 1 and 5 GPU 1, 2 and the
# stand-in GPU 2 (with 1, 2 or 4 GPUs variant 5 runs after variant 1).
C=runs/soap_check/cache
S="--set optimizer.name=soap --set optimizer.b1=0.95"  # the study's SOAP arm
VARIANTS=(
  "adamw_control|JAX_COMPILATION_CACHE_DIR=${C}0|--set optimizer.name=adamw"
  "soap_study_env|JAX_COMPILATION_CACHE_DIR=${C}1|$S --set run.steps=12"
  "soap_no_cache||$S"
  "soap_device_phases|JAX_COMPILATION_CACHE_DIR=${C}3|$S --set run.host_phases=off"
  "soap_xla_attention|JAX_COMPILATION_CACHE_DIR=${C}4|$S --set model.attention_impl=xla"
  "soap_study_env_again|JAX_COMPILATION_CACHE_DIR=${C}1|$S --set run.steps=12"
  "stand_in|"
)

run_variant() {  # gpu "name|env|overrides"
  local gpu=$1 name env sets
  IFS='|' read -r name env sets <<< "$2"
  if [ "$name" = stand_in ]; then  # the benchmark's stand-in: the jitted call, then AOT
    { CUDA_VISIBLE_DEVICES="$gpu" timeout -k 20 "$per" python benchmarks/optim_step_cost.py \
        --configs soap --steps 20 --print-steps
      echo "== --aot"
      CUDA_VISIBLE_DEVICES="$gpu" timeout -k 20 "$per" python benchmarks/optim_step_cost.py \
        --configs soap --steps 20 --print-steps --aot; } > "$out/$name.log" 2>&1
    echo "$name: exit $?" >> "$out/summary.txt"
    return
  fi
  rm -rf "runs/soap_check/$name"
  # shellcheck disable=SC2086  # env and sets are word lists
  # -k: the trainer takes a first SIGTERM as "checkpoint and stop", which a hung step ignores
  env CUDA_VISIBLE_DEVICES="$gpu" $env timeout -k 20 "$per" python -m scaleopt.cli train \
    --config gpt2-small --out "runs/soap_check/$name" "${STEP[@]}" $sets \
    > "$out/$name.log" 2>&1
  echo "$name: exit $? after $(grep -c '^step' "$out/$name.log") logged steps" >> "$out/summary.txt"
}

: > "$out/summary.txt"
for ((g = 0; g < n; g++)); do
  ( for ((i = g; i < ${#VARIANTS[@]}; i += n)); do run_variant "$g" "${VARIANTS[$i]}"; done ) &
done
wait
cat "$out/summary.txt"
