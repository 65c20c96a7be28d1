set -o pipefail
# The loss kernel's block and warp count at gpt2-small's shapes; the fastest at 32,768 tokens is
# written into scaleopt/models/kernels.py (BLOCK, NUM_WARPS) of this device copy for the
# training rows (AdamW, one GPU, gpt2-small), 3 passes, row order reversed in pass 2,
# +mloss_kernel=xla rows the same-run baseline.
export JAX_COMPILATION_CACHE_DIR=$PWD/.jaxcache
echo "code: $(cat .commit) (device copy of the working tree)" > $OUT/commit.txt
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/env.txt
F() { grep -v "^W1127\|^I1127\|^W0000\|^I0000"; }
export XLA_FLAGS="--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_latency_hiding_scheduler=true"
timeout 120 env PYTHONPATH=. python benchmarks/loss_kernel.py --tokens 32768 --reps 30 2>&1 | F > $OUT/kernel.txt; grep "^|" $OUT/kernel.txt
best=$(grep "^| pallas b" $OUT/kernel.txt | sort -t'|' -k3 -n | head -1 | sed -E 's/^\| pallas b([0-9]+) w([0-9]+).*/\1 \2/')
[ -n "$best" ] || exit 1; set -- $best
sed -i -E "s/^BLOCK = [0-9]+/BLOCK = $1/; s/^NUM_WARPS = [0-9]+/NUM_WARPS = $2/" scaleopt/models/kernels.py
echo "training rows with BLOCK=$1 NUM_WARPS=$2" | tee -a $OUT/commit.txt
X=mloss_kernel=xla
C=data1+b64+m1,data1+b64+m1+$X,data1+b128+m1,data1+b128+m1+$X,data1+b32+m1,data1+b32+m1+$X,data1+b64+m4,data1+b32+m4
R=data1+b32+m4,data1+b64+m4,data1+b32+m1+$X,data1+b32+m1,data1+b128+m1+$X,data1+b128+m1,data1+b64+m1+$X,data1+b64+m1
for p in 1 2 3; do if [ $p = 2 ]; then CC=$R; else CC=$C; fi
timeout 200 env PYTHONPATH=. python benchmarks/mesh_throughput.py --steps 31 --unroll 0 --configs $CC --same-process --jsonl $OUT/mesh.jsonl 2>&1 | F >> $OUT/log.txt; grep "^| data" $OUT/log.txt | tail -8; done
