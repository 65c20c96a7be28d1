#!/usr/bin/env bash
# Why SOAP stops on the H200 (docs/results.md, "SOAP on the H200"): one device call that runs
# the variants separating the suspects, one variant per GPU (round-robin over the GPUs when
# there are fewer), each a short `scaleopt train` of the bc_paper_gpt2 SOAP arm's step
# (gpt2-small shapes, vocabulary 32,768, 512 x 1024 tokens as 64 microbatches of 8) on the
# embedded corpus, 12 steps (the first basis refresh by QR is step 10), then the benchmark's
# stand-in with every step's time printed. From the repo root of the device's copy:
#   OUT=$OUT bash lab/gpu/soap_gpu_check.sh [SECONDS_PER_VARIANT]   (default 200)
# $OUT/<variant>.log holds each variant's log; $OUT/summary.txt the last line of each.
set -uo pipefail
per=${1:-200}
[[ $per =~ ^[0-9]+$ ]] || { echo "SECONDS_PER_VARIANT=$per is not a number of seconds" >&2; exit 2; }
export PYTHONPATH=.
out=${OUT:-/tmp/soap_check}
mkdir -p "$out" runs/soap_check
n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "$n" -ge 1 ] || n=1
STEP=(--set model.vocab_size=32768 --set model.wd_policy=all --set data.seq_len=1024
      --set data.batch_size=512 --set data.microbatches=64 --set run.steps=12
      --set run.log_every=1 --set run.eval_every=0 --set run.checkpoint_every=0
      --set run.progress=false --set optimizer.b1=0.95 --set optimizer.schedule.warmup_steps=2
      --set optimizer.schedule.min_lr_ratio=0.0)
# name | extra environment | extra overrides
VARIANTS=(
  "soap||--set optimizer.name=soap"
  "soap_xla_attention||--set optimizer.name=soap --set model.attention_impl=xla"
  "soap_device_phases||--set optimizer.name=soap --set run.host_phases=off"
  "soap_no_lhs|XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=false|--set optimizer.name=soap"
  "adamw_control||--set optimizer.name=adamw"
  "soap_bc||--set optimizer.name=soap_bc --set optimizer.extra.mode=full --set optimizer.extra.crossfit=loo"
)

run_variant() {  # gpu "name|env|overrides"
  local gpu=$1 name env sets
  IFS='|' read -r name env sets <<< "$2"
  rm -rf "runs/soap_check/$name"
  # shellcheck disable=SC2086  # env and sets are word lists
  env CUDA_VISIBLE_DEVICES="$gpu" $env timeout "$per" python -m scaleopt.cli train \
    --config gpt2-small --out "runs/soap_check/$name" "${STEP[@]}" $sets \
    > "$out/$name.log" 2>&1
  echo "$name: exit $? after $(grep -c '^step' "$out/$name.log") logged steps" >> "$out/summary.txt"
}

: > "$out/summary.txt"
for ((g = 0; g < n; g++)); do
  ( for ((i = g; i < ${#VARIANTS[@]}; i += n)); do run_variant "$g" "${VARIANTS[$i]}"; done ) &
done
wait
CUDA_VISIBLE_DEVICES=0 timeout "$per" python benchmarks/optim_step_cost.py --configs soap \
  --steps 20 --print-steps > "$out/stand_in.log" 2>&1
echo "stand_in: exit $?" >> "$out/summary.txt"
cat "$out/summary.txt"
