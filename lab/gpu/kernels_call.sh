#!/usr/bin/env bash
# One device call on one GPU (an H200 or an H100): tokamax from the carried wheels, the GPU
# equality tests of its kernels, the per-op times, then whole training steps with today's
# kernels (the baseline, first and again last) and with the fastest tokamax setting per op that
# passed its tests, each group in one process. From the repo root, `.whl` carried:
#   [TESTS=1] [OPS=1] [GPT2=1] [PROFILE=1] [QWEN="adamw loo small"] [SECONDS_MAX=540] \
#     OUT=$OUT bash lab/gpu/kernels_call.sh
# TESTS=0 skips the equality tests (then every setting counts as passed; use on a second card
# after they passed on the first); OPS=0 skips the per-op times (then nothing is chosen);
# GPT2=0 skips gpt2-small's steps; PROFILE=0 the kernel table of gpt2-small's step with the
# chosen settings (benchmarks/profile_step.py); QWEN lists qwen2.5-0.5b's steps: "adamw" and
# "loo" at the paper's step (512 x 1024 tokens as 64 microbatches of 8; AdamW, one-pass
# leave-one-out AdamW-BC), "small" 16 x 1024 in one microbatch, each today's kernels then the
# chosen ones.
# Each part is skipped once fewer seconds are left than it needs; rows are written as they
# finish. $OUT gets env.txt, pip.log, tests.{log,xml}, ops.{log,jsonl}, gpt2.{log,jsonl},
# profile.log, qwen_<part>.{log,jsonl}, chosen.txt, call.txt (seconds per part) and
# report.md (the tables: benchmarks/kernels.py --report).
set -uo pipefail
out=${OUT:-/tmp/kernels_call}
mkdir -p "$out"
start=$(date +%s)
limit=${SECONDS_MAX:-540}
left() { echo $(( limit - ($(date +%s) - start) )); }
mark() { echo "$1: $(( $(date +%s) - start )) s" >> "$out/call.txt"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > "$out/pip.log" 2>&1 || { cat "$out/pip.log"; exit 1; }
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, jax, jaxlib, tokamax; print(sys.version.split()[0], 'jax', \
jax.__version__, 'jaxlib', jaxlib.__version__, 'tokamax', tokamax.__version__, jax.devices())"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"
mark setup

if [ "${TESTS:-1}" = 1 ]; then
  # SIGINT: pytest stops and still writes the results of the tests that ran
  timeout -s INT -k 15 200 python3 -m pytest -q -p no:xdist -rs tests/models/test_kernels_gpu.py \
    --junitxml "$out/tests.xml" > "$out/tests.log" 2>&1
  tail -25 "$out/tests.log"
  junit="--junit $out/tests.xml"
else
  junit=""
fi
mark tests

if [ "${OPS:-1}" = 1 ] && [ "$(left)" -gt 60 ]; then
  timeout $(( $(left) - 30 )) python3 benchmarks/kernels.py --jsonl "$out/ops.jsonl" \
    > "$out/ops.log" 2>&1
  sed -n '/^| shape/,$p' "$out/ops.log"
fi
mark ops

choose() {  # $1 shape; $2 optional --single
  python3 benchmarks/kernels.py --choose "$out/ops.jsonl" $junit --shapes "$1" ${2:-}
}
g=$(choose gpt2-small); q=$(choose qwen2.5-0.5b)
echo "gpt2-small: ${g:-today's}; qwen2.5-0.5b: ${q:-today's}" | tee "$out/chosen.txt"
# All singles of gpt2-small's choice, when it changes more than one op.
singles=""
[ "$(choose gpt2-small --single | tr ',' '\n' | grep -c .)" -gt 1 ] && \
  singles=$(choose gpt2-small --single | tr ',' '\n' | sed 's/^/,data1/' | tr -d '\n')
steps() {  # $1 name, $2 seconds it needs at least, then mesh_throughput.py arguments
  local name=$1 need=$2; shift 2
  [ "$(left)" -gt "$need" ] || { echo "$name: skipped ($(left) s left)"; return; }
  timeout $(( $(left) - 10 )) python3 benchmarks/mesh_throughput.py --same-process \
    --deadline $(( $(left) - 20 )) --jsonl "$out/$name.jsonl" "$@" > "$out/$name.log" 2>&1
  sed -n '/^| /,$p' "$out/$name.log"
  mark "$name"
}

if [ "${GPT2:-1}" = 1 ]; then
  if [ -n "$g" ]; then c="data1,data1$g$singles,data1"; else c="data1"; fi
  steps gpt2 90 --seq 1024 --batch 64 --micro 1 --unroll 0 --steps 21 --timeout 150 \
    --configs "$c"
fi
if [ "${PROFILE:-1}" = 1 ] && [ "$(left)" -gt 90 ]; then  # gpt2-small's step with the choice
  sets=$(echo "$g" | sed 's/+m\([a-z_]*\)=\([a-z_]*\)/ --set model.\1=\2/g')
  XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true" \
    timeout 80 python3 benchmarks/profile_step.py --batch 64 --micro 1 --steps 2 --warmup 2 \
    --top 30 $sets > "$out/profile.log" 2>&1
  mark profile
fi
qp=data1+pqwen2.5-0.5b
loo=+optadamw_bc+ecrossfit=loo+emode=full
for part in ${QWEN-adamw loo small}; do
  case $part in
    adamw) a="$qp+optadamw"; args="--batch 512 --micro 64 --steps 5 --timeout 200";;
    loo) a="$qp$loo"; args="--batch 512 --micro 64 --steps 5 --timeout 200";;
    small) a="$qp+optadamw"; args="--batch 16 --micro 1 --steps 21 --timeout 150";;
    *) echo "QWEN: unknown part $part (adamw, loo, small)" >&2; continue;;
  esac
  c="$a"; [ -z "$q" ] || c="$a,$a$q"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.94 steps "qwen_$part" 120 --seq 1024 --unroll 0 $args \
    --configs "$c"
done
python3 benchmarks/kernels.py --report "$out" > "$out/report.md" 2>&1; cat "$out/report.md"
echo "call: $(( $(date +%s) - start )) s" | tee -a "$out/call.txt"
