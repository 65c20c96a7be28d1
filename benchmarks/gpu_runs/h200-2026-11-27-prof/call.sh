set -o pipefail
# H200: the kernels and the new guard (default) against XLA's forms of the loss and norm
# (+mnorm_kernel=xla+mloss_kernel=xla) and the previous guard, 2 passes (order reversed in
# pass 2); then a profile of the default step at 64 sequences with its HLO.
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
echo "code: b60d514 + the finite-updates skip guard (device copy of the working tree)" > $OUT/commit.txt
cp benchmarks/gpu_runs/call.sh $OUT/call.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
F() { grep -v "^W11\|^I11\|^W0000\|^I0000"; }
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
B=data1+b64+m1
X=mnorm_kernel=xla+mloss_kernel=xla+rupdate_guard=always
C=$B,$B+$X
R=$B+$X,$B
for p in 1 2; do if [ $p = 2 ]; then CC=$R; else CC=$C; fi
timeout 150 env PYTHONPATH=. python benchmarks/mesh_throughput.py --steps 31 --unroll 0 --configs $CC --same-process --jsonl $OUT/mesh.jsonl 2>&1 | F >> $OUT/log.txt; grep "^| data" $OUT/log.txt | tail -2 | cut -c1-200; done
timeout 150 env PYTHONPATH=. python benchmarks/profile_step.py --batch 64 --steps 3 --top 60 --hlo $OUT/hlo.txt 2>&1 | F > $OUT/profile.txt; head -75 $OUT/profile.txt; gzip $OUT/hlo.txt
