set -o pipefail
# The residual add + RMS norm as Pallas kernels: the kernels alone (configs of rows/warps, XLA
# as baseline), the training system with them against +mnorm_kernel=xla (3 passes, row order
# reversed in pass 2), and a profile of the new step at 64 sequences.
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
echo "code: c1b6855 + add_rms_norm kernels (device copy of the working tree)" > $OUT/commit.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
F() { grep -v "^W1127\|^I1127\|^W0000\|^I0000"; }
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
timeout 150 env PYTHONPATH=. python benchmarks/norm_kernel.py 2>&1 | F > $OUT/kernel.txt; grep "^|" $OUT/kernel.txt
X=mnorm_kernel=xla
C=data1+b64+m1,data1+b64+m1+$X
R=data1+b64+m1+$X,data1+b64+m1
for p in 1 2 3; do if [ $p = 2 ]; then CC=$R; else CC=$C; fi
timeout 150 env PYTHONPATH=. python benchmarks/mesh_throughput.py --steps 31 --unroll 0 --configs $CC --same-process --jsonl $OUT/mesh.jsonl 2>&1 | F >> $OUT/log.txt; grep "^| data" $OUT/log.txt | tail -2; done
timeout 120 env PYTHONPATH=. python benchmarks/profile_step.py --batch 64 --steps 3 --top 60 2>&1 | F > $OUT/profile.txt; head -40 $OUT/profile.txt
