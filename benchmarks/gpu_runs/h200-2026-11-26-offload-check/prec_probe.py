import sys, jax, numpy as np
sys.path.insert(0, "tests/train")
from train_helpers import compiled_steps, tiny_raw
def run(off, prec):
  ex = {"block_size": 16, "root_every": 2, "stats_every": 2, "offload_statistics": off}
  if prec: ex.update(matmul_precision=prec, stats_precision=prec, newton_precision=prec)
  raw = tiny_raw(model={"n_layers": 2}, optimizer={"name": "shampoo", "learning_rate": 3e-3, "schedule": {"kind": "constant", "warmup_steps": 0}, "extra": ex}, data={"microbatches": 4}, run={"eval_every": 0, "tensorboard": False})
  fns, st, step, bs = compiled_steps(raw, steps=4)
  st0 = jax.device_get(st.params)
  for b in bs: st, _ = step(st, b)
  return jax.device_get(st.params), st0
for prec in [None, "highest"]:
  a, p0 = run(False, prec); b, _ = run(True, prec)
  mv = max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(p0)))
  d = max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
  print(f"precision {prec}: max |offload - device| {d:.3e}, max movement {mv:.3e}, ratio {d/mv:.2e}")
