set -o pipefail
# The Pallas kernels (loss rows, add + norm) on 2 GPUs against XLA's forms: data2 and fsdp2
# (per device on its rows under shard_map), and adamw_bc's microbatches vmapped over the data
# axis (device microbatches: vmap with spmd_axis_name); gpt2-small, 64 sequences, 2 passes
# (fsdp2 in the first only), order reversed in pass 2.
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
echo "code: a1c3ec4 (device copy of the working tree)" > $OUT/commit.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
F() { grep -v "^W1127\|^I1127\|^W0000\|^I0000"; }
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
X=+mnorm_kernel=xla+mloss_kernel=xla
D=data2+b64+m1; S=fsdp2+b64+m1; V=data2+b64+m4+optadamw_bc+evmap_microbatches=true
for CC in $D,$D$X,$S,$S$X,$V,$V$X $V$X,$V,$D$X,$D; do
timeout 200 env PYTHONPATH=. python benchmarks/mesh_throughput.py --steps 21 --unroll 0 --configs $CC --same-process --jsonl $OUT/mesh.jsonl 2>&1 | F >> $OUT/log.txt; grep "^| \(data\|fsdp\)" $OUT/log.txt | tail -6; done
