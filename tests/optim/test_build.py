"""build(config) and schedules: chains, specs, validation messages, weight-decay masks."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import scaleopt.optim as so
from scaleopt.optim import (OptimizerConfig, ScheduleConfig, build, collect, make_schedule,
                            names, register_optimizer)

T = 50


def _np_schedule(kind, t, lr, warm, total, floor_ratio, decay_fraction=0.2):
  if warm > 0 and t < warm:
    return lr * t / warm
  floor = lr * floor_ratio
  if kind == "constant":
    return lr
  if kind == "cosine":
    s = min(max((t - warm) / (total - warm), 0.0), 1.0)
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * s))
  dlen = round(decay_fraction * total)
  s = min(max((t - (total - dlen)) / dlen, 0.0), 1.0)
  return floor + (lr - floor) * (1 - s)


@pytest.mark.parametrize("kind,warm,floor", [("cosine", 5, 0.1), ("cosine", 0, 0.0),
                                             ("wsd", 4, 0.0), ("wsd", 0, 0.2),
                                             ("constant", 3, 0.0)])
def test_schedules_match_formulas(kind, warm, floor):
  cfg = {"kind": kind, "warmup_steps": warm, "total_steps": T, "min_lr_ratio": floor,
         "decay_fraction": 0.3}
  sched = jax.jit(make_schedule(cfg, 3e-4))
  got = np.array([float(sched(t)) for t in range(T + 5)])
  ref = np.array([_np_schedule(kind, t, 3e-4, warm, T, floor, 0.3) for t in range(T + 5)])
  np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-12)
  if kind == "cosine" and warm:
    ref_optax = optax.warmup_cosine_decay_schedule(0.0, 3e-4, warm, T, 3e-4 * floor)
    np.testing.assert_allclose(got[:T], [float(ref_optax(t)) for t in range(T)], rtol=1e-5)


def test_adamw_equals_optax_chain():
  """build('adamw') = clip_by_global_norm -> optax.adamw(schedule, mask) step for step."""
  rng = np.random.default_rng(0)
  params = {"w": jnp.asarray(rng.normal(size=(5, 3)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=3), jnp.float32)}
  mask = {"w": True, "b": False}
  cfg = {"name": "adamw", "learning_rate": 1e-2, "clip_norm": 0.5, "weight_decay": 0.1,
         "b1": 0.8, "b2": 0.9, "eps": 1e-6,
         "schedule": {"kind": "cosine", "warmup_steps": 3, "total_steps": 20, "min_lr_ratio": 0.1}}
  tx, spec = build(cfg, wd_mask=mask)
  assert spec.layout == "all" and spec.estimator is None
  ref = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(
      optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 20, 1e-3), 0.8, 0.9, 1e-6,
      weight_decay=0.1, mask=mask))
  p, s, pr, sr = params, tx.init(params), params, ref.init(params)
  for _ in range(12):
    g = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
    u, s = tx.update(g, s, p, bc_stats=None)
    p = optax.apply_updates(p, u)
    u, sr = ref.update(g, sr, pr)
    pr = optax.apply_updates(pr, u)
  for k in params:
    np.testing.assert_allclose(np.asarray(p[k]), np.asarray(pr[k]), rtol=1e-6, atol=1e-7)


def _tiny_lm():
  V, D, H = 13, 8, 12
  ks = jax.random.split(jax.random.PRNGKey(0), 4)
  params = {"emb": 0.3 * jax.random.normal(ks[0], (V, D)),
            "w1": 0.3 * jax.random.normal(ks[1], (D, H)), "b": jnp.zeros((H,)),
            "w2": 0.3 * jax.random.normal(ks[2], (H, V))}

  def logits_fn(p, mb):
    return jnp.tanh(p["emb"][mb["x"]] @ p["w1"] + p["b"]) @ p["w2"], mb["mask"]

  def loss_fn(p, mb):
    z, mask = logits_fn(p, mb)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(z), mb["y"][..., None], -1)[..., 0]
    return (nll * mask).sum() / mask.sum(), {}

  M, B, L = 4, 2, 6
  mbs = {"x": jax.random.randint(ks[3], (M, B, L), 0, V),
         "y": jax.random.randint(ks[0], (M, B, L), 0, V), "mask": jnp.ones((M, B, L))}
  return params, loss_fn, logits_fn, mbs


EXPECTED_SPEC = {"adamw": ("all", None), "adamw_bc": ("loo", None), "sophia": ("all", "gnb"),
                 "sophia_bc": ("ab", "gnb"), "shampoo": ("all", None),
                 "shampoo_bc": ("ab", "shampoo"), "muon": ("all", None)}


@pytest.mark.parametrize("name", ["adamw", "adamw_bc", "sophia", "sophia_bc", "shampoo",
                                  pytest.param("shampoo_bc", marks=pytest.mark.integration),
                                  "muon"])
def test_every_optimizer_trains_a_tiny_lm(name):
  params, loss_fn, logits_fn, mbs = _tiny_lm()
  extra = {"block_size": 8, "root_every": 2} if name.startswith("shampoo") else {}
  if name.startswith("sophia"):
    extra = {"k": 2}
  cfg = OptimizerConfig(name=name, learning_rate=3e-2, extra=extra,
                        schedule={"kind": "constant", "warmup_steps": 0})
  tx, spec = build(cfg)
  assert (spec.layout, spec.estimator) == EXPECTED_SPEC[name]
  st = tx.init(params)

  @jax.jit
  def step(p, st, key):
    stats = collect(loss_fn, p, mbs, st, key=key, logits_fn=logits_fn)
    u, st = tx.update(stats.numerator, st, p, bc_stats=stats)
    return optax.apply_updates(p, u), st, stats.loss

  losses = []
  for t in range(8):
    params, st, loss = step(params, st, jax.random.PRNGKey(t))
    losses.append(float(loss))
  assert np.all(np.isfinite(losses))
  assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("name", ["adamw", "shampoo", "muon"])
def test_weight_decay_mask(name):
  """Zero gradients: masked-out tensors stay, decayed ones shrink by (1 - lr wd) per step."""
  params = {"w": jnp.ones((4, 4)), "scale": jnp.ones((4,))}
  mask = lambda p: {"w": True, "scale": False}
  tx, _ = build({"name": name, "learning_rate": 0.1, "weight_decay": 0.5, "clip_norm": 0.0,
                 "schedule": {"kind": "constant"}}, wd_mask=mask)
  st = tx.init(params)
  zeros = jax.tree.map(jnp.zeros_like, params)
  u, st = tx.update(zeros, st, params)
  p = optax.apply_updates(params, u)
  np.testing.assert_allclose(np.asarray(p["scale"]), 1.0, atol=1e-6)
  np.testing.assert_allclose(np.asarray(p["w"]), 1.0 - 0.1 * 0.5, rtol=1e-5)


@pytest.mark.parametrize("cfg,match", [
    ({"name": "adam"}, r"optimizer.name='adam'.*adamw.*muon"),
    ({"name": "adamw", "lr": 1e-3}, r"optimizer.lr is not a known key; allowed keys:.*learning_rate"),
    ({"name": "adamw", "b1": 1.5}, r"optimizer.b1=1.5 must be a number in \[0.0, 1.0\)"),
    ({"name": "adamw", "learning_rate": -1.0}, r"optimizer.learning_rate=-1.0"),
    ({"name": "sophia", "extra": {"rhoo": 1}}, r"optimizer.extra.rhoo.*allowed keys:.*'rho'"),
    ({"name": "adamw", "extra": {"mode": "full"}}, r"optimizer.extra.mode.*mu_dtype"),
    ({"name": "sophia", "extra": {"estimator": "exact"}}, r"estimator='exact'.*'gnb'"),
    ({"name": "shampoo", "extra": {"root_method": "svd"}}, r"root_method='svd'.*'eigh'"),
    ({"name": "adamw_bc", "extra": {"crossfit": "kfold"}}, r"crossfit='kfold'.*'loo'"),
    ({"name": "adamw", "schedule": {"kind": "linear"}}, r"schedule.kind='linear'.*'cosine'"),
    ({"name": "adamw", "schedule": {"warmup": 3}}, r"schedule.warmup is not a known key"),
    ({"name": "adamw", "schedule": {"warmup_steps": 30, "total_steps": 10}}, r"warmup_steps"),
])
def test_validation_errors_name_key_and_allowed_values(cfg, match):
  with pytest.raises(ValueError, match=match):
    build(cfg)


def test_config_dataclass_is_frozen_and_equivalent_to_dict():
  d = {"name": "sophia_bc", "learning_rate": 1e-3, "extra": {"k": 5, "rho": 0.1},
       "schedule": {"kind": "wsd", "total_steps": 100, "warmup_steps": 10}}
  cfg = OptimizerConfig.from_dict(d)
  assert isinstance(cfg.schedule, ScheduleConfig)
  with pytest.raises(Exception):
    cfg.name = "adamw"
  _, spec_d = build(d)
  _, spec_c = build(cfg)
  assert spec_d == spec_c and spec_d.refresh_every == 5


def test_muon_matches_optax_contrib_muon():
  """Without weight decay, build('muon') follows optax.contrib.muon (matrix -> Muon, vector ->
  Adam) step for step."""
  rng = np.random.default_rng(3)
  params = {"w": jnp.asarray(rng.normal(size=(6, 4)), jnp.float32),
            "b": jnp.asarray(rng.normal(size=4), jnp.float32)}
  tx, _ = build({"name": "muon", "learning_rate": 1e-2, "weight_decay": 0.0, "clip_norm": 0.0,
                 "b1": 0.95, "extra": {"adam_b1": 0.9, "adam_b2": 0.99},
                 "schedule": {"kind": "constant"}})
  ref = optax.contrib.muon(1e-2, beta=0.95, adam_b1=0.9, adam_b2=0.99)
  p, s, pr, sr = params, tx.init(params), params, ref.init(params)
  for _ in range(5):
    g = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
    u, s = tx.update(g, s, p)
    p = optax.apply_updates(p, u)
    u, sr = ref.update(g, sr, pr)
    pr = optax.apply_updates(pr, u)
  for k in params:
    np.testing.assert_allclose(np.asarray(p[k]), np.asarray(pr[k]), rtol=1e-5, atol=1e-6)


def test_registry_adds_a_user_optimizer_by_name():
  """A user registers a name from their own code; build and config validation use it."""
  @dataclasses.dataclass(frozen=True)
  class LionTest:
    b: float = 0.9

  @register_optimizer("lion_test", config=LionTest, recommended=so.Recommended(1e-2))
  def _lion(cfg, lr, *, wd_mask, sparse_filter):
    del sparse_filter
    return optax.lion(lr, b1=cfg.hyperparameters().b, weight_decay=cfg.weight_decay,
                      mask=wd_mask)

  try:
    assert "lion_test" in names()
    tx, spec = build({"name": "lion_test", "learning_rate": 1e-2, "clip_norm": 0.0,
                      "weight_decay": 0.0, "extra": {"b": 0.8},
                      "schedule": {"kind": "constant"}})
    ref = optax.lion(1e-2, b1=0.8, weight_decay=0.0)
    params = {"w": jnp.arange(6.0).reshape(2, 3)}
    g = {"w": jnp.linspace(-1, 1, 6).reshape(2, 3)}
    u, _ = tx.update(g, tx.init(params), params)
    ur, _ = ref.update(g, ref.init(params), params)
    np.testing.assert_allclose(np.asarray(u["w"]), np.asarray(ur["w"]), rtol=1e-6)
    assert spec.layout == "all"
    with pytest.raises(ValueError, match=r"optimizer.extra.c is not a known key.*'b'"):
      build({"name": "lion_test", "extra": {"c": 1}})
  finally:
    so.unregister_optimizer("lion_test")  # later tests see the shipped names only
  assert "lion_test" not in names()


@pytest.mark.parametrize("fn,kw", [(so.scale_by_sophia, {"rhoo": 0.5}),
                                   (so.scale_by_shampoo, {"root_evry": 3}),
                                   (so.sophia, {"kk": 3}), (so.shampoo_bc, {"grafting": "adam"}),
                                   (so.adamw_bc, {"crosfit": "ab"})])
def test_unknown_keyword_raises_type_error(fn, kw):
  args = () if fn.__name__.startswith("scale_by") else (1e-3,)
  with pytest.raises(TypeError, match=list(kw)[0]):
    fn(*args, **kw)


def test_aliases_are_callable_from_the_package():
  for name in ("adamw_bc", "sophia", "sophia_bc", "shampoo", "shampoo_bc"):
    tx = getattr(so, name)(1e-3)
    assert isinstance(tx, optax.GradientTransformation), name


# ----------------------------------------------------------------------------- all_dense


def _emb_params():
  return {"emb": jnp.ones((5, 4)), "w": jnp.ones((4, 3))}


def test_all_dense_drops_the_embedding_branch():
  """``all_dense: true`` (the paper's --all_dense): every tensor takes the bias-corrected
  update, as if no sparse filter were given."""
  sparse = lambda p: {"emb": True, "w": False}
  cfg = {"name": "adamw_bc", "extra": {"mode": "full", "crossfit": "loo"}}
  struct = lambda tx: jax.tree.structure(tx.init(_emb_params()))
  hybrid, _ = build(cfg, sparse_filter=sparse)
  dense, _ = build(dict(cfg, all_dense=True), sparse_filter=sparse)
  plain, _ = build(cfg)
  assert struct(dense) == struct(plain) != struct(hybrid)


def test_sparse_lr_ratio_without_an_embedding_branch_is_an_error():
  cfg = {"name": "adamw_bc", "extra": {"sparse_lr_ratio": 0.5}}
  with pytest.raises(ValueError, match=r"optimizer.extra.sparse_lr_ratio=0.5 .*all_dense=true"):
    OptimizerConfig.from_dict(dict(cfg, all_dense=True))
  with pytest.raises(ValueError, match=r"optimizer.extra.sparse_lr_ratio=0.5 needs an "
                     "embedding branch"):
    build(cfg)
  build(cfg, sparse_filter=lambda p: {"emb": True, "w": False})  # with a filter: fine
  with pytest.raises(ValueError, match=r"optimizer.all_dense='yes' must be true or false"):
    OptimizerConfig.from_dict({"name": "adamw", "all_dense": "yes"})


def test_resolved_numerics_name_the_root_method_a_run_executes():
  """summary.json's optimizer_numerics: ``auto`` is eigh on CPU, Newton at "high" on GPU for
  std Shampoo, eigh for Shampoo-BC's full mode everywhere; {} for other optimizers."""
  from scaleopt.optim import resolved_numerics
  assert resolved_numerics({"name": "shampoo"}, backend="cpu")["root_method"] == "eigh"
  gpu = resolved_numerics({"name": "shampoo"}, backend="gpu")
  assert gpu["root_method"] == "newton" and gpu["newton_precision"] == "high"
  assert gpu["matmul_precision"] == "high"
  assert resolved_numerics({"name": "shampoo_bc"}, backend="gpu")["root_method"] == "eigh"
  assert resolved_numerics({"name": "shampoo", "extra": {"root_method": "eigh"}},
                           backend="gpu")["root_method"] == "eigh"
  assert resolved_numerics({"name": "adamw"}) == {}


SHIPPED = ("adamw", "adamw_bc", "sophia", "sophia_bc", "shampoo", "shampoo_bc", "muon", "lion",
           "adafactor", "schedule_free_adamw", "soap", "soap_bc")


@pytest.mark.parametrize("name", SHIPPED)
def test_typed_defaults_are_the_optimizers_own(name):
  """Every key of an optimizer's typed config, written out at its default, builds the same
  optimizer as leaving ``extra`` empty: the same collector spec and, one step from the same
  state, the same update (so no typed default differs from the one the alias applies)."""
  hp = dataclasses.asdict(so.config_class(name)())
  base = {"name": name, "learning_rate": 1e-2, "schedule": {"kind": "constant"}}
  tx0, spec0 = build(base)
  tx1, spec1 = build(dict(base, extra=hp))
  assert spec0 == spec1
  if spec0.layout != "all" or spec0.estimator is not None:
    return  # the spec carries what a bias-corrected or estimator name collects
  params = {"w": jnp.arange(12.0).reshape(3, 4) / 7, "b": jnp.ones((4,))}
  g = jax.tree.map(lambda x: jnp.cos(x * 3.0), params)
  u0, _ = tx0.update(g, tx0.init(params), params)
  u1, _ = tx1.update(g, tx1.init(params), params)
  for k in params:
    np.testing.assert_array_equal(np.asarray(u0[k]), np.asarray(u1[k]))


def test_typed_config_fills_defaults_and_names_unknown_keys():
  cfg = OptimizerConfig(name="muon", extra={"ns_steps": 3})
  hp = cfg.hyperparameters()
  assert (hp.ns_steps, hp.adam_lr_ratio) == (3, 1.0)
  assert OptimizerConfig(name="shampoo_bc").hyperparameters().mode == "full"
  with pytest.raises(ValueError, match=r"optimizer.extra.ns_step is not a known key.*ns_steps"):
    OptimizerConfig(name="muon", extra={"ns_step": 3})
