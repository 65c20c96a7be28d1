set -o pipefail
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
echo "code: 5237add plus uncommitted offload_statistics (device copy of the working tree)" > $OUT/commit.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
F="grep -v ^W1126\|^I1126\|^W0000\|^I0000"
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
timeout 200 env PYTHONPATH=. python benchmarks/optimizer_memory.py --only 0,11,12,15,16 --csv $OUT/memory.csv 2>&1 | grep -v "^W1126\|^I1126" | tee $OUT/memory.txt | tail -9
C=data1+b64+m1,data1+b64+m1+optshampoo,data1+b64+m1+optshampoo+eoffload_statistics=true,data1+b64+m1+optshampoo+estats_every=10,data1+b64+m1+optshampoo+estats_every=10+eoffload_statistics=true
R=data1+b64+m1+optshampoo+estats_every=10+eoffload_statistics=true,data1+b64+m1+optshampoo+estats_every=10,data1+b64+m1+optshampoo+eoffload_statistics=true,data1+b64+m1+optshampoo,data1+b64+m1
for p in 1 2 3; do if [ $p = 2 ]; then CC=$R; else CC=$C; fi
timeout 140 env PYTHONPATH=. python benchmarks/mesh_throughput.py --steps 31 --unroll 0 --configs $CC --same-process --jsonl $OUT/mesh.jsonl 2>&1 | grep -v "^W1126\|^I1126" >> $OUT/log.txt; grep "^# data" $OUT/log.txt | tail -5; done
