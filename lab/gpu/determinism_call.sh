#!/usr/bin/env bash
# One device call on one GPU (H100 or H200), from the repo root of the device's copy:
#   SCALEOPT_COMMIT=<sha of the tree sent> [STEPS=12] [NONDET_RUNS=2] [SECONDS_MAX=440] \
#     [DATA=runs/corpus] OUT=$OUT bash lab/gpu/determinism_call.sh
# run.deterministic at the paper's step (gpt2-small, 512 x 1024 tokens as 64 microbatches of 8,
# configs/studies/bc_paper_gpt2.yaml's settings) for AdamW and one-pass LOO (the study's `loo`
# arm): benchmarks/determinism.py trains both optimizers STEPS steps in each of the processes
# det1, nondet1, det2, nondet_same, nondet2 (one process each, in that order). Under the switch
# attention `auto` runs by XLA (on a GPU XLA's deterministic mode does not run the cuDNN
# attention step); without it `auto` is cuDNN, the fastest step. nondet_same trains without the
# switch with the deterministic runs' kernels (attention by XLA), so that the table gives the
# switch's cost against the same kernels and against the fastest step. The first three start
# while a minute of SECONDS_MAX is left, the others only if the longest process so far fits.
# It compares every logged value of det1 and det2 bit for bit (and the final state's digest),
# and times each run (ms/step after the first quarter of the steps).
# Each process first calls a few single operations five times (cuDNN attention forward +
# backward, the embedding gradient's scatter-add, a matmul) and counts distinct results.
# Data: the embedded corpus, or DATA (default runs/corpus when a bc_paper call left it there).
# $OUT gets determinism.md (the table), determinism.json (everything), logs.txt (the tail of
# each process's log) and gpus.txt. Exit 0 when every deterministic pair is bitwise equal.
# Provenance: the device's copy of the tree has no .git, so the runs record the commit from
# SCALEOPT_COMMIT (and SCALEOPT_DIRTY=1 when the tree sent differs from it); name them in the
# call (the sha as text: the device has no git). gpus.txt records them.
# DET_ATTENTION=tokamax_mosaic: the deterministic runs use tokamax's Mosaic attention instead of
# XLA's (benchmarks/determinism.py --det-attention; the probe adds its forward + backward);
# carry .whl (the wheels of lab/gpu/kernels_call.sh's header), installed into /tmp/site.
# BENCH_ARGS: more arguments of benchmarks/determinism.py (a CPU check of this script:
# BENCH_ARGS="--config configs/train/tiny.yaml --shape config --no-probe" STEPS=4).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
out=${OUT:-/tmp/determinism_out}
work=runs/determinism
start=$(date +%s)
limit=${SECONDS_MAX:-440}
mkdir -p "$out" runs
rm -rf "$work"
data=${DATA:-}
[ -n "$data" ] || [ ! -f runs/corpus/manifest.json ] || data=runs/corpus
det_attention=${DET_ATTENTION:-}
if [ -n "$det_attention" ]; then
  python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl > "$out/pip.log" 2>&1 \
    || { echo "DET_ATTENTION needs the wheels in .whl (carry it)"; tail -5 "$out/pip.log"; exit 2; }
  export PYTHONPATH=.:/tmp/site
fi
if [ ! -e .git ] && [ -z "${SCALEOPT_COMMIT:-}" ]; then
  echo "note: no .git and no SCALEOPT_COMMIT: the runs record commit null" >&2
fi
[ -z "${SCALEOPT_COMMIT:-}" ] || export SCALEOPT_COMMIT
[ -z "${SCALEOPT_DIRTY:-}" ] || export SCALEOPT_DIRTY
{ nvidia-smi -L; echo "XLA_FLAGS=${XLA_FLAGS:-}"; echo "DATA=${data:-embedded}";
  echo "SCALEOPT_COMMIT=${SCALEOPT_COMMIT:-} SCALEOPT_DIRTY=${SCALEOPT_DIRTY:-}";
  python -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__)"
  [ -z "$det_attention" ] || python -c "import tokamax; print('tokamax', tokamax.__version__)"; } \
  > "$out/gpus.txt" 2>&1
python benchmarks/determinism.py --out "$work" --steps "${STEPS:-12}" \
  --nondet-runs "${NONDET_RUNS:-2}" --deadline $(( start + limit )) \
  ${data:+--data "$data"} ${det_attention:+--det-attention "$det_attention"} ${BENCH_ARGS:-} \
  > "$work.log" 2>&1
rc=$?
cp "$work/determinism.md" "$work/determinism.json" "$out/" 2>/dev/null
{ cat "$work.log"; for f in "$work"/logs/*.log; do echo "== $f"; grep -v "^\s*$" "$f" | tail -n 40; done; } \
  > "$out/logs.txt" 2>&1
cat "$work/determinism.md" 2>/dev/null || tail -n 40 "$work.log"
echo "call: $(( $(date +%s) - start )) s, exit $rc"
exit $rc
