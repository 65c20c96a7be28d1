#!/usr/bin/env bash
# Scale-out measurements on one host with 4 GPUs, in one call. Two plans:
#
# SUITE_PLAN=full (default, under 9 minutes):
#   1 GPU (4 runs side by side, one per GPU): gpt2-small AdamW at 16 and 64 sequences per step
#     (1 and 2 microbatches) and Shampoo (grafted, roots every 10) at 64
#   4 GPUs: gpt2-small AdamW data4 / fsdp4 (64 sequences: 16 per GPU, the weak-scaling
#     baseline is data1 at 16), Shampoo data4 with its block factors split over the GPUs,
#     qwen2.5-0.5b fsdp4 (32 x 1024), adamw_bc (LOO) and sophia_bc at 64 sequences
#   if time is left: Shampoo fsdp4, and on 2 GPUs AdamW data2 and Shampoo data2 (64 sequences)
#   optimizer memory (bytes per parameter per device) on the CPU, in the background: state
#     bytes on 1 and 4 devices from the shardings, then the one-device compiled table
#
# SUITE_PLAN=rerun (under 3.5 minutes, compiles included; every row on 4 GPUs):
#   qwen2.5-0.5b fsdp4 at the largest per-GPU batch whose compiled step fits FIT_GIB (default
#     70) GiB per GPU (mesh_throughput.py option fitG: compiled memory analysis at 8 and 16
#     sequences per GPU, the line through them, one confirming compile; no trial runs), then
#     at 8 sequences per GPU (the full plan's setting) as the check, in one process
#   gpt2-small, 64 sequences per step, one process: AdamW fsdp4 (1 microbatch: the fastest
#     AdamW), AdamW data4 with 4 microbatches (the BC rows' microbatching), adamw_bc (LOO,
#     4 microbatches, each token twice), sophia_bc (A/B: 2 groups x 32 sequences x 2
#     microbatches, the same 64 sequences in 4 microbatches), then if time is left Shampoo
#     fsdp4 and AdamW data4 with 1 microbatch; then AdamW and adamw_bc (LOO) with 2
#     microbatches
#
# SUITE_PLAN=open (under 9 minutes; its rows are in lab/benchmarks_history.md "The layer-scan unroll, ..."):
#   Shampoo on 4 GPUs at TF32: fsdp4 and data4 with ZeRO-1, against AdamW fsdp4 and data4 +
#     ZeRO-1
#   bias correction with microbatches on the fsdp axis (adamw_bc LOO, sophia_bc), against
#     AdamW fsdp4 with one microbatch
#   a profile on 4 GPUs (benchmarks/profile_step.py): Shampoo fsdp4 TF32 over 10 steps, one of
#     them a root step
#   the GPU's own compiled Shampoo program (benchmarks/shampoo_step_anatomy.py, compile only)
#
# Every number has its same-run baseline in the same table (benchmarks/mesh_throughput.py:
# "vs one GPU", "vs 1 GPU/GPU-batch", "vs adamw step", "vs adamw token", "same micro").
#
#   bash benchmarks/gpu_scaling_suite.sh OUT_DIR            (or OUT=OUT_DIR; default /tmp/gpu_suite)
#   SUITE_PLAN=rerun bash benchmarks/gpu_scaling_suite.sh OUT_DIR
#   SUITE_PLAN=open bash benchmarks/gpu_scaling_suite.sh OUT_DIR
#   SUITE_PLAN=roots bash benchmarks/gpu_scaling_suite.sh OUT_DIR   (2 GPUs: root solvers;
#       AdamW and Shampoo on 1 and 2 GPUs: eigh roots with TF32 matmuls, the defaults (Newton
#       roots at "high"), the defaults with TF32 matmuls, no root steps)
#   SUITE_PLAN=blocks bash benchmarks/gpu_scaling_suite.sh OUT_DIR  (2 GPUs: root solvers with
#       the defaults; AdamW and Shampoo (defaults) on 1 GPU; then passes of AdamW fsdp2 and
#       Shampoo fsdp2 with blocks in the FSDP order (default), in the stacked-layers order and
#       without root steps, three passes (each one process), as many as the budget allows)
#   SUITE_PLAN=two bash benchmarks/gpu_scaling_suite.sh OUT_DIR     (2 GPUs: root solvers at
#       block 768 and Newton by iteration count; Shampoo at block 768 on 1 and 2 GPUs, data2 +
#       ZeRO-1, no root steps)
#   SUITE_PLAN=shards bash benchmarks/gpu_scaling_suite.sh OUT_DIR  (4 GPUs, under 9.5 minutes:
#       AdamW fsdp4 and Shampoo fsdp4 (defaults) with blocks cut as on one GPU and per FSDP
#       shard (block_shards: fsdp), up to five passes in alternating row order (each one
#       process; the first pass also without root steps); between the first pass and the others, bias
#       correction with its microbatches on the fsdp axis (adamw_bc LOO, sophia_bc) and on
#       data4 + ZeRO-1, against AdamW fsdp4)
#   SUITE_PLAN=phases bash benchmarks/gpu_scaling_suite.sh OUT_DIR  (2 GPUs, under 9.5 minutes:
#       AdamW and Shampoo (defaults) with the host picking the step's branches (the default on
#       GPUs) and with device branches (host_phases: off): one pass on 1 GPU at 32 sequences
#       (and Shampoo at 64, where on an H100 the programs do not fit side by side), then up to five
#       passes on fsdp2 in alternating row order (each one process); after the first,
#       sophia_bc on fsdp2 with and without host-picked branches)
#   SCALEOPT_SUITE_DRY=1 [SUITE_PLAN=rerun] bash benchmarks/gpu_scaling_suite.sh OUT_DIR
#       (CPU plumbing check: every configuration tiny, on simulated devices)
#
# Writes into OUT_DIR: suite.log (everything, with the combined table), env.txt, mesh.jsonl
# and mesh.csv (every throughput row); the full plan also memory_devices.csv, memory_1dev.csv.
# Stops starting new work after SUITE_BUDGET seconds (full 470, rerun 180; dry 3000) and kills
# what still runs at SUITE_DEADLINE (full 525, rerun 205; dry 3600).
set -u
OUT=${1:-${OUT:-/tmp/gpu_suite}}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-$(command -v python3 || command -v python)}
PLAN=${SUITE_PLAN:-full}
case "$PLAN" in
  full) BUDGET=${SUITE_BUDGET:-470}; DEADLINE=${SUITE_DEADLINE:-525} ;;
  rerun) BUDGET=${SUITE_BUDGET:-180}; DEADLINE=${SUITE_DEADLINE:-205} ;;
  open|roots|two|blocks) BUDGET=${SUITE_BUDGET:-470}; DEADLINE=${SUITE_DEADLINE:-525} ;;
  shards|phases) BUDGET=${SUITE_BUDGET:-520}; DEADLINE=${SUITE_DEADLINE:-565} ;;
  *) echo "SUITE_PLAN=$PLAN: expected full, rerun, open, roots, two, blocks, shards or phases" >&2
     exit 2 ;;
