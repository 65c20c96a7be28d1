"""The reference clip (``clip_numerator_only``): per optimizer and form, the updates of three
steps against float64 NumPy transcriptions of the authors' equations.

The reference scales the numerator (what enters the first moment) by
c = min(1, max_norm / ||numerator||) and computes every second-moment statistic from the
unclipped gradients; its leave-one-out form feeds both persistent moments the clipped g_full.
Each test also checks that the same transcription with c changed by 10% lies outside the
tolerance, so a 10% error of the clip factor fails it.

Microbatch gradients are the microbatch data (loss sum(p * g_j)), so the transcriptions start
from the exact per-microbatch gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scaleopt.optim as so

B1, B2, EPS = 0.9, 0.95, 1e-8
MAX_NORM = 0.05
STEPS = 3


def _grads(m, shapes, seed=0):
  """{name: [STEPS, m, *shape]} float64 gradients with a per-coordinate signal."""
  rng = np.random.default_rng(seed)
  return {k: rng.normal(0.3, 1.0, (STEPS, m) + s) * np.linspace(0.5, 2.0, s[-1])
          for k, s in shapes.items()}


def _loss(p, mb):
  return sum(jnp.sum(p[k] * mb[k]) for k in p), {}


def _run(tx, g, **collect_kw):
  """Updates of STEPS steps of ``tx`` (float32) on the gradient stream ``g``."""
  params = {k: jnp.zeros(v.shape[2:], jnp.float32) for k, v in g.items()}
  st = tx.init(params)

  @jax.jit
  def step(st, mbs):
    stats = so.collect(_loss, params, mbs, st, **collect_kw)
    return tx.update(stats.numerator, st, params, bc_stats=stats)

  out = []
  for s in range(STEPS):
    u, st = step(st, {k: jnp.asarray(v[s], jnp.float32) for k, v in g.items()})
    out.append({k: np.asarray(x, np.float64) for k, x in u.items()})
  return out


def _clip(num, scale=1.0):
  norm = np.sqrt(sum(np.sum(x * x) for x in num.values()))
  return scale * min(1.0, MAX_NORM / norm)


def _check(ours, ref_fn, rtol=1e-5, atol=1e-9, sensitive=True):
  """ours == ref_fn(1.0) per coordinate; ref_fn(1.1) (clip factor 10% larger) is not."""
  ref, off = ref_fn(1.0), ref_fn(1.1)
  for s in range(STEPS):
    for k in ref[s]:
      np.testing.assert_allclose(ours[s][k], ref[s][k], rtol=rtol, atol=atol)
  if not sensitive:
    return
  far = max(np.max(np.abs(ours[s][k] - off[s][k]) / (atol + rtol * np.abs(off[s][k])))
            for s in range(STEPS) for k in off[s])
  assert far > 10.0, "a 10% larger clip factor would pass this tolerance"


def _adam_ref(g, scale, *, form, alpha=1.0, adaptive=False, alpha_sq=False):
  """AdamW (lr 1, wd 0) of the reference's A/B code: ``std`` (one group), ``cf`` (alpha mix of
  the unclipped g_A^2 with B's mean of squares; ``adaptive``: alpha times the clipped cosine of
  g_A^2 and x_B per tensor) or ``full`` (cf + post-EMA Var(p_bar), not scaled by alpha^2
  unless ``alpha_sq``)."""
  mu = {k: 0.0 for k in g}
  nu = {k: 0.0 for k in g}
  out = []
  for s in range(STEPS):
    t = s + 1
    bc1, bc2 = 1 - B1 ** t, 1 - B2 ** t
    m = next(iter(g.values())).shape[1]
    if form == "std":
      num = {k: v[s].mean(0) for k, v in g.items()}
      x = {k: num[k] ** 2 for k in g}
    else:
      num = {k: v[s][:m // 2].mean(0) for k, v in g.items()}
      x, al = {}, {}
      for k, v in g.items():
        s_a, s_b = num[k] ** 2, (v[s][m // 2:] ** 2).mean(0)
        cos = np.sum(s_a * s_b) / (np.linalg.norm(s_a) * np.linalg.norm(s_b))
        al[k] = alpha * np.clip(cos, 0.0, 1.0) if adaptive else alpha
        x[k] = (1 - al[k]) * s_a + al[k] * s_b
    c = _clip(num, scale)
    u = {}
    for k in g:
      var_p = 0.0
      if form == "full":
        p_j = np.sqrt((B2 * nu[k] + (1 - B2) * g[k][s][m // 2:] ** 2) / bc2)
        var_p = p_j.var(0, ddof=1) / (m // 2) * (al[k] ** 2 if alpha_sq else 1.0)
      mu[k] = B1 * mu[k] + (1 - B1) * c * num[k]
      nu[k] = B2 * nu[k] + (1 - B2) * x[k]
      d = np.sqrt(nu[k] / bc2) + EPS
      u[k] = -(mu[k] / bc1) * np.maximum(1 / d - var_p / d ** 3, 0.0)
    out.append(u)
  return out


def _clipped(alias, **kw):
  return optax.chain(so.clip_by_global_norm(MAX_NORM, numerator_only=True),
                     alias(1.0, B1, B2, EPS, weight_decay=0.0, **kw))


def test_adamw_std_reference_clip():
  g = _grads(4, {"w": (3, 4), "b": (4,)})
  ours = _run(_clipped(so.adamw_bc, mode="std"), g)
  _check(ours, lambda sc: _adam_ref(g, sc, form="std"))


def test_adamw_cf_alpha_mix_reference_clip():
  g = _grads(8, {"w": (3, 4), "b": (4,)}, seed=1)
  ours = _run(_clipped(so.adamw_bc, mode="cf", crossfit="ab", v_source="mean_sq",
                       crossfit_alpha=0.5), g)
  _check(ours, lambda sc: _adam_ref(g, sc, form="cf", alpha=0.5))


def test_adamw_full_reference_clip():
  g = _grads(8, {"w": (3, 4), "b": (4,)}, seed=2)
  ours = _run(_clipped(so.adamw_bc, mode="full", crossfit="ab", v_source="mean_sq",
                       correction="reference_post_ema"), g)
  _check(ours, lambda sc: _adam_ref(g, sc, form="full"))


def test_adamw_full_adaptive_alpha_reference_post_ema():
  """Adaptive alpha with the reference post-EMA variance: Var(p_bar) enters unscaled (the
  authors' code); the alpha^2-scaled form differs by more than the tolerance."""
  g = _grads(8, {"w": (3, 4), "b": (4,)}, seed=6)
  ours = _run(_clipped(so.adamw_bc, mode="full", crossfit="ab", v_source="mean_sq",
                       correction="reference_post_ema", crossfit_alpha=0.5,
                       crossfit_alpha_adaptive=True), g)
  _check(ours, lambda sc: _adam_ref(g, sc, form="full", alpha=0.5, adaptive=True))
  with_sq = _adam_ref(g, 1.0, form="full", alpha=0.5, adaptive=True, alpha_sq=True)
  assert max(np.max(np.abs(ours[s][k] - with_sq[s][k]) / np.abs(with_sq[s][k]))
             for s in range(STEPS) for k in g) > 1e-4


def _loo_ref(g, scale, clip="numerator", sparse=("emb",)):
  """The hybrid leave-one-out AdamW, c from the norm of g_full over all tensors. ``numerator``
  (the authors'): dense tensors get the LOO update from the unclipped g_r (persistent m, v from
  the clipped g_full); sparse tensors plain AdamW with m from the clipped and v from the
  unclipped g_full. ``consistent``: every gradient scaled by c. ``none``: c = 1."""
  mu = {k: 0.0 for k in g}
  nu = {k: 0.0 for k in g}
  out = []
  for s in range(STEPS):
    t = s + 1
    bc1, bc2 = 1 - B1 ** t, 1 - B2 ** t
    gf = {k: v[s].mean(0) for k, v in g.items()}
    c = _clip(gf, scale) if clip != "none" else 1.0
    cs = c if clip == "consistent" else 1.0  # the scale of the statistics
    gf_s = {k: cs * v for k, v in gf.items()}
    u = {}
    for k, gk in g.items():
      gr = cs * gk[s]
      m = gr.shape[0]
      if k in sparse:
        mu[k] = B1 * mu[k] + (1 - B1) * c * gf[k]
        nu[k] = B2 * nu[k] + (1 - B2) * gf_s[k] ** 2
        u[k] = -(mu[k] / bc1) / (np.sqrt(nu[k] / bc2) + EPS)
        continue
      g_mr = (m * gf_s[k] - gr) / (m - 1)
      m_hat = (B1 * mu[k] + (1 - B1) * gr) / bc1
      d = np.sqrt(np.maximum((B2 * nu[k] + (1 - B2) * g_mr ** 2) / bc2, 0.0)) + EPS
      first, third = (m_hat / d).mean(0), (m_hat / d ** 3).mean(0)
      corr = first - d.var(0, ddof=1) * third
      u[k] = -np.where(corr * first >= 0, corr, 0.0)
      mu[k] = B1 * mu[k] + (1 - B1) * c * gf[k]
      nu[k] = B2 * nu[k] + (1 - B2) * (c * gf[k]) ** 2
    out.append(u)
  return out


@pytest.mark.parametrize("clip", ["numerator", "consistent", "none"])
def test_adamw_loo_hybrid_both_branches_under_each_clip(clip):
  """The headline form: dense (LOO + Jensen) and embedding (full-batch AdamW) branches, per
  coordinate, under the authors' clip, the consistent clip and no clip."""
  g = _grads(6, {"w": (3, 4), "emb": (5, 4)}, seed=3)
  sparse = lambda p: {k: k == "emb" for k in p}
  opt = so.adamw_bc(1.0, B1, B2, EPS, weight_decay=0.0, sparse_filter=sparse)
  tx = {"numerator": _clipped(so.adamw_bc, sparse_filter=sparse),
        "consistent": optax.chain(so.clip_by_global_norm(MAX_NORM), opt), "none": opt}[clip]
  ours = _run(tx, g)
  # atol: float32 cancellation where the Jensen term removes ~90% of a fold average. The
  # consistent clip scales every statistic alike, so Adam's scale invariance hides its factor
  # (only the first step's eps sees it): there the check is the update itself.
  _check(ours, lambda sc: _loo_ref(g, sc, clip), rtol=1e-5, atol=2e-6,
         sensitive=clip == "numerator")


def test_sophia_reference_clip():
  """m from c g (c of the numerator's norm), h and the clip of m * inv untouched by c."""
  rng = np.random.default_rng(4)
  g = _grads(4, {"w": (3, 2)}, seed=4)
  x = jnp.asarray(rng.normal(size=(STEPS, 4, 5, 3)), jnp.float32)
  rho, k_ref, cl = 0.05, 2, 3.0
  tx = _clipped(so.sophia, rho=rho, k=k_ref, clip=cl)
  params = {"w": jnp.zeros((3, 2), jnp.float32)}
  loss = lambda p, mb: (jnp.sum(p["w"] * mb["g"]), {})
  logits = lambda p, mb: (mb["x"] @ (p["w"] + 0.3), jnp.ones(mb["x"].shape[:-1]))
  st = tx.init(params)
  ours, hs = [], []
  for s in range(STEPS):
    mbs = {"g": jnp.asarray(g["w"][s], jnp.float32), "x": x[s]}
    stats = so.collect(loss, params, mbs, st, key=jax.random.PRNGKey(s), logits_fn=logits)
    u, st = tx.update(stats.numerator, st, params, bc_stats=stats)
    ours.append({"w": np.asarray(u["w"], np.float64)})
    hs.append(np.asarray(stats.precond.h_step["w"], np.float64))

  def ref(scale):
    mu, h, out = 0.0, 0.0, []
    b1, b2, eps = B1, B2, EPS
    for s in range(STEPS):
      num = {"w": g["w"][s].mean(0)}
      c = _clip(num, scale)
      if s % k_ref == 0:  # the curvature comes from sampled labels, not from the gradient
        h = b2 * h + (1 - b2) * hs[s]
      mu = b1 * mu + (1 - b1) * c * num["w"]
      out.append({"w": -np.clip(mu / (rho * h + eps), -cl, cl)})
    return out

  _check(ours, ref, rtol=1e-5, atol=1e-9)


def _inv_root(f, damping=1e-6, floor=1e-9, var=None):
  lam, q = np.linalg.eigh(f + damping * np.eye(len(f)))
  lam = np.maximum(lam, floor)
  d = lam ** -0.25
  if var is not None:
    d = np.maximum(d - (5 / 32) * lam ** (-9 / 4) * var, 0.0)
  return (q * d) @ q.T, q


def _shampoo_ref(g, scale, *, mode, root_every, damping, cscale=1.0):
  """Ungrafted Shampoo on "w" (float64 eigh) with an AdamW fallback on "b": std (factors from
  the unclipped full gradient) or full (A/B, root every step: factors from B's mean outer
  products, eigenvalue variances from B's projections on the new bases)."""
  L = R = 0.0
  PL, PR = np.eye(g["w"].shape[2]), np.eye(g["w"].shape[3])
  M, mb_, vb_ = 0.0, 0.0, 0.0
  out = []
  for s in range(STEPS):
    t = s + 1
    gw = g["w"][s]
    m = gw.shape[0]
    grp = slice(0, m // 2) if mode == "full" else slice(0, m)
    num = {k: v[s][grp].mean(0) for k, v in g.items()}
    c = _clip(num, scale)
    if mode == "std":
      L = B2 * L + (1 - B2) * num["w"] @ num["w"].T
      R = B2 * R + (1 - B2) * num["w"].T @ num["w"]
      if s % root_every == 0:
        PL, PR = _inv_root(L, damping, 1e-3 * damping)[0], _inv_root(R, damping, 1e-3 * damping)[0]
    else:
      gb = gw[m // 2:]
      L = B2 * L + (1 - B2) * np.mean([x @ x.T for x in gb], 0)
      R = B2 * R + (1 - B2) * np.mean([x.T @ x for x in gb], 0)
      _, ql = _inv_root(L, damping, 1e-3 * damping)
      _, qr = _inv_root(R, damping, 1e-3 * damping)
      pl = np.array([np.sum((ql.T @ x) ** 2, 1) for x in gb])
      pr = np.array([np.sum((x @ qr) ** 2, 0) for x in gb])
      k_ = cscale * (1 - B2) ** 2 / len(gb)
      PL = _inv_root(L, damping, 1e-3 * damping, k_ * pl.var(0, ddof=1))[0]
      PR = _inv_root(R, damping, 1e-3 * damping, k_ * pr.var(0, ddof=1))[0]
    M = B1 * M + (1 - B1) * c * num["w"]
    mb_ = B1 * mb_ + (1 - B1) * c * num["b"]
    vb_ = B2 * vb_ + (1 - B2) * num["b"] ** 2
    ub = (mb_ / (1 - B1 ** t)) / (np.sqrt(vb_ / (1 - B2 ** t)) + EPS)
    out.append({"w": -(PL @ M @ PR), "b": -ub})
  return out


@pytest.mark.parametrize("mode", ["std", "full"])
def test_shampoo_reference_clip(mode):
  """Factors (std) and the AdamW fallback's v from the unclipped gradient; M and the
  fallback's m from the clipped numerator."""
  g = _grads(8, {"w": (4, 3), "b": (3,)}, seed=5)
  damping, root_every = 1e-2, (2 if mode == "std" else 1)
  tx = _clipped(so.shampoo, graft="none", block_size=64, root_every=root_every, mode=mode,
                damping=damping, root_method="eigh", matmul_precision="highest",
                stats_precision="highest")
  ours = _run(tx, g)
  ref = lambda sc, cs=1.0: _shampoo_ref(g, sc, mode=mode, root_every=root_every,
                                        damping=damping, cscale=cs)
  _check(ours, ref, rtol=1e-4, atol=1e-7)
  if mode == "full":  # the (5/32) coefficient 10% larger lies outside the tolerance too
    off = ref(1.0, 1.1)
    assert max(np.max(np.abs(ours[s]["w"] - off[s]["w"]) / (1e-7 + 1e-4 * np.abs(off[s]["w"])))
               for s in range(STEPS)) > 10.0
