set -o pipefail
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/env.txt
F() { grep -v "^W1126\|^I1126\|^W0000\|^I0000"; }
B="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
for m in 1 4; do
  rm -rf /tmp/dump; XLA_FLAGS="$B --xla_dump_to=/tmp/dump --xla_dump_hlo_module_re=.*step.* --xla_dump_hlo_pass_re=NONE" timeout 150 env PYTHONPATH=. python benchmarks/profile_step.py --batch 32 --micro $m --steps 3 2>&1 | F > $OUT/profile_m$m.txt
  f=$(ls -S /tmp/dump/*after_optimizations.txt | head -1); echo "$f"; gzip -c "$f" > $OUT/hlo_m$m.txt.gz
  head -40 $OUT/profile_m$m.txt
done
if grep -q H200 $OUT/env.txt; then export XLA_FLAGS="$B"; for p in 1 2 3; do timeout 150 env PYTHONPATH=. python benchmarks/mesh_throughput.py --steps 31 --unroll 0 --configs data1+b32+m1,data1+b64+m1,data1+b128+m1 --same-process --jsonl $OUT/mesh.jsonl 2>&1 | F >> $OUT/log.txt; grep "^# data" $OUT/log.txt | tail -3; done; fi
