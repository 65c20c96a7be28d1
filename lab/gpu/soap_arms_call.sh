#!/usr/bin/env bash
# The bc_paper_gpt2 study's SOAP arms on one GPU (docs/results.md, "Table 2 in the paper's
# regime"), in back-to-back device calls of one session:
#   [ARM=soap|soap_bc] OUT=$OUT bash lab/gpu/soap_arms_call.sh MINUTES
# The first call on a fresh machine picks the arm (ARM, if given, overrides an earlier pick):
# ARM, else the one arm not yet in
# docs/studies/bc_paper_gpt2/cells.jsonl, else (neither finished) it builds the corpus and,
# beside it, times AdamW's and SOAP-BC's step (`soap_gpu_check.sh`, 12 steps each:
# $OUT/lane0.log, summary.txt; on GPU 0) and takes soap_bc when its (lower) median step runs at least
# SOAP_BC_MIN tokens/s (default 270000: 500 steps in about 16 minutes), else soap. Later calls
# on the same warm machine continue that arm (runs/soap_arm) through bc_paper_gpt2_call.sh,
# which builds the corpus if needed and resumes a cell from its last checkpoint.
# PRE="command" (optional) runs once per machine on GPU 0 before the cells, beside the corpus
# build, for at most PRE_SECONDS (default 300); its output goes to $OUT/pre.log.
set -uo pipefail
export PYTHONPATH=.
minutes=${1:-9.5}
[[ $minutes =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "MINUTES=$minutes is not a number of minutes" >&2; exit 2; }
start=$(date +%s)
out=${OUT:-/tmp/soap_arms}
mkdir -p runs "$out"
done_arm() { grep -q "\"arm\": *\"$1\"" docs/studies/bc_paper_gpt2/cells.jsonl; }
if [ -n "${ARM:-}" ]; then
  [[ $ARM =~ ^(soap|soap_bc)$ ]] || { echo "ARM=$ARM is not soap or soap_bc" >&2; exit 2; }
  echo "$ARM" > runs/soap_arm
elif [ ! -f runs/soap_arm ] && done_arm soap_bc; then
  echo soap > runs/soap_arm
elif [ ! -f runs/soap_arm ] && done_arm soap; then
  echo soap_bc > runs/soap_arm
fi
if [ ! -f runs/soap_arm ]; then
  if [ ! -f runs/corpus/manifest.json ]; then
    nice python scripts/offline_corpus.py --out runs/corpus --val-fraction 0.04 \
      > "$out/corpus.log" 2>&1 &
  fi
  rm -f "$out"/lane*.log  # the check appends to its logs
  CUDA_VISIBLE_DEVICES=0 RUNS="adamw_control soap_bc" STEPS=12 OUT="$out" \
    bash lab/gpu/soap_gpu_check.sh 240 > /dev/null 2>&1
  wait
  [ -f runs/corpus/manifest.json ] || { tail -20 "$out/corpus.log"; exit 1; }
  # lower median tokens/s of SOAP-BC's steps 2-12 without step 11 (its first QR refresh)
  rate=$(sed -n '/^== soap_bc /,$p' "$out/lane0.log" | awk '$1 == "step" {
      split($2, s, "/"); if (s[1] < 2 || s[1] == 11) next
      for (i = 3; i < NF; i++) if ($i == "tok/s") { v = $(i + 1); gsub(",", "", v); print v } }' \
    | sort -n | awk '{ a[NR] = $1 } END { print (NR ? a[int((NR + 1) / 2)] : 0) }')
  arm=soap
  [ "${rate%.*}" -ge "${SOAP_BC_MIN:-270000}" ] && arm=soap_bc
  echo "$arm" > runs/soap_arm
  echo "soap_bc median $rate tokens/s: running the $arm arm" | tee -a "$out/summary.txt"
fi
if [ -n "${PRE:-}" ] && [ ! -f runs/pre_done ]; then
  if [ ! -f runs/corpus/manifest.json ]; then
    nice python scripts/offline_corpus.py --out runs/corpus --val-fraction 0.04 \
      > "$out/corpus.log" 2>&1 &
  fi
  CUDA_VISIBLE_DEVICES=0 timeout -k 20 "${PRE_SECONDS:-300}" bash -c "$PRE" > "$out/pre.log" 2>&1
  echo "PRE: exit $?" >> "$out/pre.log"
  wait
  touch runs/pre_done
fi
left=$(awk "BEGIN{l = ($minutes * 60 - ($(date +%s) - $start)) / 60; printf \"%.2f\", (l > 0 ? l : 0)}")
SCALEOPT_CELLS="$(cat runs/soap_arm)/*" OUT="$out" bash lab/gpu/bc_paper_gpt2_call.sh "$left"
