#!/usr/bin/env bash
# SOAP on the H200 (docs/results.md, "SOAP on the H200"): one device call that runs variants
# meant to separate causes of failure or slowness, each a short `scaleopt train` of the
# bc_paper_gpt2 SOAP arm's step (gpt2-small shapes, vocabulary 32,768, 512 x 1024 tokens as
# 64 microbatches of 8; 12 steps: the first basis refresh by QR is logged as step 11) on the embedded
# corpus (the study reads shards), and the benchmark's stand-in with every step's time printed.
# The environment is a study worker's: no launcher XLA flags (SCALEOPT_XLA_DEFAULTS=0, as the
# study's cells ran). JAX_LOG_COMPILES=1 logs every compile and persistent-cache hit.
#   RUNS="name ..." [STEPS=12] OUT=$OUT bash lab/gpu/soap_gpu_check.sh [SECONDS_PER_RUN]   (default 240)
# Runs (RUNS, default all, in this order):
#   adamw_control        AdamW at the same step (cache C0)
#   soap_study_env       the study's SOAP arm with a persistent cache (C1)
#   soap_study_env_twice soap_study_env twice in a row on one cache (the second: a resumed
#                        cell's start, reading the cache the first wrote)
#   soap_no_cache        no persistent cache
#   soap_device_phases   run.host_phases=off: one program, the refresh as a device branch
#   soap_xla_attention   model.attention_impl=xla
#   soap_bc              SOAP-BC, LOO + Jensen
#   stand_in_jit         benchmarks/optim_step_cost.py --configs soap, the jitted call
#   stand_in_aot         the same as the ahead-of-time executable
#   stand_in_no_cmdbuf   stand_in_jit with XLA_FLAGS=--xla_gpu_enable_command_buffer=
# Run i goes to GPU i mod n (CUDA_VISIBLE_DEVICES's
# GPUs if set, else all); each GPU runs its share in order. $OUT: lane<g>.log per GPU and
# summary.txt (one line per run: exit code, steps logged).
set -uo pipefail
per=${1:-240}
[[ $per =~ ^[0-9]+$ ]] || { echo "SECONDS_PER_RUN=$per is not a number of seconds" >&2; exit 2; }
all="adamw_control soap_study_env soap_study_env_twice soap_no_cache soap_device_phases
     soap_xla_attention soap_bc stand_in_jit stand_in_aot stand_in_no_cmdbuf"
read -ra known <<< "$(tr '\n' ' ' <<< "$all")"
read -ra runs <<< "${RUNS:-${known[*]}}"
for r in "${runs[@]}"; do
  [[ " ${known[*]} " == *" $r "* ]] || { echo "RUNS: unknown run '$r' (one of: ${known[*]})" >&2; exit 2; }
done
[ "$(printf '%s\n' "${runs[@]}" | sort | uniq -d)" = "" ] || { echo "RUNS: a run is named twice" >&2; exit 2; }
export PYTHONPATH=. SCALEOPT_XLA_DEFAULTS=0 JAX_LOG_COMPILES=1 PYTHONUNBUFFERED=1
out=${OUT:-/tmp/soap_check}
mkdir -p "$out" runs/soap_check
rm -rf runs/soap_check/*  # every variant starts on an empty cache and output folder
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then  # the caller's GPUs (e.g. beside a study)
  IFS=',' read -ra gpus <<< "$CUDA_VISIBLE_DEVICES"
else
  read -ra gpus <<< "$(seq -s ' ' 0 $(( $(nvidia-smi -L 2>/dev/null | grep -c '^GPU') - 1 )))"
fi
[ "${#gpus[@]}" -ge 1 ] || gpus=(0)
n=${#gpus[@]}
STEP=(--set model.vocab_size=32768 --set model.wd_policy=all --set data.seq_len=1024
      --set data.batch_size=512 --set data.microbatches=64 --set run.steps=${STEPS:-12}
      --set run.log_every=1 --set run.eval_every=0 --set run.checkpoint_every=0
      --set run.progress=false --set run.tensorboard=false --set optimizer.schedule.warmup_steps=2
      --set optimizer.schedule.min_lr_ratio=0.0)
C=runs/soap_check/cache
S=(--set optimizer.name=soap --set optimizer.b1=0.95)  # the study's SOAP arm

train() {  # gpu log name cache-dir|- overrides...: one run, appended to log
  local gpu=$1 log=$2 name=$3 cache=$4
  shift 4
  local env=(env -u JAX_COMPILATION_CACHE_DIR CUDA_VISIBLE_DEVICES="$gpu")
  [ "$cache" = - ] || env+=(JAX_COMPILATION_CACHE_DIR="$cache")
  echo "== $name (cache: $cache) $(date +%T)" >> "$log"
  # -k: the trainer takes a first SIGTERM as "checkpoint and stop", which a hung step ignores
  "${env[@]}" timeout -k 20 "$per" python -m scaleopt.cli train --config gpt2-small \
    --out "runs/soap_check/$name" "${STEP[@]}" "$@" >> "$log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $(sed -n "/^== $name /,\$p" "$log" | grep -c '^step') logged steps" \
    >> "$out/summary.txt"
}

stand_in() {  # gpu log name flags...: the benchmark's SOAP step alone
  local gpu=$1 log=$2 name=$3
  shift 3
  echo "== $name $(date +%T)" >> "$log"
  env CUDA_VISIBLE_DEVICES="$gpu" "$@" timeout -k 20 "$per" python \
    benchmarks/optim_step_cost.py --configs soap --steps 20 --print-steps \
    $([ "$name" = stand_in_aot ] && echo --aot) >> "$log" 2>&1
  echo "$name: exit $? after $(sed -n "/^== $name /,\$p" "$log" | grep -c ': step') steps" \
    >> "$out/summary.txt"
}

one() {  # name gpu log
  local g=$2 l=$3
  case $1 in
    adamw_control) train "$g" "$l" "$1" "${C}0" --set optimizer.name=adamw ;;
    soap_study_env) train "$g" "$l" "$1" "${C}1" "${S[@]}" ;;
    soap_study_env_twice) train "$g" "$l" "$1" "${C}2" "${S[@]}"
                          train "$g" "$l" "${1}_again" "${C}2" "${S[@]}" ;;
    soap_no_cache) train "$g" "$l" "$1" - "${S[@]}" ;;
    soap_device_phases) train "$g" "$l" "$1" "${C}3" "${S[@]}" --set run.host_phases=off ;;
    soap_xla_attention) train "$g" "$l" "$1" "${C}4" "${S[@]}" --set model.attention_impl=xla ;;
    soap_bc) train "$g" "$l" "$1" "${C}6" --set optimizer.name=soap_bc --set optimizer.b1=0.95 \
               --set optimizer.extra.mode=full --set optimizer.extra.crossfit=loo ;;
    stand_in_jit|stand_in_aot) stand_in "$g" "$l" "$1" ;;
    stand_in_no_cmdbuf) stand_in "$g" "$l" "$1" XLA_FLAGS=--xla_gpu_enable_command_buffer= ;;
  esac
}

: > "$out/summary.txt"
{ nvidia-smi -L; python -c "import jax; print('jax', jax.__version__)"; } >> "$out/summary.txt" 2>&1
for ((g = 0; g < n && g < ${#runs[@]}; g++)); do
  ( for ((i = g; i < ${#runs[@]}; i += n)); do
      one "${runs[$i]}" "${gpus[$g]}" "$out/lane$g.log"
    done ) &
done
wait
cat "$out/summary.txt"
