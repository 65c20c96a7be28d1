set -o pipefail
# One GPU, the final code: the defaults against XLA's loss (+mloss_kernel=xla), gpt2-small,
# 64 x 1024, AdamW, 2 passes (row order reversed in pass 2).
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
echo "code: b60d514 + the finite-updates skip guard + the lane-local loss kernel, final form (device copy of the working tree)" > $OUT/commit.txt
cp benchmarks/gpu_runs/call.sh $OUT/call.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
F() { grep -v "^W11\|^I11\|^W0000\|^I0000"; }
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
B=data1+b64+m1
for p in 1 2; do if [ $p = 2 ]; then CC=$B+mloss_kernel=xla,$B; else CC=$B,$B+mloss_kernel=xla; fi
timeout 90 env PYTHONPATH=. python benchmarks/mesh_throughput.py --steps 31 --unroll 0 --configs $CC --same-process --jsonl $OUT/mesh.jsonl 2>&1 | F >> $OUT/log.txt; grep "^| data" $OUT/log.txt | tail -2 | cut -c1-200; done
