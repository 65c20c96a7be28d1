#!/usr/bin/env bash
# Runs studies on every GPU of this machine: one worker process per GPU, all sharing each
# study's folder; workers claim whole conditions, or single cells with the loop engine
# (`scaleopt study --claim`), so cheap and expensive arms balance themselves.
#
#   scripts/study_workers.sh MINUTES ROOT STUDY[@KEY=VALUE...] [STUDY...]
#
# STUDY is a shipped study's name or a YAML file (each @KEY=VALUE one --set); its folder is
# ROOT/<basename>. Workers go
# through the studies in order and stop (checkpointing) MINUTES after the launch; rerun the same
# command to continue. Logs: ROOT/worker<i>.log. The report is left to `scaleopt study
# --report-only` (run it anywhere the folders are). SCALEOPT_GPUS="1 2 3" picks the GPUs (one
# worker each; e.g. leave GPU 0 to a benchmark running beside the study); SCALEOPT_WORKERS
# overrides the GPU count (on CPU: the number of local workers, for a dry run).
# SCALEOPT_CELLS='GLOB ...' limits the workers to those cells (`scaleopt study --cells`, in
# every study of the launch).
# SCALEOPT_CLAIM_TOKEN and SCALEOPT_DEADLINE (epoch seconds) let a second launch join this one
# (e.g. GPU 0 after a benchmark): same token = shared claims, same deadline.
set -u
[ $# -ge 3 ] || { echo "usage: $0 MINUTES ROOT STUDY[@KEY=VALUE...] ..." >&2; exit 2; }
minutes=$1 root=$2
shift 2
[[ $minutes =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "MINUTES=$minutes is not a number of minutes" >&2; exit 2; }
py=${PYTHON:-python3}
n=${SCALEOPT_WORKERS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
[ "$n" -ge 1 ] || n=1
gpus=${SCALEOPT_GPUS:-$(seq -s ' ' 0 $((n - 1)))}
token=${SCALEOPT_CLAIM_TOKEN:-launch-$(date +%s)-$$}
deadline=${SCALEOPT_DEADLINE:-$(( $(date +%s) + $(awk "BEGIN{print int($minutes * 60)}") ))}
[[ $deadline =~ ^[0-9]+$ ]] || { echo "SCALEOPT_DEADLINE=$deadline is not a time in epoch seconds" >&2; exit 2; }
[ "$deadline" -gt "$(date +%s)" ] || { echo "SCALEOPT_DEADLINE=$deadline is in the past ($(date -d @$deadline +%T))" >&2; exit 2; }
mkdir -p "$root"
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$root/.jax_cache}
echo "worker(s) on GPU(s) $gpus, token $token, until $(date -d @$deadline +%T)"

worker() {
  local i=$1 spec parts study name left args kv cells
  for spec in "${@:2}"; do
    IFS='@' read -ra parts <<< "$spec"
    study=${parts[0]}
    name=$(basename "$study" .yaml)
    left=$(( deadline - $(date +%s) ))
    [ $left -ge 60 ] || break
    args=()
    for kv in "${parts[@]:1}"; do args+=(--set "$kv"); done
    read -ra cells <<< "${SCALEOPT_CELLS:-}"
    [ ${#cells[@]} -eq 0 ] || args+=(--cells "${cells[@]}")
    echo "== worker $i: $name ($left s left) $(date +%T)"
    CUDA_VISIBLE_DEVICES=$i $py -m scaleopt.cli study --config "$study" --out "$root/$name" \
      --claim "$token" --max-minutes "$(awk "BEGIN{print $left / 60}")" "${args[@]}"
  done
}

for i in $gpus; do
  worker "$i" "$@" > "$root/worker$i.log" 2>&1 &
done
wait
tail -n 3 "$root"/worker*.log
