"""SOAP against a float64 NumPy transcription of the published algorithm (the authors' PyTorch
step: skipped first step, eigh basis, Adam in the rotated basis with the momentum rotated back
and forth, QR power iteration with the descending sort that permutes v), per coordinate over
several steps including two basis updates: two-sided, one-sided (a side above
max_precond_dim), stacked matrices, 1-D tensors (Adam) and Shampoo's blocking. Also the GPU
path's QR call sizes (lowered for CUDA) and the refresh as one device branch."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from scaleopt import optim
from scaleopt.optim import phases
from scaleopt.optim.soap_lib import qr_basis

B1, B2, SB, EPS, FREQ, STEPS = 0.9, 0.8, 0.7, 1e-8, 3, 8


class RefSOAP:
  """One tensor of the authors' SOAP (merge_dims off, precondition_1d off, correct_bias on),
  float64; ``step(g)`` returns the update that is subtracted from the parameter at lr 1."""

  def __init__(self, shape, sides):
    """``sides``: per dim, whether it has a factor (its full length <= max_precond_dim)."""
    self.t, self.q = 0, None
    self.m, self.v = np.zeros(shape), np.zeros(shape)
    self.gg = [np.zeros((d, d)) if has else None for d, has in zip(shape, sides)]

  def _project(self, x, back=False):
    for q in self.q:
      x = np.moveaxis(x, 0, -1) if q is None else np.tensordot(x, q, axes=([0], [1 if back else 0]))
    return x

  def _update_preconditioner(self, g):
    if self.q is not None:
      self.m = self._project(self.m, back=True)
    for i, a in enumerate(self.gg):
      if a is not None:
        other = [j for j in range(g.ndim) if j != i]
        self.gg[i] = SB * a + (1 - SB) * np.tensordot(g, g, axes=(other, other))
    if self.q is None:
      self.q = [None if a is None else np.linalg.eigh(a)[1][:, ::-1] for a in self.gg]
    if self.t > 0 and self.t % FREQ == 0:
      new = []
      for i, (a, q) in enumerate(zip(self.gg, self.q)):
        if a is None:
          new.append(None)
          continue
        order = np.argsort(-np.diag(q.T @ a @ q), kind="stable")
        self.v = np.take(self.v, order, axis=i)
        new.append(np.linalg.qr(a @ q[:, order])[0])
      self.q = new
    if self.t > 0:
      self.m = self._project(self.m)

  def step(self, g):
    if self.q is None:
      self._update_preconditioner(g)
      return np.zeros_like(g)
    gp = self._project(g)
    self.t += 1
    self.m = B1 * self.m + (1 - B1) * gp
    self.v = B2 * self.v + (1 - B2) * gp ** 2
    size = np.sqrt(1 - B2 ** self.t) / (1 - B1 ** self.t)
    out = size * self._project(self.m / (np.sqrt(self.v) + EPS), back=True)
    self._update_preconditioner(g)
    return out


def _grads(shapes, step):
  """Gradients with a fixed per-tensor row/column scaling (distinct factor eigenvalues)."""
  out = {}
  for n, (k, s) in enumerate(sorted(shapes.items())):
    z = np.random.default_rng(100 * step + n).normal(size=s)
    rows = np.linspace(0.5, 2.0, s[-2])[:, None] if len(s) > 1 else 1.0
    out[k] = z * rows
  return out


def _soap_updates(shapes, extra):
  tx, _ = optim.build({"name": "soap", "learning_rate": 1.0, "weight_decay": 0.0,
                       "clip_norm": 0.0, "b1": B1, "b2": B2, "eps": EPS,
                       "schedule": {"kind": "constant", "warmup_steps": 0},
                       "extra": {"shampoo_beta": SB, "precondition_frequency": FREQ, **extra}})
  params = {k: jnp.zeros(s, jnp.float32) for k, s in shapes.items()}
  state = tx.init(params)
  upd = jax.jit(tx.update)
  out = []
  for t in range(STEPS):
    g = {k: jnp.asarray(v, jnp.float32) for k, v in _grads(shapes, t).items()}
    u, state = upd(g, state, params)
    out.append({k: -np.asarray(v, np.float64) for k, v in u.items()})
  return out


def _blocks(shape, bs):
  """Row and column slices of Shampoo's equal blocks of at most bs (the last one short)."""
  cut = lambda d: [slice(i, min(i + -(-d // -(-d // bs)), d))
                   for i in range(0, d, -(-d // -(-d // bs)))]
  return [(r, c) for r in cut(shape[-2]) for c in cut(shape[-1])]


def _reference(shapes, max_dim, block_size=None):
  refs = {}
  for k, s in shapes.items():
    mats = [()] if len(s) < 3 else [(i,) for i in range(s[0])]
    parts = _blocks(s, block_size) if block_size and len(s) > 1 else [(Ellipsis,)]
    full = s[-2:] if len(s) > 1 else s
    sides = [len(s) > 1 and d <= max_dim for d in full]
    refs[k] = [(m, p, RefSOAP(np.zeros(full)[p].shape, sides)) for m in mats for p in parts]
  out = []
  for t in range(STEPS):
    g, u = _grads(shapes, t), {}
    for k, s in shapes.items():
      u[k] = np.zeros(s)
      for m, p, r in refs[k]:
        idx = m + tuple(p) if p != (Ellipsis,) else m
        u[k][idx] = r.step(g[k][idx])
    out.append(u)
  return out


SHAPES = {"w": (6, 5), "one_sided": (4, 7), "stack": (2, 4, 5), "b": (5,)}


@pytest.mark.parametrize("extra, max_dim, block_size", [
    ({"max_precond_dim": 6}, 6, None),
    ({"max_precond_dim": 6, "block_size": 3}, 6, 3),
])
def test_soap_matches_float64_transcription(extra, max_dim, block_size):
  got = _soap_updates(SHAPES, extra)
  ref = _reference(SHAPES, max_dim, block_size)
  for t in range(STEPS):
    for k in SHAPES:
      scale = np.abs(ref[t][k]).max() + 1e-12
      np.testing.assert_allclose(got[t][k], ref[t][k], rtol=2e-4, atol=2e-5 * scale,
                                 err_msg=f"step {t} tensor {k}")
  assert all(np.abs(got[0][k]).max() == 0 for k in SHAPES)  # the first call builds the basis
  # the rotation matters: on these gradients SOAP is far from Adam (no factors)
  adam = _reference({"w": SHAPES["w"]}, max_dim=0)
  assert np.abs(got[STEPS - 1]["w"] - adam[STEPS - 1]["w"]).max() > 0.1


def test_soap_bad_option_names_it():
  with pytest.raises(ValueError, match="precondition_frequency=0"):
    optim.build({"name": "soap", "extra": {"precondition_frequency": 0}})
  with pytest.raises(ValueError, match=r"optimizer.extra.max_dim"):
    optim.build({"name": "soap", "extra": {"max_dim": 3}})
  with pytest.raises(ValueError, match="std_warmup_steps=-1 must be an integer >= 0"):
    optim.build({"name": "soap_bc", "extra": {"std_warmup_steps": -1}})
  with pytest.raises(ValueError, match="std_warmup_steps=2 applies to the leave-one-out forms"):
    optim.build({"name": "soap", "extra": {"std_warmup_steps": 2}})


# ---------------------------------------------------------------------------------------
# SOAP-BC

def _linear_loss(p, mb):  # the gradient of microbatch j is its data
  return jnp.sum(p["w"] * mb), {}


def _bc_state(tx, params, count, ql, qr, mu, nu):
  """tx's state with the basis, momentum and second moment set (the SOAP state is the first
  element of the chain)."""
  st = tx.init(params)
  s0 = st[0]
  f = s0.factors["0"]
  fac = {"0": f._replace(QL=jnp.broadcast_to(ql, f.QL.shape), QR=jnp.broadcast_to(qr, f.QR.shape))}
  s0 = s0._replace(count=jnp.asarray(count, jnp.int32), factors=fac, mu={"w": mu}, nu={"w": nu})
  return (s0, *st[1:])


def _orth(n, seed):
  return np.linalg.qr(np.random.default_rng(seed).normal(size=(n, n)))[0]


@pytest.mark.parametrize("mode, crossfit", [("full", "loo"), ("cf", "loo"), ("cf", "ab")])
def test_soap_bc_is_adamw_bc_in_the_rotated_basis(mode, crossfit):
  """With the state's basis Q, soap_bc's update is Q_L u' Q_R^T, u' the update of adamw_bc
  (same mode and cross-fit) run on the rotated microbatch gradients Q_L^T G_j Q_R with the
  rotated momentum (eps: SOAP's eps / sqrt(1 - b2^t)); per coordinate."""
  d1, d2, m, c, b1, b2, eps = 4, 3, 6, 3, 0.9, 0.8, 1e-3
  rng = np.random.default_rng(0)
  ql, qr = _orth(d1, 1), _orth(d2, 2)
  mu, nu = rng.normal(size=(d1, d2)), rng.uniform(0.5, 1.5, size=(d1, d2))
  g = rng.normal(size=(m, d1, d2)) + rng.normal(size=(d1, d2))
  tx = optim.soap_bc(1.0, b1, b2, eps, 0.0, precondition_frequency=100, mode=mode,
                     crossfit=crossfit)
  params = {"w": jnp.zeros((d1, d2))}
  st = _bc_state(tx, params, c, ql, qr, jnp.asarray(mu, jnp.float32),
                 jnp.asarray(nu, jnp.float32))
  @functools.partial(jax.jit, static_argnums=0)  # one compile, not one per operation
  def update(tx, st, params, g):
    stats = optim.collect(_linear_loss, params, g, st)
    return tx.update(stats.numerator, st, params, bc_stats=stats)[0]["w"]

  u = -np.asarray(update(tx, st, params, jnp.asarray(g, jnp.float32)))

  rot = lambda x: ql.T @ x @ qr
  ref_tx = optim.scale_by_adam_bc(b1, b2, eps / np.sqrt(1 - b2 ** c), mode=mode,
                                  crossfit=crossfit)
  p = {"w": jnp.zeros((d1, d2))}
  rs = ref_tx.init(p)._replace(count=jnp.asarray(c - 1, jnp.int32),
                               mu={"w": jnp.asarray(rot(mu), jnp.float32)},
                               nu={"w": jnp.asarray(nu, jnp.float32)})
  g_rot = jnp.asarray(np.stack([rot(x) for x in g]), jnp.float32)
  u_rot = np.asarray(update(ref_tx, rs, p, g_rot))
  np.testing.assert_allclose(u, ql @ u_rot @ qr.T, rtol=1e-4, atol=1e-5 * np.abs(u).max())


def test_soap_bc_loo_bias_per_rotated_coordinate():
  """Monte Carlo over 40,000 draws of m = 8 microbatch gradients G_j = Mu + N(0, 1) with a
  fixed rotated basis (b1 = 0: the numerator is the fold's own microbatch), per rotated
  coordinate k with signals Mu'_k / sqrt(1/(m-1)) in {0, 1, 4}:

  * cf: no coupling, E[u_k] = E[G'_rk] E[1/d_k], with E[1/d_k] from independent draws of
    G'_{-r,k} ~ N(Mu'_k, 1/(m-1)) (to 3%);
  * full: closer than cf to T(E x_k) E[G'_rk], T(x) = 1/(sqrt((b2 nu + (1 - b2) x)/bc2) +
    eps'), on every coordinate (cf over-estimates it: Jensen)."""
  n, m, c, b2, eps = 40_000, 8, 5, 0.5, 1e-8
  d1 = d2 = 2
  ql, qr = _orth(d1, 3), _orth(d2, 4)
  sd = np.sqrt(1.0 / (m - 1))
  mu_rot = np.array([[0.0, 1.0], [4.0, 0.0]]) * sd
  mu = ql @ mu_rot @ qr.T
  nu = 0.25 / (m - 1)
  g = mu + np.random.default_rng(5).normal(size=(m, n, d1, d2))
  params = {"w": jnp.zeros((n, d1, d2))}
  out = {}
  for mode in ("cf", "full"):
    tx = optim.soap_bc(1.0, 0.0, b2, eps, 0.0, mode=mode, precondition_frequency=100)
    st = _bc_state(tx, params, c, ql, qr, jnp.zeros((n, d1, d2)), jnp.full((n, d1, d2), nu))
    def step(p, g, s, tx=tx):
      stats = optim.collect(_linear_loss, p, g, s)
      return tx.update(stats.numerator, s, p, bc_stats=stats)

    step = jax.jit(step)
    u = -np.asarray(step(params, jnp.asarray(g, jnp.float32), st)[0]["w"], np.float64)
    out[mode] = np.einsum("ij,njk,kl->nil", ql.T, u, qr).mean(0)  # rotated, mean over draws
  bc2 = 1 - b2 ** c
  eps_hat = eps / np.sqrt(bc2)
  y = mu_rot + sd * np.random.default_rng(6).normal(size=(400_000, d1, d2))
  inv = lambda x: 1.0 / (np.sqrt((b2 * nu + (1 - b2) * x) / bc2) + eps_hat)
  mean_inv = inv(y * y).mean(0)
  num = mu_rot  # E[m_hat_r] with b1 = 0
  sig = mu_rot != 0
  np.testing.assert_allclose(out["cf"][sig], (num * mean_inv)[sig], rtol=0.03)
  target = num * inv(mu_rot ** 2 + sd ** 2)
  bias_cf, bias_full = out["cf"][sig] / target[sig] - 1, out["full"][sig] / target[sig] - 1
  assert np.all(bias_cf > 0), bias_cf
  assert np.all(np.abs(bias_full) < bias_cf), (bias_cf, bias_full)
  assert np.all(np.abs(out["cf"][~sig]) < 0.05 * np.abs(out["cf"][sig]).max())


def _geqrf_batches(lowered_text):
  """(batch, rows) of every cuSOLVER QR call in a module lowered for CUDA."""
  calls = re.findall(r"custom_call @cusolver_geqrf_ffi\(.*?\) .*?: \(tensor<(\d+)x(\d+)x\d+xf32>",
                     lowered_text)
  return [(int(b), int(r)) for b, r in calls]


def test_soap_power_step_keeps_gpu_qr_off_the_small_matrix_kernel(monkeypatch):
  """jaxlib's GPU QR runs a call of B > 1 matrices of size s on cuBLAS's batched kernel for
  small matrices whenever s // B <= 128 (slow for SOAP's bases: docs/optim_soap.md, "On GPUs");
  every QR call of the refresh, lowered for CUDA on the GPU code path, must hold one
  matrix or few enough that s // B > 128."""
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the accelerators' batched path
  tx, _ = optim.build({"name": "soap", "learning_rate": 1.0, "schedule": {"kind": "constant"},
                       "extra": {"precondition_frequency": 2}})
  # 384: the largest allowed group (2) is one below what s // 128 would give (3)
  params = {"w": jnp.zeros((6, 260, 300), jnp.float32), "v": jnp.zeros((3, 384, 384))}
  state = jax.eval_shape(tx.init, params)
  text = jax.jit(tx.update).trace(params, state, params).lower(
      lowering_platforms=("cuda",)).as_text()
  calls = _geqrf_batches(text)
  assert {r for _, r in calls} == {260, 300, 384}, calls  # the power step's QRs were found
  assert all(b == 1 or r // b > 128 for b, r in calls), calls


def test_soap_qr_in_groups_equals_one_call_per_coordinate():
  x = jax.random.normal(jax.random.PRNGKey(0), (5, 300, 300))
  np.testing.assert_array_equal(np.asarray(qr_basis(x)), np.asarray(jnp.linalg.qr(x)[0]))


def test_soap_refresh_is_a_device_branch():
  """SOAP's basis refresh is no host-picked program (``phases``): those failed on a GPU
  (docs/optim_soap.md, "On GPUs"); the trainer then runs SOAP as one program."""
  tx, _ = optim.build({"name": "soap", "learning_rate": 1.0})
  params = {"w": jnp.zeros((6, 5), jnp.float32)}
  state = tx.init(params)
  with phases.record() as schedules:
    jax.eval_shape(tx.update, params, state, params)
  assert schedules == set()


def _dots_in_scans(jaxpr) -> list[int]:
  """[dot_generals outside any scan, then per scan (in order) the ones its body runs]."""
  out, count = [], 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == "dot_general"
    for v in eqn.params.values():
      sub = getattr(v, "jaxpr", v)
      if not hasattr(sub, "eqns"):
        continue
      inner = _dots_in_scans(sub)
      count += 0 if eqn.primitive.name == "scan" else inner[0]
      out += ([inner[0]] if eqn.primitive.name == "scan" else []) + inner[1:]
  return [count] + out


def test_soap_bc_folds_rotate_only_their_own_gradient():
  """The leave-one-out loop over m folds rotates each fold's G_r (Q_L^T G_r Q_R: two products)
  and nothing else: G_full and the momentum are rotated once, outside it (at the study's step,
  64 folds of a full gpt2-small gradient; each extra rotation in the loop costs ~40 TFLOP)."""
  tx = optim.soap_bc(1.0, precondition_frequency=100)
  params = {"w": jnp.zeros((4, 3))}
  st = _bc_state(tx, params, 3, _orth(4, 1), _orth(3, 2), jnp.ones((4, 3)), jnp.ones((4, 3)))
  g = jnp.ones((6, 4, 3))
  jaxpr = jax.make_jaxpr(lambda p, g, s: optim.collect(_linear_loss, p, g, s))(params, g, st)
  assert _dots_in_scans(jaxpr.jaxpr)[1:] == [0, 2]  # the gradients' scan, the folds' scan


@pytest.mark.integration  # SOAP and SOAP-BC compiled side by side
def test_soap_bc_std_warmup_takes_soaps_update_on_the_first_k_calls():
  """std_warmup_steps=K: calls 0..K give SOAP's own updates (call 0 only builds the basis),
  call K+1 the LOO form's; per coordinate, on one stream of microbatch gradients (the state
  does not depend on which update was taken)."""
  k, m = 2, 4
  g = np.random.default_rng(3).normal(size=(k + 2, m, 5, 4)) + 0.5
  params = {"w": jnp.zeros((5, 4))}

  def updates(tx):
    st, out = tx.init(params), []
    for gs in g:
      stats = optim.collect(_linear_loss, params, jnp.asarray(gs, jnp.float32), st)
      u, st = tx.update(stats.numerator, st, params, bc_stats=stats)
      out.append(np.asarray(u["w"]))
    return out

  kw = dict(precondition_frequency=2, weight_decay=0.0)
  warm = updates(optim.soap_bc(1.0, std_warmup_steps=k, **kw))
  soap, bc = updates(optim.soap(1.0, **kw)), updates(optim.soap_bc(1.0, **kw))
  for c in range(k + 1):
    np.testing.assert_allclose(warm[c], soap[c], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(warm[k + 1], bc[k + 1], rtol=1e-6, atol=1e-7)
  assert np.abs(warm[k + 1] - soap[k + 1]).max() > 1e-3 * np.abs(soap[k + 1]).max()


@pytest.mark.parametrize("k", [3, pytest.param(8, marks=pytest.mark.integration)])
def test_soap_bc_fold_blocks_equal_one_fold_at_a_time(k):
  """loo_fold_chunk with SOAP-BC (k folds per step of the folds' scan, their rotations
  included; a 1-D leaf without a basis): the same updates per coordinate, up to float32 rounding."""
  g = np.random.default_rng(5).normal(size=(3, 4, 5, 4)) + 0.5
  params = {"w": jnp.zeros((5, 4)), "b": jnp.zeros((4,))}

  def updates(**opts):
    tx = optax.chain(optim.collector_options(**opts),
                     optim.soap_bc(1.0, precondition_frequency=2, weight_decay=0.0))
    loss = lambda p, mb: (jnp.sum(p["w"] * mb) + jnp.sum(p["b"] * mb[0]), {})

    @jax.jit
    def step(st, gs):
      stats = optim.collect(loss, params, gs, st)
      return tx.update(stats.numerator, st, params, bc_stats=stats)

    st, out = tx.init(params), []
    for gs in g:
      u, st = step(st, jnp.asarray(gs, jnp.float32))
      out.append(jax.tree.map(np.asarray, u))
    return out

  one = updates(loo_fold_chunk=1)
  # 3 does not divide m = 4; 8, the default on GPUs: all m = 4 in one scan step
  for a, b in zip(updates(loo_fold_chunk=k), one):
    for name in ("w", "b"):
      np.testing.assert_allclose(a[name], b[name], rtol=1e-5,
                                 atol=1e-6 * np.abs(b[name]).max())
