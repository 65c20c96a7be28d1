"""How much larger is ungrafted Shampoo's update than AdamW's? (the learning-rate scale of
``graft="none"``).

Trains the tiny LM preset on the embedded corpus with grafted Shampoo (AdamW's learning rate)
and, every few steps, compares per preconditioned tensor the Frobenius norm of the ungrafted
direction P_L M P_R with the Adam direction m_hat / (sqrt(v_hat) + eps) that grafting scales
it to. The median ratio r says: ungrafted Shampoo at learning rate lr / r takes steps of
AdamW's size at lr.

    python experiments/shampoo_graft_scale.py [--steps 60]
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import scaleopt.optim as so
from scaleopt.optim import shampoo_lib as S
from scaleopt.train import bridge, data


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=60)
  args = ap.parse_args(argv)
  model = bridge.make_model({"preset": "tiny", "dtype": "float32"})
  params = model.init(jax.random.PRNGKey(0))
  train_w, _ = data.open_split("embedded", None, "train", 128)
  it = data.Batches(train_w, 16, 1, seed=0)
  tx = so.shampoo(3e-3, block_size=512, root_every=5, graft="adam")
  st = tx.init(params)

  @jax.jit
  def step(p, st, tokens):
    stats = so.collect(model.loss_fn, p, tokens, st)
    u, st = tx.update(stats.numerator, st, p, bc_stats=stats)
    return optax.apply_updates(p, u), st, stats.loss

  ratios = []
  for t in range(args.steps):
    params, st, loss = step(params, st, jnp.asarray(it.next()["tokens"]))
    if t >= 10 and t % 5 == 4:
      sh = st[0]
      leaves = jax.tree.leaves(params)
      mu, nu = jax.tree.leaves(sh.mu), jax.tree.leaves(sh.nu)
      n = float(sh.count)
      for k, f in sh.factors.items():
        i = int(k)
        blk = S.blocking(leaves[i].shape, 512)
        u = jnp.matmul(jnp.matmul(f.PL, S.to_blocks(mu[i], blk)), f.PR)
        adam = (mu[i] / (1 - 0.9 ** n)) / (jnp.sqrt(nu[i] / (1 - 0.95 ** n)) + 1e-8)
        ratios.append(float(jnp.linalg.norm(u)) / float(jnp.linalg.norm(adam)))
  r = np.asarray(ratios)
  print(f"loss {float(loss):.3f}; ||P_L M P_R|| / ||Adam direction|| over {r.size} "
        f"(tensor, step) pairs: median {np.median(r):.3g}, 10%-90% "
        f"[{np.quantile(r, 0.1):.3g}, {np.quantile(r, 0.9):.3g}]")
  return 0


if __name__ == "__main__":
  sys.exit(main())
