set -o pipefail
# 2 GPUs: Shampoo (defaults, programs picked by the host) against the fastest AdamW step
# (fsdp2, one microbatch) with the skip guard decided before the update for AdamW and the
# lane-local loss kernel; gpt2-small, 64 x 1024, 3 passes (row order reversed in pass 2).
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
echo "code: b60d514 + the finite-updates skip guard + the lane-local loss kernel (device copy of the working tree)" > $OUT/commit.txt
cp benchmarks/gpu_runs/call.sh $OUT/call.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
F() { grep -v "^W11\|^I11\|^W0000\|^I0000"; }
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
A=fsdp2+b64+m1
S=$A+optshampoo
for p in 1 2 3; do if [ $p = 2 ]; then CC=$S,$A; else CC=$A,$S; fi
timeout 170 env PYTHONPATH=. python benchmarks/mesh_throughput.py --steps 31 --unroll 0 --configs $CC --same-process --jsonl $OUT/mesh.jsonl 2>&1 | F >> $OUT/log.txt; grep "^| fsdp" $OUT/log.txt | tail -2 | cut -c1-200; done
