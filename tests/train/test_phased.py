"""Host-picked step programs (``run.host_phases``): the trainer's run equals the one-program
run; the host's count follows skips; programs that cannot sit side by side in the device pool
fall back to one program."""

import json

import jax
import numpy as np
import pytest

from scaleopt.optim import phases
from scaleopt.train import checkpoint, config as C, faults, loop, phased
from scaleopt.train import metrics

from train_helpers import tiny_raw

# roots on even steps (count % 2), telemetry on odd ones ((step + 1) % 2): two programs
RAW = tiny_raw(run={"steps": 6, "checkpoint_every": 0, "eval_every": 0, "eval_tokens": 0,
                    "tensorboard": False, "telemetry_every": 2, "log_every": 1},
               optimizer={"name": "shampoo", "extra": {"root_every": 2, "block_size": 16}})


def _train(tmp_path, host_phases):
  raw = json.loads(json.dumps(RAW))
  raw["run"]["host_phases"] = host_phases
  out = tmp_path / host_phases
  summary = loop.train(C.from_dict(raw), out)
  rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
  return out, summary, rows


@pytest.mark.integration
def test_host_programs_train_as_the_one_program(tmp_path):
  out_on, s_on, rows_on = _train(tmp_path, "on")
  out_off, s_off, rows_off = _train(tmp_path, "off")
  assert s_on["phase_shifts"] == 0 and s_off["phase_shifts"] is None
  assert len(rows_on) == len(rows_off) == RAW["run"]["steps"]
  for a, b in zip(rows_off, rows_on):  # every metric, telemetry groups included
    keys = {k for k in a if k not in metrics.TIMING}
    assert keys == {k for k in b if k not in metrics.TIMING}
    for k in keys:
      if a[k] is None:  # NaN (written as null)
        assert b[k] is None, (a["step"], k)
        continue
      np.testing.assert_allclose(b[k], a[k], rtol=1e-6, err_msg=f"step {a['step']} {k}")
  tele = [r["step"] for r in rows_on if any(k.startswith("grad_norm/") for k in r)]
  assert tele == [2, 4, 6]
  fns = loop.compile_fns(loop.setup(C.from_dict(RAW)))
  target = checkpoint.abstract(fns.state_shape, fns.state_sh)
  steps = RAW["run"]["steps"]
  on = checkpoint.Checkpointer(out_on / "checkpoints", 1, False).restore(steps, target)[0]
  off = checkpoint.Checkpointer(out_off / "checkpoints", 1, False).restore(steps, target)[0]
  # per coordinate, to 1e-4 of the leaf's scale: the two programs fuse the float32 statistics
  # differently (1e-6 apart) and the inverse roots amplify that (to 1e-5); a root step one
  # step off moves the roots by percents
  for a, b in zip(jax.tree.leaves(off), jax.tree.leaves(on)):  # parameters, optimizer state
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-4 * float(np.max(np.abs(a), initial=0)))


class _Fake:
  def __init__(self, every=4):
    self.schedules = (phases.Schedule("count", every), phases.Schedule("step", 5, 1))
    self.ran = []

  def key(self, counters):
    return tuple(s.due_at(counters[s.counter]) for s in self.schedules)

  def __call__(self, key, state, batch):
    self.ran.append(key)
    return state, None


def _drive(skips, n=14, every=4):
  """Dispatches ``n`` steps, confirming each step two steps later (the loop's lag);
  ``skips``: the steps the device skipped. Returns (root outcome per step, dispatcher)."""
  fake = _Fake(every)
  d = phased.Dispatcher(fake, 0, 0)
  for t in range(n):
    d(None, None)
    if t >= 2:
      d.confirm(t - 2 in skips)
  return [k[0] for k in fake.ran], [k[1] for k in fake.ran], d


