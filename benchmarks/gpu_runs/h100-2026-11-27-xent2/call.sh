set -o pipefail
# The loss kernel with whole rows in registers (V <= 65536) and the blocked form (qwen's
# vocabulary); then the training system (AdamW, one GPU, gpt2-small), 3 passes, row order
# reversed in pass 2, +mloss_kernel=xla rows the same-run baseline; then a profile at 32 x 1024.
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
echo "code: $(cat .commit) (device copy of the working tree)" > $OUT/commit.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
F() { grep -v "^W1127\|^I1127\|^W0000\|^I0000"; }
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
timeout 150 env PYTHONPATH=. python benchmarks/loss_kernel.py --reps 30 2>&1 | F > $OUT/kernel.txt
timeout 60 env PYTHONPATH=. python benchmarks/loss_kernel.py --tokens 16384 --vocab 151936 --d 896 2>&1 | F >> $OUT/kernel.txt; grep "^|" $OUT/kernel.txt
grep -q "head + loss fwd+bwd, pallas" $OUT/kernel.txt || exit 1
X=mloss_kernel=xla
C=data1+b64+m1,data1+b64+m1+$X,data1+b32+m1,data1+b32+m1+$X,data1+b128+m1,data1+b128+m1+$X,data1+b64+m4,data1+b32+m4
R=data1+b32+m4,data1+b64+m4,data1+b128+m1+$X,data1+b128+m1,data1+b32+m1+$X,data1+b32+m1,data1+b64+m1+$X,data1+b64+m1
for p in 1 2 3; do if [ $p = 2 ]; then CC=$R; else CC=$C; fi
timeout 240 env PYTHONPATH=. python benchmarks/mesh_throughput.py --steps 31 --unroll 0 --configs $CC --same-process --jsonl $OUT/mesh.jsonl 2>&1 | F >> $OUT/log.txt; grep "^| data" $OUT/log.txt | tail -8; done
timeout 90 env PYTHONPATH=. python benchmarks/profile_step.py --batch 32 --micro 1 --steps 3 2>&1 | F > $OUT/profile.txt; head -30 $OUT/profile.txt
