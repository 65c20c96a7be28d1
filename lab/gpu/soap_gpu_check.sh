#!/usr/bin/env bash
# Why SOAP stops on the H200 (docs/results.md, "SOAP on the H200"): one device call that runs
# variants meant to separate the suspected causes, each a short `scaleopt train` of the
# bc_paper_gpt2 SOAP arm's step (gpt2-small shapes, vocabulary 32,768, 512 x 1024 tokens as
# 64 microbatches of 8; 12 steps: the first basis refresh by QR is step 10) on the embedded
# corpus (the study reads shards), and the benchmark's stand-in with every step's time printed
# (the jitted call, then the ahead-of-time executable). The environment is a study worker's:
# no launcher XLA flags (SCALEOPT_XLA_DEFAULTS=0, as the study's cells ran). JAX_LOG_COMPILES=1
# logs every compile and persistent-cache hit.
#   OUT=$OUT bash lab/gpu/soap_gpu_check.sh [SECONDS_PER_RUN]   (default 240)
# Four lanes of at most two runs each (the stand-in's two runs take half the time each), one
# lane per GPU: with 4 GPUs about 2 x (SECONDS_PER_RUN + 20); with fewer GPUs lanes share one
# (1 GPU: 8 runs in a row, several calls' time). The GPUs are CUDA_VISIBLE_DEVICES's if set,
# else all. $OUT: 7 logs + summary.txt.
set -uo pipefail
per=${1:-240}
[[ $per =~ ^[0-9]+$ ]] || { echo "SECONDS_PER_RUN=$per is not a number of seconds" >&2; exit 2; }
export PYTHONPATH=. SCALEOPT_XLA_DEFAULTS=0 JAX_LOG_COMPILES=1
out=${OUT:-/tmp/soap_check}
mkdir -p "$out" runs/soap_check
rm -rf runs/soap_check/cache*  # every variant starts on an empty cache
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then  # the caller's GPUs (e.g. beside a study)
  IFS=',' read -ra gpus <<< "$CUDA_VISIBLE_DEVICES"
else
  read -ra gpus <<< "$(seq -s ' ' 0 $(( $(nvidia-smi -L 2>/dev/null | grep -c '^GPU') - 1 )))"
fi
[ "${#gpus[@]}" -ge 1 ] || gpus=(0)
n=${#gpus[@]}
STEP=(--set model.vocab_size=32768 --set model.wd_policy=all --set data.seq_len=1024
      --set data.batch_size=512 --set data.microbatches=64 --set run.steps=12
      --set run.log_every=1 --set run.eval_every=0 --set run.checkpoint_every=0
      --set run.progress=false --set optimizer.schedule.warmup_steps=2
      --set optimizer.schedule.min_lr_ratio=0.0)
C=runs/soap_check/cache
S="--set optimizer.name=soap --set optimizer.b1=0.95"  # the study's SOAP arm

train() {  # gpu name log cache-dir|- overrides...: one run, appended to log
  local gpu=$1 name=$2 log=$3 cache=$4
  shift 4
  local env=(env -u JAX_COMPILATION_CACHE_DIR CUDA_VISIBLE_DEVICES="$gpu")
  [ "$cache" = - ] || env+=(JAX_COMPILATION_CACHE_DIR="$cache")
  echo "== $name (cache: $cache) $(date +%T)" >> "$log"
  # -k: the trainer takes a first SIGTERM as "checkpoint and stop", which a hung step ignores
  "${env[@]}" timeout -k 20 "$per" python -m scaleopt.cli train --config gpt2-small \
    --out "runs/soap_check/$name" "${STEP[@]}" "$@" >> "$log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $(grep -c '^step' <(sed -n "/^== $name /,\$p" "$log")) logged steps" \
    >> "$out/summary.txt"
}

stand_in() {  # gpu
  local log=$out/stand_in.log rc
  for mode in "" --aot; do
    echo "== stand-in ${mode:-jit} $(date +%T)" >> "$log"
    CUDA_VISIBLE_DEVICES=$1 timeout -k 20 $((per / 2)) python benchmarks/optim_step_cost.py \
      --configs soap --steps 20 --print-steps $mode >> "$log" 2>&1
    rc=$?
    echo "stand_in ${mode:-jit}: exit $rc" >> "$out/summary.txt"
  done
}

lane() {  # lane gpu
  case $1 in
    0) train "$2" adamw_control "$out/adamw_control.log" "${C}0" --set optimizer.name=adamw
       train "$2" soap_device_phases "$out/soap_device_phases.log" "${C}3" $S \
         --set run.host_phases=off ;;
    1) train "$2" soap_study_env "$out/soap_study_env.log" "${C}1" $S
       # the same again on the cache the first run filled (a resumed cell's start)
       train "$2" soap_study_env_again "$out/soap_study_env.log" "${C}1" $S ;;
    2) train "$2" soap_no_cache "$out/soap_no_cache.log" - $S
       train "$2" soap_bc "$out/soap_bc.log" "${C}6" --set optimizer.name=soap_bc \
         --set optimizer.b1=0.95 --set optimizer.extra.mode=full \
         --set optimizer.extra.crossfit=loo ;;
    3) stand_in "$2"
       train "$2" soap_xla_attention "$out/soap_xla_attention.log" "${C}4" $S \
         --set model.attention_impl=xla ;;
  esac
}

: > "$out/summary.txt"
for ((g = 0; g < n && g < 4; g++)); do
  ( for ((l = g; l < 4; l += n)); do lane "$l" "${gpus[$g]}"; done ) &
done
wait
cat "$out/summary.txt"