def test_without_skips_the_host_outcomes_are_the_counts():
  root, tele, d = _drive(set())
  assert root == [t % 4 == 0 for t in range(14)]
  assert tele == [(t + 1) % 5 == 0 for t in range(14)]
  assert d.shifts == 0 and d.fresh is False


def test_a_skipped_root_step_is_redone_once_the_skip_is_known():
  # step 4 (count 4) does the roots and is skipped; the host learns it after dispatching
  # step 6, so step 7 redoes them; counts after step 4 are one lower: roots at count 8 = step 9
  root, tele, d = _drive({4})
  assert [t for t, r in enumerate(root) if r] == [0, 4, 7, 9, 13]
  assert tele == [(t + 1) % 5 == 0 for t in range(14)]  # the trainer's step is exact
  assert d.shifts == 2  # step 5 (count 4) did not do them, step 7 (count 6) did
  assert d.count == 14 - 1


def test_a_skip_before_a_root_step_adds_one_early():
  root, _, d = _drive({2})
  # step 2 is skipped, so step t > 2 has count t - 1; the host, not knowing it yet, does
  # the roots at step 4 (count 3) and, knowing it, at step 5 (count 4) again
  assert [t for t, r in enumerate(root) if r] == [0, 4, 5, 9, 13]
  assert d.shifts == 1


@pytest.mark.integration
def test_programs_that_do_not_fit_side_by_side_fall_back_to_one(monkeypatch, capsys):
  raw = json.loads(json.dumps(RAW))
  raw["run"]["host_phases"] = "on"
  raw["optimizer"] = {"name": "adamw"}  # telemetry's two programs
  s = loop.setup(C.from_dict(raw))
  fns = loop.compile_fns(s)
  state, batch = fns.init(), loop.abstract_batch(s, fns.batch_sh)
  assert isinstance(phased.make_stepper(fns, state, 0, s.cfg.run.steps, batch), phased.Dispatcher)  # CPU: no pool limit
  monkeypatch.setattr(faults, "pool_bytes", lambda: 2 ** 20)  # 1 MiB per device
  assert isinstance(phased.make_stepper(fns, state, 0, s.cfg.run.steps, batch), phased.OneProgram)
  assert "running one program with device branches" in capsys.readouterr().err


@pytest.mark.integration
def test_first_runs_and_evaluations_copy_no_batch(tmp_path, monkeypatch):
  """Each host-picked program's first run, and each evaluation, runs inside the batch feed's
  ``quiet()`` and waits for its result there; the other steps run beside the copies."""
  from scaleopt.train import evaluation, prefetch
  quiet, calls, evals = [False], [], []
  real_quiet, real_call = prefetch.Prefetch.quiet, phased.PhasedStep.__call__
  real_make = evaluation.make_evaluate

  def spy_quiet(self):
    cm = real_quiet(self)
    class _Spy:
      def __enter__(s):
        cm.__enter__()
        quiet[0] = True
      def __exit__(s, *a):
        quiet[0] = False
        return cm.__exit__(*a)
    return _Spy()

  def spy_call(self, key, state, batch):
    calls.append((key, quiet[0]))
    return real_call(self, key, state, batch)

  def spy_make(*a, **kw):
    fn = real_make(*a, **kw)
    return lambda params: (evals.append(quiet[0]), fn(params))[1]

  monkeypatch.setattr(prefetch.Prefetch, "quiet", spy_quiet)
  monkeypatch.setattr(phased.PhasedStep, "__call__", spy_call)
  monkeypatch.setattr(evaluation, "make_evaluate", spy_make)
  raw = json.loads(json.dumps(RAW))
  raw["run"].update(host_phases="on", eval_every=3, eval_tokens=256)
  loop.train(C.from_dict(raw), tmp_path / "run")
  keys = [k for k, _ in calls]
  assert len(calls) == RAW["run"]["steps"] and len(set(keys)) == 2
  assert [q for _, q in calls] == [k not in keys[:i] for i, k in enumerate(keys)]
  assert evals == [True, True]
