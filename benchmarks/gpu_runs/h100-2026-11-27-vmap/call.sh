set -o pipefail
# The Pallas kernels on the GPU: (1) the kernel tests with the compiled kernels (float32
# matmuls at full precision: GPU float32 matmuls default to TF32, the tests' tolerances are the
# CPU's); (2) the kernels under the collector's vmapped microbatches (adamw_bc, 4 microbatches
# vmapped) against XLA's forms, 2 passes, order reversed in pass 2.
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
echo "code: the add_rms_norm kernels commit (device copy of the working tree)" > $OUT/commit.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
F() { grep -v "^W1127\|^I1127\|^W0000\|^I0000"; }
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 200 env PYTHONPATH=. python -m pytest -q -p no:cacheprovider tests/models/test_models_norm.py tests/models/test_models_loss.py -k "not meshes" 2>&1 | tail -15 > $OUT/tests.txt; cat $OUT/tests.txt
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
B=data1+b64+m4+optadamw_bc+evmap_microbatches=true
X=+mnorm_kernel=xla+mloss_kernel=xla
for CC in $B,$B$X $B$X,$B; do
timeout 170 env PYTHONPATH=. python benchmarks/mesh_throughput.py --steps 21 --unroll 0 --configs $CC --same-process --jsonl $OUT/mesh.jsonl 2>&1 | F >> $OUT/log.txt; grep "^| data" $OUT/log.txt | tail -2; done
