#!/usr/bin/env bash
# One device call on one GPU (an H200 or an H100): tokamax from the carried wheels, the GPU
# equality tests of its kernels, the per-op times, then whole training steps with today's
# kernels (the baseline, first and again last) and with the fastest tokamax setting per op that
# passed its tests, each group in one process. From the repo root, `.whl` carried:
#   [TESTS=1] [OPS=1] [GPT2=1] [PROFILE=1] [QWEN="adamw loo small"] [SECONDS_MAX=570] \
#     OUT=$OUT bash lab/gpu/kernels_call.sh
# The wheels: tokamax at the commit pyproject's gpu extra pins (version 0.0.13, not on the
# package index: `pip wheel --no-deps --ignore-requires-python -w .whl 'tokamax @
# git+https://github.com/openxla/tokamax@<commit>'`), the dependencies the device lacks
# (einshape, immutabledict, pydantic + pydantic_core for Python 3.12, qwix, tensorboardx,
# typeguard, typing_extensions, typing_inspection, annotated_types) and xprof, fire and
# termcolor (tokamax 0.0.13 imports xprof when it is imported).
# TEST_SECONDS (default 330) bounds the equality tests (20 tests: about 200 s gave 13 on one
# H100 beside the corpus build).
# TESTS=0 skips the equality tests (then every setting counts as passed; use on a second card
# after they passed on the first); OPS=0 skips the per-op times (then nothing is chosen);
# GPT2=0 skips gpt2-small's steps; PROFILE=0 the kernel table of gpt2-small's step with the
# chosen settings (benchmarks/profile_step.py); QWEN lists qwen2.5-0.5b's steps: "adamw" and
# "loo" at the paper's step (512 x 1024 tokens as 64 microbatches of 8; AdamW, one-pass
# leave-one-out AdamW-BC), "small" 16 x 1024 in one microbatch, each today's kernels then the
# chosen ones.
# Each part is skipped once fewer seconds are left than it needs; rows are written as they
# finish. Every part writes into a work folder; after each part, and on exit, $OUT is rewritten
# with eight files (the device call returns at most eight): report.md (card, versions, chosen
# settings, seconds per part, then benchmarks/kernels.py --report's tables), tests.log,
# tests.xml, ops.log, ops.jsonl, profile.log, steps.log (gpt2 and qwen_<part> logs, each under
# a "## name" line) and steps.jsonl (their rows, each with its part).
set -uo pipefail
out=${OUT:-/tmp/kernels_call}
work=$(mktemp -d /tmp/kernels_work.XXXX)
mkdir -p "$out"
start=$(date +%s)
limit=${SECONDS_MAX:-570}
left() { echo $(( limit - ($(date +%s) - start) )); }
mark() { echo "$1: $(( $(date +%s) - start )) s" >> "$work/call.txt"; pack; }
pack() {  # $work -> the eight files of $OUT
  local f
  for f in tests.log tests.xml ops.log ops.jsonl profile.log; do
    [ -f "$work/$f" ] && cp "$work/$f" "$out/$f"
  done
  : > "$out/steps.log"
  for f in "$work"/gpt2.log "$work"/qwen_*.log; do
    [ -f "$f" ] && { echo "## $(basename "$f" .log)"; cat "$f"; echo; } >> "$out/steps.log"
  done
  python3 - "$work" "$out/steps.jsonl" <<'PY'
import json, pathlib, sys
rows = [dict(json.loads(l), part=f.stem) for f in sorted(pathlib.Path(sys.argv[1]).glob("*.jsonl"))
        if f.name != "ops.jsonl" for l in open(f) if l.strip()]
open(sys.argv[2], "w").write("".join(json.dumps(r) + "\n" for r in rows))
PY
  { echo "# kernels call"; echo; echo '```'; cat "$work/env.txt" "$work/chosen.txt" \
      "$work/call.txt" 2>/dev/null; echo '```'; echo
    [ -s "$work/pip.log" ] && { echo '```'; tail -20 "$work/pip.log"; echo '```'; echo; }
    python3 benchmarks/kernels.py --report "$work" 2>&1; } > "$out/report.md"
}
trap pack EXIT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > "$work/pip.log" 2>&1 || { cat "$work/pip.log"; exit 1; }
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, jax, jaxlib, tokamax; print(sys.version.split()[0], 'jax', \
jax.__version__, 'jaxlib', jaxlib.__version__, 'tokamax', tokamax.__version__, jax.devices())"
} > "$work/env.txt" 2>&1
cat "$work/env.txt"
mark setup

if [ "${TESTS:-1}" = 1 ]; then
  # SIGINT: pytest stops and still writes the results of the tests that ran
  timeout -s INT -k 30 "${TEST_SECONDS:-330}" python3 -m pytest -v -p no:xdist -rs \
    tests/models/test_kernels_gpu.py --junitxml "$work/tests.xml" > "$work/tests.log" 2>&1
  tail -25 "$work/tests.log"
  junit="--junit $work/tests.xml"
else
  junit=""
fi
mark tests

if [ "${OPS:-1}" = 1 ] && [ "$(left)" -gt 60 ]; then
  timeout $(( $(left) - 30 )) python3 benchmarks/kernels.py --jsonl "$work/ops.jsonl" \
    > "$work/ops.log" 2>&1
  sed -n '/^| shape/,$p' "$work/ops.log"
fi
mark ops

choose() {  # $1 shape; $2 optional --single
  python3 benchmarks/kernels.py --choose "$work/ops.jsonl" $junit --shapes "$1" ${2:-}
}
g=$(choose gpt2-small); q=$(choose qwen2.5-0.5b)
today="today's kernels"  # an apostrophe inside ${...:-...} is a bad substitution
echo "chosen: gpt2-small: ${g:-$today}; qwen2.5-0.5b: ${q:-$today}" | tee "$work/chosen.txt"
# All singles of gpt2-small's choice, when it changes more than one op.
singles=""
[ "$(choose gpt2-small --single | tr ',' '\n' | grep -c .)" -gt 1 ] && \
  singles=$(choose gpt2-small --single | tr ',' '\n' | sed 's/^/,data1/' | tr -d '\n')
steps() {  # $1 name, $2 seconds it needs at least, then mesh_throughput.py arguments
  local name=$1 need=$2; shift 2
  [ "$(left)" -gt "$need" ] || { echo "$name: skipped ($(left) s left)"; return; }
  timeout $(( $(left) - 10 )) python3 benchmarks/mesh_throughput.py --same-process \
    --deadline $(( $(left) - 20 )) --jsonl "$work/$name.jsonl" "$@" > "$work/$name.log" 2>&1
  sed -n '/^| /,$p' "$work/$name.log"
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
    --top 30 $sets > "$work/profile.log" 2>&1
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
mark call
cat "$out/report.md"