esac
DRY=${SCALEOPT_SUITE_DRY:-0}
if [ "$DRY" = 1 ]; then  # slow CPU compiles: every configuration runs, whatever it takes
  BUDGET=${SUITE_BUDGET:-3000}; DEADLINE=${SUITE_DEADLINE:-3600}
fi
LOG="$OUT/suite.log"
: > "$LOG"
log() { echo "[suite $(date -u +%H:%M:%S) +${SECONDS}s] $*" | tee -a "$LOG"; }

if [ "$DRY" = 1 ]; then
  MT=(--quick --steps 2 --fit-probe 8,16)
  MEM=(--quick)
  STEPS=2 LONG=2
  FIT=0.04  # GiB: the tiny model's compiled step holds about 1 MiB per sequence per device
else
  MT=(--steps 21 --unroll 0)
  MEM=()
  STEPS=21 LONG=31  # LONG: Shampoo rows, 3 root steps in 30 timed steps
  FIT=${FIT_GIB:-70}
fi

{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -6
  $PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)" 2>&1
  git rev-parse HEAD 2>/dev/null
  echo "plan=$PLAN dry=$DRY steps=$STEPS budget=$BUDGET deadline=$DEADLINE fit_gib=$FIT"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt" >> "$LOG"

left() { echo $(( BUDGET - SECONDS )); }

