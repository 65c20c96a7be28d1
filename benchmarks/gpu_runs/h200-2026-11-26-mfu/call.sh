set -o pipefail
# The +mnorm_after_matmul=true rows measured an experiment (the blocks' input norms applied after
# their projections, r * (x W)) that was not kept: no gain (see docs/benchmarks.md). The other rows
# rerun as they are once those two configurations are removed from C and R.
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
echo "code: 2285283 plus uncommitted model.norm_after_matmul (device copy of the working tree)" > $OUT/commit.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
F() { grep -v "^W1126\|^I1126\|^W0000\|^I0000"; }
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
N=mnorm_after_matmul=true
C=data1+b64+m1,data1+b64+m1+$N,data1+b32+m1,data1+b32+m1+$N,data1+b64+m2,data1+b64+m4,data1+b128+m1,data1+b128+m4
R=data1+b128+m4,data1+b128+m1,data1+b64+m4,data1+b64+m2,data1+b32+m1+$N,data1+b32+m1,data1+b64+m1+$N,data1+b64+m1
for p in 1 2 3; do if [ $p = 2 ]; then CC=$R; else CC=$C; fi
timeout 200 env PYTHONPATH=. python benchmarks/mesh_throughput.py --steps 31 --unroll 0 --configs $CC --same-process --jsonl $OUT/mesh.jsonl 2>&1 | F >> $OUT/log.txt; grep "^# data" $OUT/log.txt | tail -8; done
timeout 100 env PYTHONPATH=. python benchmarks/profile_step.py --batch 32 --micro 1 --steps 3 --set model.norm_after_matmul=true 2>&1 | F > $OUT/profile_nam.txt; head -12 $OUT/profile_nam.txt
