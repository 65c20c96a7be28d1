"""Loss and update norm of the first steps of SOAP, SOAP-BC and AdamW-BC on the CPU stand-in
of benchmarks/optim_step_cost.py --quick (vocabulary 512, d 64, 2 layers, one fixed batch of 4
microbatches x 2 x 64 tokens, lr 1e-4 constant, 30 steps), per step "loss/|update|", and
the largest update norm of the 30 steps:

  PYTHONPATH=. python lab/cpu/soap_bc_first_steps.py soap soap_bc soap_bc_w1 soap_bc_w5 adamw_bc

Names: optim_step_cost's CONFIGS, plus soap_bc_wK (SOAP-BC with std_warmup_steps=K).
docs/optim_soap.md, "The first corrected steps", quotes its output.
"""

import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, "benchmarks")
import optim_step_cost as o  # noqa: E402
from scaleopt.optim import build, collect  # noqa: E402


def main(names):
  vocab, d, layers, heads, seq, mb_seqs, m = 512, 64, 2, 4, 64, 2, 4
  init, _, loss_fn = o.model(vocab, d, layers, heads, seq)
  params0 = jax.jit(init)(jax.random.PRNGKey(0))
  rng = np.random.default_rng(0)
  mbs = {"tokens": jnp.asarray(rng.integers(0, vocab, (m, mb_seqs, seq)), jnp.int32),
         "targets": jnp.asarray(rng.integers(0, vocab, (m, mb_seqs, seq)), jnp.int32),
         "mask": jnp.ones((m, mb_seqs, seq), jnp.float32)}
  for name in names:
    w = re.fullmatch(r"soap_bc_w(\d+)", name)
    cfg = (dict(name="soap_bc", extra=dict(std_warmup_steps=int(w.group(1)))) if w
           else o.CONFIGS[name])
    tx, _ = build(dict(cfg, learning_rate=1e-4, schedule={"kind": "constant"}))

    @jax.jit
    def step(p, st):
      s = collect(loss_fn, p, mbs, st)
      u, st = tx.update(s.numerator, st, p, bc_stats=s)
      return optax.apply_updates(p, u), st, s.loss, optax.global_norm(u)

    p, st, out, norms = params0, tx.init(params0), [], []
    for _ in range(30):
      p, st, loss, un = step(p, st)
      out.append(f"{float(loss):.2f}/{float(un):.1e}")
      norms.append(float(un))
    big = int(np.argmax(norms))
    print(f"{name:12s} steps 0-5: {' '.join(out[:6])}  steps 28-29: {' '.join(out[-2:])}  "
          f"largest update {norms[big]:.1e} at step {big}")


if __name__ == "__main__":
  main(sys.argv[1:] or ["soap", "soap_bc", "soap_bc_w1", "soap_bc_w5", "adamw_bc"])
