#!/usr/bin/env bash
# One device call of the bc_paper_gpt2_decisive study (configs/studies/bc_paper_gpt2_decisive.yaml:
# bc_paper_gpt2's arms adamw, adamw_split, loo_paper, loo; seeds added by the sequential plan
# only to contrasts wider than +-0.05 nats, up to 6 per arm), from the repo root of the device's
# copy: `run` on any lent kind (one GPU: about one cell per 9-minute call), carrying runs/wheels
# (below), and
#   bash lab/gpu/decisive_call.sh MINUTES      (MINUTES may be fractional, e.g. 9 or 6.3)
# STUDY=bc_paper_gpt2_twin (with TELEMETRY_EVERY=0) runs the same-seed twin check instead
# (configs/studies/bc_paper_gpt2_twin.yaml: run.deterministic, at the switch's cost,
# docs/benchmarks.md); its two cells must train on one kind of card (name nvidia-h100-x1 or
# nvidia-h200 in every call) to be comparable bit for bit.
# Resumable: call it again until it prints "0 left". Each call:
# - takes in docs/studies/bc_paper_gpt2_decisive/cells.jsonl (the cells finished by earlier calls
#   and committed) once per machine, so no finished cell trains again;
# - builds the offline corpus with near-duplicate groups on one side of the split (--dedup) once
#   per machine into runs/corpus_dedup (ignored by git; a warm machine keeps it and the cells'
#   checkpoints between calls made back to back);
# - once per machine, trains 12 steps of the LOO arm's step with telemetry (run.host_phases=off:
#   with host-picked programs, telemetry at this step stopped the first step with a cuDNN error
#   on an H100); if they train, the cells log telemetry every TELEMETRY_EVERY (default 50) steps
#   with run.host_phases=off (neither changes a cell's identity), else none;
# - runs one worker per GPU until MINUTES after the start of the call (checkpointing at the stop;
#   each worker plans anew after every cell, so sequential seeds start as soon as a contrast's
#   seeds are in);
# - leaves in $OUT: cells.jsonl (every finished cell), the report rebuilt from it (summary.md
#   with the seed plan), the worker logs' tails, the corpus log and its manifest, the probe's log.
# Commit after each call: append $OUT/cells.jsonl to docs/studies/bc_paper_gpt2_decisive/ with
#   python -c "import sys; from scaleopt.study import store; print(store.append(
#     'docs/studies/bc_paper_gpt2_decisive', store.read(sys.argv[1])))" FILES_AT
# then `scaleopt study --config bc_paper_gpt2_decisive --out docs/studies/bc_paper_gpt2_decisive
#   --set data.path=runs/corpus_dedup --report-only`.
# datasketch (data prepare --dedup) is not on the device and nothing can be downloaded there:
# `pip download datasketch --no-deps -d runs/wheels` here and pass carry=["runs/wheels"].
# `bash lab/gpu/decisive_call.sh corpus` only starts the corpus build in the background (its own
# process session, so it outlives the call on a warm machine) and returns at once: put it before
# another call's command so that the next call made within the machine's warm time finds it built.
set -uo pipefail
build_corpus() {  # runs/corpus_dedup once per machine, its log runs/corpus.log; one build at
  # a time (a flock), so a call waits for the background build of an earlier one, at most 15 min
  ( flock -w 900 9 || { echo "the corpus build of another call is still running" >&2; exit 1; }
    [ -f runs/corpus_dedup/manifest.json ] && exit 0
    rm -rf runs/corpus_dedup
    nice python scripts/offline_corpus.py --out runs/corpus_dedup --val-fraction 0.04 --dedup \
      > runs/corpus.log 2>&1 || { tail -20 runs/corpus.log >&2; exit 1; }
  ) 9> runs/corpus_dedup.lock
}
install_datasketch() {
  python -c "import datasketch" 2>/dev/null || python -m pip install -q --no-index \
    --find-links runs/wheels datasketch > "$1" 2>&1 \
    || { echo "datasketch missing: carry runs/wheels (see the header)"; exit 2; }
}
probe() {  # $1 log, then the optimizer's --set arguments: 12 steps of the study's step with
  # telemetry every 5 steps and one program per step; true when they trained and logged it
  rm -rf runs/telemetry_probe
  timeout "$PROBE_SECONDS" python -m scaleopt.cli train --config gpt2-small \
    --out runs/telemetry_probe --set data.source=shards --set data.path=runs/corpus_dedup \
    --set model.vocab_size=32768 --set model.wd_policy=all --set data.batch_size=512 \
    --set data.microbatches=64 --set run.steps=12 --set run.log_every=5 \
    --set run.telemetry_every=5 --set run.host_phases=off --set run.eval_every=0 \
    --set run.eval_tokens=0 --set run.checkpoint_every=0 --set run.progress=false \
    --set run.tensorboard=false --set run.plot=false "${@:2}" >> "$1" 2>&1 \
    && grep -q '"update_norm/' runs/telemetry_probe/metrics.jsonl
}
telemetry_every() {  # $1 log, $2 seconds left. Echoes the cells' telemetry period:
  # TELEMETRY_EVERY (default 50) once both optimizers' probes trained on this machine, 0 after a
  # failed probe (remembered) or with too little time left to probe
  local every=${TELEMETRY_EVERY:-50}
  if [ "$every" = 0 ] || [ -f runs/telemetry_ok ]; then echo "$every"; return; fi
  if [ -f runs/telemetry_failed ] || [ "$2" -lt 420 ]; then echo 0; return; fi
  PROBE_SECONDS=150
  if probe "$1" --set optimizer.name=adamw \
      && probe "$1" --set optimizer.name=adamw_bc --set optimizer.extra.mode=full \
        --set optimizer.extra.crossfit=loo; then
    touch runs/telemetry_ok
    echo "$every"
  else
    touch runs/telemetry_failed
    echo "telemetry probe failed (telemetry_probe.log): cells train without telemetry" >&2
    echo 0
  fi
}
if [ "${1:-}" = corpus ]; then
  mkdir -p runs && install_datasketch runs/pip.log
  export PYTHONPATH=.
  setsid bash -c "$(declare -f build_corpus); build_corpus" < /dev/null > /dev/null 2>&1 &
  exit 0
