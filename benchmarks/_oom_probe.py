import sys, json, traceback, jax
sys.path.insert(0, "benchmarks")
import mesh_throughput as mt
mt._no_final_checkpoint()
D = dict(preset="gpt2-small", batch=64, seq=1024, micro=1, unroll=0, steps=int(sys.argv[2]), dtype="bfloat16", platform="gpu", fit_probe=[8,16])
def mem():
    s = jax.devices()[0].memory_stats() or {}
    return {k: round(v/2**30, 2) for k, v in s.items() if "bytes" in k}
for name in sys.argv[1].split(","):
    try:
        r = mt.run_one(mt.parse(name, D))
        print(name, f"{r['tokens_per_s']:.0f} tok/s compile {r['compile_s']:.1f}", mem(), flush=True)
    except Exception as e:
        print(name, "FAILED", str(e)[:200], mem(), flush=True)
