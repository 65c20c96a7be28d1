set -o pipefail
# The fused loss's Pallas row kernel (model.loss_kernel) against XLA's passes: the kernel alone,
# then the training system (AdamW, one GPU, gpt2-small), 3 passes with the row order reversed in
# pass 2. Rows with +mloss_kernel=xla are the same-run baseline.
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
echo "code: $(cat .commit 2>/dev/null || echo uncommitted) (device copy of the working tree)" > $OUT/commit.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
F() { grep -v "^W1127\|^I1127\|^W0000\|^I0000"; }
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
timeout 200 env PYTHONPATH=. python benchmarks/loss_kernel.py 2>&1 | F > $OUT/kernel.txt; tail -40 $OUT/kernel.txt
grep -q "head + loss fwd+bwd, pallas" $OUT/kernel.txt || exit 1
X=mloss_kernel=xla
C=data1+b64+m1,data1+b64+m1+$X,data1+b32+m1,data1+b32+m1+$X,data1+b64+m4,data1+b32+m4
R=data1+b32+m4,data1+b64+m4,data1+b32+m1+$X,data1+b32+m1,data1+b64+m1+$X,data1+b64+m1
for p in 1 2 3; do if [ $p = 2 ]; then CC=$R; else CC=$C; fi
timeout 240 env PYTHONPATH=. python benchmarks/mesh_throughput.py --steps 31 --unroll 0 --configs $CC --same-process --jsonl $OUT/mesh.jsonl 2>&1 | F >> $OUT/log.txt; grep "^# data\|^| data" $OUT/log.txt | tail -7; done
