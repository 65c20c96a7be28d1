set -o pipefail
# The skip guard decided before the update (adamw registered with finite updates: one pass over
# the optimizer state) against run.update_guard=always (the previous guard, which also checks
# the update's norm); gpt2-small, 64 x 1024, AdamW, one microbatch and 4 x 16, 3 passes (row
# order reversed in pass 2).
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
echo "code: b60d514 + the finite-updates skip guard (device copy of the working tree)" > $OUT/commit.txt
cp benchmarks/gpu_runs/call.sh $OUT/call.sh 2>/dev/null
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
F() { grep -v "^W11\|^I11\|^W0000\|^I0000"; }
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
B=data1+b64
A=rupdate_guard=always
C=$B+m1,$B+m1+$A,$B+m4
R=$B+m4,$B+m1+$A,$B+m1
for p in 1 2 3; do if [ $p = 2 ]; then CC=$R; else CC=$C; fi
timeout 165 env PYTHONPATH=. python benchmarks/mesh_throughput.py --steps 31 --unroll 0 --configs $CC --same-process --jsonl $OUT/mesh.jsonl 2>&1 | F >> $OUT/log.txt; grep "^| data" $OUT/log.txt | tail -3 | cut -c1-200; done
