set -o pipefail
# (Run on the committed code after the fuse_qkv option was removed: its rows end in a
# ConfigError naming the unknown key, as a removed key should.)
# The training system with the add + norm kernels (default) against +mnorm_kernel=xla (the
# previous default) and +mfuse_qkv=false, and 4 x 16 accumulation with the defaults; gpt2-small,
# 64 sequences, AdamW, 3 passes (row order reversed in pass 2). Then the kernels alone.
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
echo "code: 8bfcd5d (device copy of the working tree)" > $OUT/commit.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
F() { grep -v "^W1127\|^I1127\|^W0000\|^I0000"; }
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
B=data1+b64
C=$B+m1,$B+m1+mnorm_kernel=xla,$B+m1+mfuse_qkv=false,$B+m4
R=$B+m4,$B+m1+mfuse_qkv=false,$B+m1+mnorm_kernel=xla,$B+m1
for p in 1 2 3; do if [ $p = 2 ]; then CC=$R; else CC=$C; fi
timeout 170 env PYTHONPATH=. python benchmarks/mesh_throughput.py --steps 31 --unroll 0 --configs $CC --same-process --jsonl $OUT/mesh.jsonl 2>&1 | F >> $OUT/log.txt; grep "^| data" $OUT/log.txt | tail -4; done
timeout 100 env PYTHONPATH=. python benchmarks/norm_kernel.py --d 768 2>&1 | F > $OUT/kernel.txt; grep "^|" $OUT/kernel.txt
