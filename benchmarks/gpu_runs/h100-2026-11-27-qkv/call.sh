set -o pipefail
# (1) A Pallas Triton matmul against cuBLAS at the MLP shapes, and with the SwiGLU in its
# epilogue; (2) the training system with v from its own matmul (+mfuse_qkv=false) against the
# default (3 passes, row order reversed in pass 2).
# (Part 1 gave no result: its kernels called pl.dot, which jax 0.11 no longer has; the script
# was then removed.)
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
echo "code: c1b6855 + add_rms_norm kernels + fuse_qkv (device copy of the working tree)" > $OUT/commit.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
F() { grep -v "^W1127\|^I1127\|^W0000\|^I0000"; }
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
timeout 200 env PYTHONPATH=. python benchmarks/pallas_matmul.py 2>&1 | F > $OUT/matmul.txt; grep "^|" $OUT/matmul.txt
X=mfuse_qkv=false
C=data1+b64+m1,data1+b64+m1+$X
R=data1+b64+m1+$X,data1+b64+m1
for p in 1 2 3; do if [ $p = 2 ]; then CC=$R; else CC=$C; fi
timeout 150 env PYTHONPATH=. python benchmarks/mesh_throughput.py --steps 31 --unroll 0 --configs $CC --same-process --jsonl $OUT/mesh.jsonl 2>&1 | F >> $OUT/log.txt; grep "^| data" $OUT/log.txt | tail -2; done
