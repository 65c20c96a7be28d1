set -o pipefail
# One GPU, the final loss kernel (the target logits gathered by XLA before the kernel): the
# loss, norm and guard tests with the compiled kernels (float32 matmuls at "highest"; the
# 4-device mesh tests are CPU-only and deselected), then the training system: defaults
# against XLA's loss (+mloss_kernel=xla) and 4 x 16 accumulation, gpt2-small, 64 x 1024,
# AdamW, 3 passes (row order reversed in pass 2).
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
echo "code: b60d514 + the finite-updates skip guard + the lane-local loss kernel with the target logits gathered by XLA (device copy of the working tree)" > $OUT/commit.txt
cp benchmarks/gpu_runs/call.sh $OUT/call.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
F() { grep -v "^W11\|^I11\|^W0000\|^I0000"; }
JAX_DEFAULT_MATMUL_PRECISION=highest PYTHONPATH=. timeout 200 python -m pytest -q -p no:cacheprovider tests/models/test_models_loss.py tests/models/test_models_norm.py tests/optim/test_train_step_contract.py -k "not meshes" 2>&1 | tail -15 > $OUT/tests.txt; tail -3 $OUT/tests.txt
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
B=data1+b64
C=$B+m1,$B+m1+mloss_kernel=xla,$B+m4
R=$B+m4,$B+m1+mloss_kernel=xla,$B+m1
for p in 1 2 3; do if [ $p = 2 ]; then CC=$R; else CC=$C; fi
timeout 150 env PYTHONPATH=. python benchmarks/mesh_throughput.py --steps 31 --unroll 0 --configs $CC --same-process --jsonl $OUT/mesh.jsonl 2>&1 | F >> $OUT/log.txt; grep "^| data" $OUT/log.txt | tail -3 | cut -c1-200; done