# mesh_throughput with the time left (seconds); per-configuration timeout $2
mt() {
  local name=$1 timeout=$2 configs=$3; shift 3
  local b; b=$(left)
  if [ "$b" -le 15 ]; then log "$name: skipped (time budget)"; return; fi
  log "$name: $configs"
  # the script itself kills a configuration 6 s before the deadline and keeps finished rows
  timeout --kill-after=5 $(( DEADLINE - SECONDS )) \
    $PY benchmarks/mesh_throughput.py "${MT[@]}" --configs "$configs" --timeout "$timeout" \
    --budget "$b" --deadline $(( DEADLINE - SECONDS - 6 )) --jsonl "$OUT/mesh.jsonl" "$@" \
    >> "$LOG" 2>&1
  log "$name: exit $?"
}

# benchmarks/shampoo_roots.py on GPU 1 in the background (OUT/NAME.txt, OUT/NAME.json)
roots_bench() {
  local name=$1; shift
  local quick=(); [ "$DRY" = 1 ] && quick=(--quick --steps 12)
  log "root solvers $name (GPU 1): $*"
  ( CUDA_VISIBLE_DEVICES=1 timeout --kill-after=5 $(( DEADLINE - SECONDS )) $PY \
      benchmarks/shampoo_roots.py "${quick[@]}" "$@" --json "$OUT/$name.json" \
      > "$OUT/$name.txt" 2>&1
    log "root solvers $name: exit $?" ) &
}

G=gpt2-small
MEMPID=
if [ "$PLAN" = full ]; then
  # optimizer memory on the CPU in the background (no GPU time, no interference with timings):
  # state bytes per device on 1 and 4 simulated devices (no compile, seconds), then the
  # one-device compiled table until the deadline
  (
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \
      timeout 120 $PY benchmarks/optimizer_memory.py "${MEM[@]}" --devices 4 --state-only \
      --csv "$OUT/memory_devices.csv" > "$OUT/.mem4.log" 2>&1
    JAX_PLATFORMS=cpu timeout $(( DEADLINE - 30 )) $PY benchmarks/optimizer_memory.py \
      "${MEM[@]}" --csv "$OUT/memory_1dev.csv" > "$OUT/.mem1.log" 2>&1
  ) &
  MEMPID=$!

  mt mesh_1gpu 170 "data1+b16+m1,data1+b64+m1,data1+b64+m2,data1+b64+m2+optshampoo" \
    --parallel-single 4
  mt mesh_4gpu 110 "data4+b64+m1,fsdp4+b64+m1,data4+b64+m1+optshampoo"
  mt mesh_qwen 170 "fsdp4+b32+m1+pqwen2.5-0.5b"
  mt mesh_bc 110 "data4+b64+m4+optadamw_bc+ecrossfit=loo,data4+b32+m2+optsophia_bc"
  mt mesh_extra 100 "fsdp4+b64+m1+optshampoo,data2+b64+m1,data2+b64+m1+optshampoo"
