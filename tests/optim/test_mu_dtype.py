"""bf16 first moments (``mu_dtype``) for adamw, adamw_bc, sophia and Shampoo, against
``optax.adamw(mu_dtype=bfloat16)``.

The reference stores m in bf16 too, so a transform that keeps m in float32 (the option
ignored) differs from it by the bf16 rounding of m, ~1e-3 of the movement; the checks below
are two orders tighter, and each test also checks that float32 m is farther from the
reference than that bound.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from scaleopt.optim import adam_bc, build, collect, shampoo_lib

BF16 = jnp.bfloat16


def _params():
  rng = np.random.default_rng(0)
  return {"w": jnp.asarray(rng.normal(size=(8, 6)), jnp.float32),
          "b": jnp.asarray(rng.normal(size=(6,)), jnp.float32)}


def _grads(steps):
  rng = np.random.default_rng(1)
  return [{"w": jnp.asarray(rng.normal(size=(8, 6)), jnp.float32),
           "b": jnp.asarray(rng.normal(size=(6,)), jnp.float32)} for _ in range(steps)]


def _run(tx, steps=6):
  p = _params()
  st = tx.init(p)
  for g in _grads(steps):
    u, st = tx.update(g, st, p)
    p = optax.apply_updates(p, u)
  return p, st


def _diff(a, b):
  return max(float(jnp.max(jnp.abs(a[k] - b[k]))) for k in a)


def _moved(p):
  return max(float(jnp.max(jnp.abs(p[k] - _params()[k]))) for k in p)


def _check(make, mu_of):
  """``make(mu_dtype)`` -> transform; compares with optax.adamw(mu_dtype=bf16)."""
  ref, ref_st = _run(optax.adamw(1e-2, 0.9, 0.95, 1e-8, weight_decay=0.1, mu_dtype=BF16))
  got, st = _run(make(BF16))
  f32, _ = _run(make(None))
  mu, ref_mu = mu_of(st), ref_st[0].mu
  for k in ref_mu:
    assert mu[k].dtype == BF16, (k, mu[k].dtype)
    # per coordinate: the stored moments agree to one bf16 rounding
    ulp = jnp.abs(ref_mu[k].astype(jnp.float32)) * 2.0 ** -7 + 1e-30
    assert bool(jnp.all(jnp.abs(mu[k].astype(jnp.float32) - ref_mu[k].astype(jnp.float32))
                        <= ulp)), k
  bound = 1e-5 * _moved(ref)
  assert _diff(got, ref) <= bound, (_diff(got, ref), bound)
  assert _diff(f32, ref) > 10 * bound, "float32 m would pass too: the test is not sensitive"


def test_adamw_bc_std_bf16_moment_equals_optax():
  _check(lambda dt: adam_bc.adamw_bc(1e-2, mode="std", mu_dtype=dt),
         lambda st: st[0].mu)


def test_shampoo_fallback_bf16_moment_equals_optax():
  # every tensor excluded from the factors: Shampoo is its AdamW fallback
  make = lambda dt: shampoo_lib.shampoo(1e-2, exclude=lambda p: jax.tree.map(lambda _: True, p),
                                        mu_dtype=dt)
  _check(make, lambda st: st[0].mu)


def test_build_adamw_passes_mu_dtype():
  tx, _ = build({"name": "adamw", "learning_rate": 1e-2, "schedule": {"kind": "constant"},
                 "clip_norm": 0.0, "extra": {"mu_dtype": "bfloat16"}})
  _check(lambda dt: tx if dt is not None else optax.adamw(1e-2, 0.9, 0.95, 1e-8,
                                                          weight_decay=0.1),
         lambda st: st[0].mu)


@pytest.mark.parametrize("name,extra", [("shampoo", {"block_size": 4, "root_every": 2}),
                                        ("sophia", {"k": 2})])
@pytest.mark.integration  # a training run: the second tier
def test_bf16_moment_stored_and_close_to_float32(name, extra):
  """Preconditioned paths (Shampoo factors, Sophia): m is stored in bf16 and the run stays
  within bf16 rounding of the float32-moment run."""
  rng = np.random.default_rng(0)
  p0 = {"w": jnp.asarray(rng.normal(0, 0.3, (8, 6)), jnp.float32)}
  x = jnp.asarray(rng.normal(size=(4, 5, 8)), jnp.float32)
  loss = lambda p, mb: (jnp.mean(jnp.tanh(mb @ p["w"]) ** 2), {})
  logits = lambda p, mb: (mb @ p["w"], jnp.ones(mb.shape[:-1]))
  out = {}
  for dt in (None, "bfloat16"):
    cfg = {"name": name, "learning_rate": 1e-2, "schedule": {"kind": "constant"},
           "extra": dict(extra, **({"mu_dtype": dt} if dt else {}))}
    tx, _ = build(cfg)
    p, st = p0, tx.init(p0)
    for t in range(4):
      stats = collect(loss, p, x, st, key=jax.random.PRNGKey(t), logits_fn=logits)
      u, st = tx.update(stats.numerator, st, p, bc_stats=stats)
      p = optax.apply_updates(p, u)
    out[dt] = (p, st)
  mu = out["bfloat16"][1][1][0].mu["w"]
  assert mu.dtype == BF16
  moved = _moved_from(out[None][0], p0)
  d = float(jnp.max(jnp.abs(out["bfloat16"][0]["w"] - out[None][0]["w"])))
  assert 0 < d <= 2e-2 * moved, (d, moved)


def _moved_from(p, p0):
  return max(float(jnp.max(jnp.abs(p[k] - p0[k]))) for k in p)
