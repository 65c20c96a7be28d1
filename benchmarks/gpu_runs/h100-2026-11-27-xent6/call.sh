set -o pipefail
# The committed loss kernel in the training system (AdamW, one GPU, gpt2-small, 64 and 128
# sequences), 3 passes, row order reversed in pass 2, +mloss_kernel=xla rows the same-run baseline.
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
echo "code: f55616d (device copy of the working tree)" > $OUT/commit.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
F() { grep -v "^W1127\|^I1127\|^W0000\|^I0000"; }
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
X=mloss_kernel=xla
C=data1+b64+m1,data1+b64+m1+$X,data1+b128+m1,data1+b128+m1+$X
R=data1+b128+m1+$X,data1+b128+m1,data1+b64+m1+$X,data1+b64+m1
for p in 1 2 3; do if [ $p = 2 ]; then CC=$R; else CC=$C; fi
timeout 150 env PYTHONPATH=. python benchmarks/mesh_throughput.py --steps 31 --unroll 0 --configs $CC --same-process --jsonl $OUT/mesh.jsonl 2>&1 | F >> $OUT/log.txt; grep "^| data" $OUT/log.txt | tail -4; done