elif [ "$PLAN" = open ]; then
  TF32=ematmul_precision=default+estats_precision=default
  mt shampoo_4gpu 80 "fsdp4+b64+m1,fsdp4+b64+m1+optshampoo+$TF32,\
data4+b64+m1+optshampoo+zero+$TF32,data4+b64+m1+zero" \
    --same-process --steps "$LONG"
  V=evmap_microbatches=true
  mt bc_fsdp 80 "fsdp4+b64+m1,fsdp4+b64+m4+optadamw_bc+$V,fsdp4+b32+m4+optsophia_bc+$V" \
    --same-process
  prof() {  # profile_step NAME ARGS...: all GPUs, if time is left
    local name=$1; shift
    if [ "$(left)" -le 60 ]; then log "profile $name: skipped (time budget)"; return; fi
    log "profile $name: $*"
    timeout --kill-after=5 $(( DEADLINE - SECONDS )) $PY benchmarks/profile_step.py "$@" \
      > "$OUT/profile_$name.txt" 2>&1
    log "profile $name: exit $?"
  }
  if [ "$DRY" = 1 ]; then  # 4 simulated CPU devices
    export XLA_FLAGS="--xla_force_host_platform_device_count=4 ${XLA_FLAGS:-}"
    P=(--preset tiny --batch 16 --seq 32 --unroll 1 --warmup 1)
  else P=(--batch 64); fi
  prof shampoo_fsdp4 "${P[@]}" --steps 10 --set mesh.data=1 --set mesh.fsdp=4 \
    --set optimizer.name=shampoo --set optimizer.extra.matmul_precision=default \
    --set optimizer.extra.stats_precision=default
  if [ "$(left)" -gt 60 ]; then
    log "shampoo anatomy"
    if [ "$DRY" = 1 ]; then A=(--quick); else A=(--configs data1,data1+optshampoo,fsdp4+optshampoo); fi
    timeout --kill-after=5 $(( DEADLINE - SECONDS )) $PY benchmarks/shampoo_step_anatomy.py \
      "${A[@]}" > "$OUT/shampoo_anatomy.txt" 2>&1
    log "shampoo anatomy: exit $?"
  fi
elif [ "$PLAN" = roots ]; then
  TF32=ematmul_precision=default+estats_precision=default
  EIGH=eroot_method=eigh
  # the root-solver table on the second GPU while the one-GPU rows train on the first
  # (SUITE_ROOTS=0 skips it)
  RPID=
  if [ "${SUITE_ROOTS:-1}" = 1 ]; then roots_bench roots; RPID=$!; fi
  mt shampoo_1gpu 100 "data1+b64+m1,data1+b64+m1+optshampoo+$EIGH+$TF32,\
data1+b64+m1+optshampoo,data1+b64+m1+optshampoo+$TF32" --same-process --steps "$LONG"
  [ -n "$RPID" ] && wait $RPID
  mt shampoo_2gpu 100 "fsdp2+b64+m1,fsdp2+b64+m1+optshampoo+$EIGH+$TF32,fsdp2+b64+m1+optshampoo,\
fsdp2+b64+m1+optshampoo+$TF32,fsdp2+b64+m1+optshampoo+$TF32+eroot_every=1000" \
    --same-process --steps "$LONG"
elif [ "$PLAN" = blocks ]; then
  RPID=
  if [ "${SUITE_ROOTS:-1}" = 1 ]; then
    roots_bench roots --solvers eigh,newton:high:30,newton:TF32_TF32_F32:8; RPID=$!
  fi
  mt shampoo_1gpu 100 "data1+b64+m1,data1+b64+m1+optshampoo" --same-process --steps "$LONG"
  [ -n "$RPID" ] && wait $RPID
  for pass in 1 2 3; do
    mt "blocks_2gpu_$pass" 100 "fsdp2+b64+m1,fsdp2+b64+m1+optshampoo,\
fsdp2+b64+m1+optshampoo+eblock_major=layers,fsdp2+b64+m1+optshampoo+eroot_every=1000" \
      --same-process --steps "$LONG"
  done
elif [ "$PLAN" = two ]; then
  TF32=ematmul_precision=default+estats_precision=default
  roots_bench roots768 --block 768 --solvers eigh,newton:TF32_TF32_F32:8,\
