set -o pipefail
# One GPU: the loss and norm kernel tests with the compiled kernels (float32 matmuls at
# "highest": the tests' tolerances are the CPU's), then Shampoo (defaults) against the fastest
# AdamW step (one microbatch), gpt2-small, 64 x 1024, 3 passes (row order reversed in pass 2).
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
echo "code: b60d514 + the finite-updates skip guard + the lane-local loss kernel (device copy of the working tree)" > $OUT/commit.txt
cp benchmarks/gpu_runs/call.sh $OUT/call.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
F() { grep -v "^W11\|^I11\|^W0000\|^I0000"; }
JAX_DEFAULT_MATMUL_PRECISION=highest PYTHONPATH=. timeout 200 python -m pytest -q -p no:cacheprovider tests/models/test_models_loss.py tests/models/test_models_norm.py tests/optim/test_train_step_contract.py 2>&1 | tail -15 > $OUT/tests.txt; tail -3 $OUT/tests.txt
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
A=data1+b64+m1
S=$A+optshampoo
for p in 1 2 3; do if [ $p = 2 ]; then CC=$S,$A; else CC=$A,$S; fi
timeout 120 env PYTHONPATH=. python benchmarks/mesh_throughput.py --steps 31 --unroll 0 --configs $CC --same-process --jsonl $OUT/mesh.jsonl 2>&1 | F >> $OUT/log.txt; grep "^| data" $OUT/log.txt | tail -2 | cut -c1-200; done