fi
minutes=${1:-9}
[[ $minutes =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "MINUTES=$minutes is not a number of minutes" >&2; exit 2; }
seconds=$(awk "BEGIN{print int($minutes * 60)}")
start=$(date +%s)
export PYTHONPATH=.
study=${STUDY:-bc_paper_gpt2_decisive}
out=${OUT:-/tmp/decisive_out}
mkdir -p runs "$out"
install_datasketch runs/pip.log
if [ ! -f runs/$study/.committed_cells_merged ]; then
  mkdir -p runs/$study
  f=runs/$study/cells.jsonl  # a line cut short by a killed call ends before ours starts
  [ ! -s "$f" ] || [ -z "$(tail -c 1 "$f")" ] || echo >> "$f"
  [ ! -f docs/studies/$study/cells.jsonl ] || cat docs/studies/$study/cells.jsonl >> "$f"
  touch runs/$study/.committed_cells_merged
fi
rm -f runs/worker*.log
if [ -z "${SCALEOPT_COMMIT:-}" ]; then
  echo "note: no SCALEOPT_COMMIT: the cells record the copy's .git (it may be older than the" \
    "files) or null" >&2
fi
[ -z "${SCALEOPT_COMMIT:-}" ] || export SCALEOPT_COMMIT
[ -z "${SCALEOPT_DIRTY:-}" ] || export SCALEOPT_DIRTY
{ nvidia-smi -L; echo "XLA_FLAGS=${XLA_FLAGS:-}";
  echo "SCALEOPT_COMMIT=${SCALEOPT_COMMIT:-} SCALEOPT_DIRTY=${SCALEOPT_DIRTY:-}"; } \
  > "$out/gpus.txt" 2>&1
build_corpus; rc=$?
cp runs/corpus.log "$out/corpus.log" 2>/dev/null
[ "$rc" = 0 ] || exit 1
cp runs/corpus_dedup/manifest.json "$out/corpus_manifest.json"
left=$(( seconds - ($(date +%s) - start) ))
[ "$left" -ge 120 ] || { echo "only $left s left after the corpus"; exit 0; }
: > "$out/telemetry_probe.log"
tele=$(telemetry_every "$out/telemetry_probe.log" "$left")
left=$(( seconds - ($(date +%s) - start) ))
[ "$left" -ge 120 ] || { echo "only $left s left after the telemetry probe"; exit 0; }
export SCALEOPT_DEADLINE=$(( start + seconds ))
scripts/study_workers.sh "$(awk "BEGIN{print $left / 60}")" runs \
  "studies/$study@data.path=runs/corpus_dedup@run.telemetry_every=$tele@run.host_phases=off"
cp runs/$study/cells.jsonl "$out/" 2>/dev/null
python -m scaleopt.cli study --config $study --out runs/$study --set data.path=runs/corpus_dedup \
  --report-only > "$out/report.log" 2>&1 && cp runs/$study/summary.md "$out/"
python -m scaleopt.cli study --config $study --out runs/$study --set data.path=runs/corpus_dedup \
  --list | tail -1
for f in runs/worker*.log; do tail -n 40 "$f" > "$out/$(basename "$f")"; done
