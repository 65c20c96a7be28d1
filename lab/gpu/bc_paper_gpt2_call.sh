#!/usr/bin/env bash
# One device call of the bc_paper_gpt2 study (docs/results.md, "Table 2 in the paper's regime"),
# from the repo root of the device's copy: `run` with kind nvidia-h200-x4 (or -x2) and
#   bash lab/gpu/bc_paper_gpt2_call.sh MINUTES      (MINUTES may be fractional, e.g. 9 or 6.3)
# The study folder takes in docs/studies/bc_paper_gpt2/cells.jsonl once per machine.
# The offline corpus is built once per machine into runs/corpus (ignored by git, so a warm
# machine keeps it, and the cells' checkpoints in runs/, between calls made back to back);
# then one worker per GPU trains cells until MINUTES after the start of the call and
# checkpoints (every 100 steps, and at the stop). $OUT gets the finished cells (cells.jsonl),
# the worker logs' tails and the corpus log; merge cells.jsonl into
# docs/studies/bc_paper_gpt2/ and rebuild the report with --report-only.
# SCALEOPT_CELLS='loo_base_sched/*' (globs) limits the workers to those cells.
# Provenance: the device's copy of the tree has no .git, so the cells record the commit from
# SCALEOPT_COMMIT=<sha of the tree sent> (and SCALEOPT_DIRTY=1 when the tree differs from it),
# named in the call as text; gpus.txt records them.
# BENCH="command" runs a benchmark beside the study on BENCH_GPUS (default: the last GPU; the
# workers take the others), killed at the deadline; its output goes to $OUT/bench.log. The
# benchmark scripts pick their GPUs within CUDA_VISIBLE_DEVICES, which is set to BENCH_GPUS.
set -uo pipefail
minutes=${1:-8}
[[ $minutes =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "MINUTES=$minutes is not a number of minutes" >&2; exit 2; }
seconds=$(awk "BEGIN{print int($minutes * 60)}")
start=$(date +%s)
# the study's first ten cells ran without the launcher's XLA flags (before `scaleopt study` set
# them); the rest keep that environment, so that no arm differs in its GEMM backend
export PYTHONPATH=. SCALEOPT_XLA_DEFAULTS=0
out=${OUT:-/tmp/bc_paper_out}
mkdir -p runs "$out"
# the committed cells join the study folder once per machine (a cell listed twice counts once),
# so finished cells are not trained again; the folder's own cells.jsonl may exist and be empty
if [ ! -f runs/bc_paper_gpt2/.committed_cells_merged ]; then
  mkdir -p runs/bc_paper_gpt2
  f=runs/bc_paper_gpt2/cells.jsonl  # a line cut short by a killed call ends before ours starts
  [ ! -s "$f" ] || [ -z "$(tail -c 1 "$f")" ] || echo >> "$f"
  cat docs/studies/bc_paper_gpt2/cells.jsonl >> "$f"
  touch runs/bc_paper_gpt2/.committed_cells_merged
fi
rm -f runs/worker*.log  # a GPU that runs no worker this call returns no old log
if [ ! -e .git ] && [ -z "${SCALEOPT_COMMIT:-}" ]; then
  echo "note: no .git and no SCALEOPT_COMMIT: the cells record commit null" >&2
fi
[ -z "${SCALEOPT_COMMIT:-}" ] || export SCALEOPT_COMMIT
[ -z "${SCALEOPT_DIRTY:-}" ] || export SCALEOPT_DIRTY
{ nvidia-smi -L; echo "XLA_FLAGS=${XLA_FLAGS:-}";
  echo "SCALEOPT_COMMIT=${SCALEOPT_COMMIT:-} SCALEOPT_DIRTY=${SCALEOPT_DIRTY:-}"; } \
  > "$out/gpus.txt" 2>&1
if [ ! -f runs/corpus/manifest.json ]; then
  nice python scripts/offline_corpus.py --out runs/corpus --val-fraction 0.04 \
    > "$out/corpus.log" 2>&1 || { tail -20 "$out/corpus.log"; exit 1; }
fi
left=$(( seconds - ($(date +%s) - start) ))
[ "$left" -ge 120 ] || { echo "only $left s left after the corpus"; exit 0; }
export SCALEOPT_DEADLINE=$(( start + seconds ))
bench_pid=
if [ -n "${BENCH:-}" ]; then
  all=$(nvidia-smi -L | grep -c '^GPU')
  bench_gpus=$(tr -d ' ' <<< "${BENCH_GPUS:-$((all - 1))}")
  workers=$(seq 0 $((all - 1)) | grep -v -x -F "$(tr ',' '\n' <<< "$bench_gpus")" | tr '\n' ' ')
  [ -n "${workers// /}" ] || { echo "BENCH_GPUS=$bench_gpus leaves no GPU for the study" >&2; exit 2; }
  export SCALEOPT_GPUS=$workers
  CUDA_VISIBLE_DEVICES=$bench_gpus timeout $(( SCALEOPT_DEADLINE - $(date +%s) )) \
    bash -c "$BENCH" > "$out/bench.log" 2>&1 &
  bench_pid=$!
fi
scripts/study_workers.sh "$(awk "BEGIN{print $left / 60}")" runs \
  "studies/bc_paper_gpt2@data.path=runs/corpus"
[ -z "$bench_pid" ] || wait "$bench_pid"  # the benchmark's log is whole when the call returns
cp runs/bc_paper_gpt2/cells.jsonl "$out/" 2>/dev/null
for f in runs/worker*.log; do tail -n 40 "$f" > "$out/$(basename "$f")"; done
ls runs/bc_paper_gpt2/cells 2>/dev/null | head -20 || true  # none left once every cell is done
