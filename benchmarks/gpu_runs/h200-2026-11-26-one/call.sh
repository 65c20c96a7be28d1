set -o pipefail
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
echo "code: 5237add plus uncommitted offload_statistics (device copy of the working tree)" > $OUT/commit.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
for p in 1 2 3; do timeout 120 env PYTHONPATH=. python benchmarks/mesh_throughput.py --steps 31 --unroll 0 --configs data1+b64+m1,data1+b64+m1+optshampoo,data1+b64+m1+optshampoo+eroot_every=1000 --same-process --jsonl $OUT/mesh.jsonl 2>&1 | grep -v "^W1126\|^I1126" >> $OUT/log.txt; grep "^# data" $OUT/log.txt | tail -3; done
# accum.txt (same call) came from a temporary experiment, not in the repository: the same
# train_throughput.py command (--unroll 0 --micro 1,4 --steps 30) with and without the
# microbatch lax.scan in scaleopt/optim/collect.py:fold_microbatches fully unrolled
# (SCALEOPT_UNROLL_MB=1 set unroll=True there); profile.txt is the previous call's
# `python benchmarks/profile_step.py --batch 32 --micro 1 --steps 3` on the same H200 machine.
