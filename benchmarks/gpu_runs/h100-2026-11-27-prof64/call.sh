set -o pipefail
# Where the one-GPU step's time goes at 64 sequences (the loss kernel on): every kernel with its
# traffic and bandwidth (fusions), and the compiled HLO to map fusions to the model's ops.
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
echo "code: c1b6855 + profile_step.py --top/--hlo (device copy of the working tree)" > $OUT/commit.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
PYTHONPATH=. python benchmarks/profile_step.py --batch 64 --steps 3 --top 120 --hlo $OUT/hlo.txt 2>&1 | grep -v "^W1127\|^I1127\|^W0000\|^I0000" > $OUT/profile.txt
gzip $OUT/hlo.txt
head -60 $OUT/profile.txt