newton:TF32_TF32_F32:10,newton:TF32_TF32_F32:12,newton:TF32_TF32_F32:15
  RPID=$!
  EIGH=eroot_method=eigh
  mt shampoo_1gpu_768 100 "data1+b64+m1,data1+b64+m1+optshampoo+$EIGH+$TF32+eblock_size=768" \
    --same-process --steps "$LONG"
  wait $RPID
  mt shampoo_2gpu_more 100 "fsdp2+b64+m1,fsdp2+b64+m1+optshampoo+$EIGH+$TF32+eblock_size=768,\
data2+b64+m1+optshampoo+zero+$EIGH+$TF32,\
data2+b64+m1+optshampoo+zero+$EIGH+$TF32+eblock_size=768,\
fsdp2+b64+m1+optshampoo+$EIGH+$TF32+eroot_every=1000" --same-process --steps "$LONG"
elif [ "$PLAN" = shards ]; then
  A=fsdp4+b64+m1; S=$A+optshampoo; H=$S+eblock_shards=fsdp
  mt shards_1 100 "$A,$S,$H,$H+eroot_every=1000" --same-process --steps "$LONG"
  V=evmap_microbatches=true
  mt bc_fsdp 90 "$A,fsdp4+b64+m4+optadamw_bc+$V,fsdp4+b32+m4+optsophia_bc+$V,\
data4+b64+m4+optadamw_bc+$V+zero" --same-process
  for pass in 2 3 4 5; do  # as many as the budget allows
    if [ $((pass % 2)) = 0 ]; then C="$H,$S,$A"; else C="$A,$S,$H"; fi
    mt "shards_$pass" 70 "$C" --same-process --steps "$LONG"
  done
elif [ "$PLAN" = phases ]; then
  OFF=rhost_phases=off
  mt phases_1gpu 100 "data1+b32+m1,data1+b32+m1+optshampoo,data1+b32+m1+optshampoo+$OFF,\
data1+b64+m1+optshampoo" --same-process --steps "$LONG"
  A=fsdp2+b64+m1; S=$A+optshampoo
  mt phases_2gpu_1 100 "$A,$S,$S+$OFF" --same-process --steps "$LONG"
  V=evmap_microbatches=true
  B=fsdp2+b32+m4+optsophia_bc+$V
  mt sophia_2gpu 90 "$A,$B,$B+$OFF" --same-process --steps "$LONG"
  for pass in 2 3 4 5; do  # as many as the budget allows
    if [ $((pass % 2)) = 0 ]; then C="$S+$OFF,$S,$A"; else C="$A,$S,$S+$OFF"; fi
    mt "phases_2gpu_$pass" 70 "$C" --same-process --steps "$LONG"
  done
else
  Q=pqwen2.5-0.5b
  # the fit row first: it compiles at 8 and 16 per GPU (8 is cached for the check row) and
  # trains while the device memory is unfragmented
  mt qwen_fit 150 "fsdp4+m1+$Q+fit$FIT,fsdp4+b32+m1+$Q" --same-process
  mt bc_cost 60 "fsdp4+b64+m1,data4+b64+m4,data4+b64+m4+optadamw_bc+ecrossfit=loo,\
data4+b32+m2+optsophia_bc,fsdp4+b64+m1+optshampoo,data4+b64+m1" --same-process
  mt bc_m2 60 "data4+b64+m2,data4+b64+m2+optadamw_bc+ecrossfit=loo" --same-process
fi

log "all throughput rows in one table (ratios across the runs above, same machine)"
$PY benchmarks/mesh_throughput.py --table-from "$OUT/mesh.jsonl" --csv "$OUT/mesh.csv" \
  >> "$LOG" 2>&1

if [ -n "$MEMPID" ]; then
  log "waiting for the memory table"
  while kill -0 "$MEMPID" 2>/dev/null && [ $SECONDS -lt $DEADLINE ]; do sleep 2; done
  kill "$MEMPID" 2>/dev/null
  for f in .mem4.log .mem1.log; do
    [ -f "$OUT/$f" ] && { echo "---- $f"; cat "$OUT/$f"; } >> "$LOG" && rm -f "$OUT/$f"
  done
fi
log "done; files: $(ls "$OUT" | tr '\n' ' ')"
