set -o pipefail
# The shipped loss kernel (defaults: blocks of 8192 columns, 16 warps, one program per row): the
# model's loss tests with the real kernel on the GPU, the kernel alone, then the training system
# (AdamW, one GPU, gpt2-small), 3 passes, row order reversed in pass 2, +mloss_kernel=xla rows
# the same-run baseline.
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
echo "code: $(cat .commit) (device copy of the working tree)" > $OUT/commit.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
F() { grep -v "^W1127\|^I1127\|^W0000\|^I0000"; }
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
timeout 120 env PYTHONPATH=. python -m pytest -q -p no:cacheprovider tests/models/test_models_loss.py -k "per_token or kernel_rows" 2>&1 | tail -3 | tee $OUT/tests.txt
timeout 90 env PYTHONPATH=. python benchmarks/loss_kernel.py --tokens 32768 --reps 30 2>&1 | F > $OUT/kernel.txt; grep "^|" $OUT/kernel.txt
X=mloss_kernel=xla
C=data1+b64+m1,data1+b64+m1+$X,data1+b32+m1,data1+b32+m1+$X,data1+b64+m4
R=data1+b64+m4,data1+b32+m1+$X,data1+b32+m1,data1+b64+m1+$X,data1+b64+m1
for p in 1 2 3; do if [ $p = 2 ]; then CC=$R; else CC=$C; fi
timeout 150 env PYTHONPATH=. python benchmarks/mesh_throughput.py --steps 31 --unroll 0 --configs $CC --same-process --jsonl $OUT/mesh.jsonl 2>&1 | F >> $OUT/log.txt; grep "^| data" $OUT/log.txt | tail -5; done
