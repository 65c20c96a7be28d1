#!/usr/bin/env bash
# One device call on one GPU: one-pass LOO at the paper's step (512 x 1024 tokens as 64
# microbatches of 8) with loo_fold_chunk k and bfloat16 storage on gpt2-small against AdamW of the
# same call, a kernel profile of the AdamW and LOO steps, and qwen2.5-0.5b at the same step
# through the trainer (AdamW, LOO with bfloat16 and float32 storage), from the repo root:
#   [CHUNKS="4 8 16"] [PROFILE="adamw adamw_bc"] [QWEN="bf16 f32"] [SECONDS_MAX=565] \
#     OUT=$OUT bash lab/gpu/loo_speed_call.sh
# CHUNKS: the loo_fold_chunk values timed besides AdamW, LOO one fold at a time and the last
# chunk with bfloat16 storage; PROFILE: the optimizers profiled (empty: none; the LOO profile
# takes the default blocks); QWEN: the LOO forms timed on qwen2.5-0.5b after its AdamW ("f32",
# "bf16": storage, one fold at a time; "f32:8": float32 with k = 8; empty: no qwen runs).
# lab/benchmarks_history.md names the code each of its calls ran.
# $OUT gets sweep.{log,jsonl}, prof_OPT.log, qwen.{log,jsonl}.
set -uo pipefail
export PYTHONPATH=.
out=${OUT:-/tmp/loo_speed}
mkdir -p "$out"
start=$(date +%s)
limit=${SECONDS_MAX:-565}
step="--seq 1024 --batch 512 --micro 64 --cell-tokens 262144000"
loo=data1+optadamw_bc+ecrossfit=loo+emode=full
configs="data1+optadamw,$loo+eloo_fold_chunk=1"
for k in ${CHUNKS-4 8 16}; do configs+=",$loo+eloo_fold_chunk=$k"; done
[ -z "${k:-}" ] || configs+=",$loo+eloo_fold_chunk=$k+eloo_storage=bfloat16"
timeout 235 python benchmarks/mesh_throughput.py --same-process $step --steps 20 --deadline 225 \
  --jsonl "$out/sweep.jsonl" --configs "$configs" > "$out/sweep.log" 2>&1
for opt in ${PROFILE-adamw adamw_bc}; do
  XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true" \
    timeout 90 python benchmarks/profile_step.py --batch 512 --micro 64 --steps 2 --warmup 2 \
    --top 30 --set optimizer.name=$opt > "$out/prof_$opt.log" 2>&1
done
q=data1+pqwen2.5-0.5b
configs="$q+optadamw"
for form in ${QWEN-bf16 f32}; do
  c="$q+optadamw_bc+ecrossfit=loo+emode=full"
  [[ $form == bf16* ]] && c+="+eloo_storage=bfloat16"
  if [[ $form == *:* ]]; then c+="+eloo_fold_chunk=${form#*:}"; else c+="+eloo_fold_chunk=1"; fi
  configs+=",$c"
done
left=$(( limit - ($(date +%s) - start) ))
[ "$configs" = "$q+optadamw" ] || [ "$left" -lt 60 ] || XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 \
  timeout "$left" python benchmarks/mesh_throughput.py $step \
  --steps 6 --timeout 150 --jsonl "$out/qwen.jsonl" --configs "$configs" > "$out/qwen.log" 2>&1
echo "call: $(( $(date +%s) - start )) s"
