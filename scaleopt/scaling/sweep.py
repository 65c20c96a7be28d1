"""The sweep engine: every (s, seed, N, optimizer, hyper-parameter) point in one jitted computation.

Layout of the computation (one `jax.jit`, compiled once per sweep):

  vmap over problems (s, seed)           sample_problem -> quadratic statistics (N_max padded)
    vmap over N (masks)                   mask_features, eigh of the training covariance
      for each optimizer (trace time)     vmap over its hyper-parameter grid (lr, damping, ...)
        lax.scan over T steps             Optax update on W (d x N_max); loss at every step

N enters only through a 0/1 feature mask, so all N share one shape (padding). The
problems are fed to that one compiled function in chunks (`compute.chunk` problems per call) so
that memory stays bounded and a progress bar can advance; with `compute.devices > 1` each chunk
is sharded over devices along the problem axis. Float64 is switched on only inside
`jax.enable_x64(True)` contexts, never globally.

Outputs of `sweep_main`: alpha.csv, losses.csv, raw.npz (every loss at every step), plots.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import pathlib
import sys
import time
import warnings
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from scaleopt.scaling import blas
from scaleopt.scaling import config as config_lib
from scaleopt.scaling import fit as fit_lib
from scaleopt.scaling import optimizers as opt_lib
from scaleopt.scaling import problem as prob_lib


class SmallSampleWarning(UserWarning):
  """Fewer than 3 independent problem draws: the intervals are honest but very wide."""


class FitWindowWarning(UserWarning):
  """Dropping the smallest or largest fitted N moves alpha by more than its interval."""


@dataclasses.dataclass
class SweepResult:
  """Raw sweep output: losses[name] has shape (S, seeds, nN, H, T+1) (loss after t steps)."""
  cfg: dict
  s: np.ndarray
  n: np.ndarray
  losses: dict[str, np.ndarray]
  grids: dict[str, list[dict[str, float]]]
  floor: np.ndarray  # (S, seeds) Bayes floor
  timing: dict[str, float]


def _freeze(d: dict) -> tuple:
  return tuple(sorted(d.items()))


def train_curve(q: prob_lib.Quadratic, curv: opt_lib.Curvature, kind: str, fixed: tuple,
                hyper: dict[str, jax.Array], steps: int, shared: bool) -> jax.Array:
  """Test loss after t = 0..T steps of one optimizer from W_0 = 0 on one quadratic."""
  tx = opt_lib.build(kind, hyper, dict(fixed), curv, steps)
  w0 = jnp.zeros_like(q.b_train)

  def body(carry, _):
    w, state = carry
    wa = w @ q.a_train
    g = wa - q.b_train
    if shared:  # the test quadratic is the training one: reuse W A
      l = 0.5 * (jnp.sum(wa * w) - 2 * jnp.sum(w * q.b_test) + q.c_test)
    else:
      l = prob_lib.loss(q, w)
    upd, state = tx.update(g, state, w)
    return (w + upd, state), l

  (w, _), ls = jax.lax.scan(body, (w0, tx.init(w0)), None, length=steps)
  return jnp.concatenate([ls, prob_lib.loss(q, w)[None]])


def _masks(n_list: Sequence[int], n_max: int) -> jax.Array:
  return (jnp.arange(n_max)[None, :] < jnp.asarray(n_list)[:, None]).astype(
      jnp.result_type(float))


def _chunk_fn(s_vals: jax.Array, keys: jax.Array, hypers: tuple, *, spec: prob_lib.ProblemSpec,
              opts: tuple, n_list: tuple, steps: int, layout: str = "sliced") -> tuple:
  """Losses for a chunk of problems: a tuple (one per optimizer) of (P, nN, H, T+1) arrays.

  layout "padded": every N is the N_max problem with a 0/1 feature mask (one shape, vmapped
  over N). layout "sliced": the trace-time loop over the (few) N values slices the leading N
  features of the nested problem, so each N costs N^2 per step and N^3 per eigh instead of
  N_max^2 / N_max^3 — same program, no padding waste (default; both are tested equal).

  Two deliberate serialisations (both cheap): the eigendecompositions run one at a time
  (`lax.map`, unbatched), and each vmapped (optimizer, N) block waits for the previous one
  (`optimization_barrier`). jaxlib's batched CPU LAPACK kernels split a batch over XLA's intra-op
  thread pool and block on it; two such kernels in flight at once can take every pool thread and
  deadlock. Parallelism stays inside each vmapped op.
  """
  shared = spec.shares_statistics
  quads = jax.vmap(functools.partial(prob_lib.sample_problem, spec=spec))(keys, s_vals)
  if layout == "padded":
    masks = _masks(n_list, spec.n_max)
    blocks = [jax.vmap(jax.vmap(prob_lib.mask_features, (None, 0)), (0, None))(quads, masks)]
  else:
    blocks = [prob_lib.Quadratic(q.a_train[:, :n, :n], q.b_train[:, :, :n], q.a_test[:, :n, :n],
                                 q.b_test[:, :, :n], q.c_test, q.floor)
              for n in n_list for q in (quads,)]
  outs = [[] for _ in opts]
  last = None
  for qb in blocks:
    lead = qb.a_train.shape[:-2]
    n = qb.a_train.shape[-1]
    if last is not None:
      qb, _ = jax.lax.optimization_barrier((qb, last))
    mu, v = jax.lax.map(jnp.linalg.eigh, qb.a_train.reshape(-1, n, n))
    curv = opt_lib.Curvature(mu.reshape(*lead, n), v.reshape(*lead, n, n))
    for j, ((kind, fixed), h) in enumerate(zip(opts, hypers)):
      if last is not None:
        qb, _ = jax.lax.optimization_barrier((qb, last))

      def per_point(q, c, kind=kind, fixed=fixed, h=h):
        run = functools.partial(train_curve, q, c, kind, fixed, steps=steps, shared=shared)
        return jax.vmap(run)(h)

      f = per_point
      for _ in lead:
        f = jax.vmap(f)
      last = f(qb, curv)
      outs[j].append(last)
  if layout == "padded":
    return tuple(o[0] for o in outs), quads.floor
  return tuple(jnp.stack(o, axis=1) for o in outs), quads.floor


_chunk_jit = jax.jit(_chunk_fn, static_argnames=("spec", "opts", "n_list", "steps", "layout"))


def _hyper_arrays(spec: config_lib.OptimizerSpec, dtype) -> dict[str, jax.Array]:
  return {k: jnp.asarray([g[k] for g in spec.grid], dtype) for k in spec.grid_keys}


def problem_keys(seed: int, n_seeds: int) -> jax.Array:
  """One key per seed index; shared by every s (common random numbers)."""
  base = jax.random.key(seed)
  return jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.arange(n_seeds))


def run_sweep(cfg: dict, progress: bool | None = None) -> SweepResult:
  """Run the whole grid of a validated config; returns raw losses (float64 if compute.x64)."""
  p, t, c = cfg["problem"], cfg["train"], cfg["compute"]
  specs = config_lib.parse_optimizers(cfg["optimizers"])
  spec = prob_lib.ProblemSpec.from_config(p)
  s_grid = np.asarray(p["s"], float)
  n_seeds = p["seeds"]
  n_list = tuple(p["n_features"])
  steps = t["steps"]
  opts = tuple((o.kind, _freeze(o.fixed)) for o in specs)
  progress = c["progress"] if progress is None else progress
  n_dev = max(1, min(c["devices"], len(jax.devices())))
  chunk = c["chunk"] or n_seeds
  chunk = -(-chunk // n_dev) * n_dev
  n_prob = len(s_grid) * n_seeds
  n_chunks = -(-n_prob // chunk)
  if n_seeds < 3:
    warnings.warn(f"problem.seeds = {n_seeds}: only {n_seeds} independent problem draws; the "
                  f"{cfg['fit']['ci']:.0%} intervals use a t quantile with {n_seeds - 1} degree(s) "
                  "of freedom and are very wide (use 4 or more draws)", SmallSampleWarning,
                  stacklevel=2)

  with jax.enable_x64(bool(c["x64"])), blas.limit_blas_threads(c["blas_threads"]):
    dt = jnp.result_type(float)
    hypers = tuple(_hyper_arrays(o, dt) for o in specs)
    keys_all = problem_keys(p["seed"], n_seeds)
    s_idx = np.repeat(np.arange(len(s_grid)), n_seeds)
    k_idx = np.tile(np.arange(n_seeds), len(s_grid))
    pad = n_chunks * chunk - n_prob
    s_idx = np.concatenate([s_idx, np.full(pad, s_idx[-1])])
    k_idx = np.concatenate([k_idx, np.full(pad, k_idx[-1])])
    sharding = None
    if n_dev > 1:
      mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:n_dev]), ("p",))
      sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("p"))
    fn = functools.partial(_chunk_jit, spec=spec, opts=opts, n_list=n_list, steps=steps,
                           layout=c["n_layout"])
    outs, floors = [], []
    timing = {"first_chunk_s": 0.0, "total_s": 0.0}
    t0 = time.perf_counter()
    it = range(n_chunks)
    if progress:
      from tqdm.auto import tqdm
      it = tqdm(it, desc=f"sweep {cfg.get('name', '')}", unit="chunk")
    for i in it:
      sl = slice(i * chunk, (i + 1) * chunk)
      s_vals = jnp.asarray(s_grid[s_idx[sl]], dt)
      keys = keys_all[k_idx[sl]]
      if sharding is not None:
        s_vals, keys = jax.device_put((s_vals, keys), sharding)
      res, fl = fn(s_vals, keys, hypers)
      res = jax.device_get(res)
      outs.append(res)
      floors.append(np.asarray(fl))
      if i == 0:
        timing["first_chunk_s"] = time.perf_counter() - t0
    timing["total_s"] = time.perf_counter() - t0

  losses = {}
  for j, o in enumerate(specs):
    arr = np.concatenate([r[j] for r in outs])[:n_prob]
    losses[o.name] = arr.reshape(len(s_grid), n_seeds, *arr.shape[1:])
  floor = np.concatenate(floors)[:n_prob].reshape(len(s_grid), n_seeds)
  return SweepResult(cfg, s_grid, np.asarray(n_list), losses,
                     {o.name: o.grid for o in specs}, floor, timing)


def run_single(cfg: dict, s: float, seed_index: int, n: int, name: str,
               hyper: dict[str, float]) -> np.ndarray:
  """One configuration on its own, unpadded (N features exactly): loss after t = 0..T steps.

  The independent reference for the padded/vmapped sweep (tests) and the Python-loop baseline
  of the benchmark. Same random draws as the sweep (nested features: rows :n of U_max).
  """
  p, t, c = cfg["problem"], cfg["train"], cfg["compute"]
  spec = prob_lib.ProblemSpec.from_config(p)
  o = next(o for o in config_lib.parse_optimizers(cfg["optimizers"]) if o.name == name)
  with jax.enable_x64(bool(c["x64"])), blas.limit_blas_threads(c["blas_threads"]):
    dt = jnp.result_type(float)
    key = problem_keys(p["seed"], p["seeds"])[seed_index]
    h = {k: jnp.asarray(hyper[k], dt) for k in o.grid_keys}
    return np.asarray(_single_jit(jnp.asarray(s, dt), key, h, spec=spec, kind=o.kind,
                                  fixed=_freeze(o.fixed), n=n, steps=t["steps"]))


@functools.partial(jax.jit, static_argnames=("spec", "kind", "fixed", "n", "steps"))
def _single_jit(s, key, hyper, *, spec, kind, fixed, n, steps):
  q = prob_lib.sample_problem(key, s, spec)
  q = prob_lib.Quadratic(q.a_train[:n, :n], q.b_train[:, :n], q.a_test[:n, :n],
                         q.b_test[:, :n], q.c_test, q.floor)
  mu, v = jnp.linalg.eigh(q.a_train)
  return train_curve(q, opt_lib.Curvature(mu, v), kind, fixed, hyper, steps,
                     spec.shares_statistics)


# ----------------------------------------------------------------------------- summaries

ALPHA_COLUMNS = ["s", "optimizer", "alpha", "ci_low", "ci_high", "shift", "interval_method",
                 "se", "draws", "alpha_drop_first", "alpha_drop_last", "alpha_win_min",
                 "alpha_win_max", "window_shift", "window_ratio"]


def _window_columns(fa: fit_lib.AlphaFit, n: np.ndarray, in_fit: np.ndarray,
                    width: int) -> dict:
  """The fit-window report of one alpha as alpha.csv columns (fit.window_report)."""
  wr = fit_lib.window_report(n, fa.mean_loss, in_fit, width)
  shift = np.nanmax(np.abs(np.asarray([wr.alpha_drop_first, wr.alpha_drop_last]) - fa.alpha)) \
      if np.isfinite([wr.alpha_drop_first, wr.alpha_drop_last]).any() else np.nan
  half = 0.5 * (fa.ci_high - fa.ci_low)
  out = {"alpha_drop_first": wr.alpha_drop_first, "alpha_drop_last": wr.alpha_drop_last,
         "alpha_win_min": wr.alpha_win_min, "alpha_win_max": wr.alpha_win_max,
         "window_shift": float(shift),
         "window_ratio": float(shift / half) if half > 0 else np.nan}
  out.update({f"slope_{a}_{b}": float(v) for (a, b), v in zip(wr.windows, wr.slopes)})
  return out


def summarize(res: SweepResult, steps: int | None = None, n_min: int | None = None,
              n_max: int | None = None, policy: str | None = None,
              excess: bool | None = None, bootstrap: int | None = None,
              interval: str | None = None) -> tuple[list[dict], list[dict]]:
  """alpha rows (ALPHA_COLUMNS + `slope_<N_a>_<N_b>` sliding-window slopes) and loss rows.

  Every argument defaults to the config's `fit`/`train` section; pass one to re-analyse the
  same raw losses (e.g. a smaller step budget: losses are stored after every step).
  """
  f, t = res.cfg["fit"], res.cfg["train"]
  steps = f["steps"] if steps is None else steps
  n_min = f["n_min"] if n_min is None else n_min
  n_max = f["n_max"] if n_max is None else n_max
  policy = t["lr_policy"] if policy is None else policy
  excess = f["excess"] if excess is None else excess
  bootstrap = f["bootstrap"] if bootstrap is None else bootstrap
  interval = f.get("interval", "cluster_t") if interval is None else interval
  in_fit = (res.n >= n_min) & (res.n <= n_max)
  ref = int(np.searchsorted(res.n, t["transfer_n"])) if policy == "transfer" else 0
  alpha_rows, loss_rows = [], []
  for name, arr in res.losses.items():
    grid = res.grids[name]
    for i, s in enumerate(res.s):
      floor = float(res.floor[i].mean()) if excess else 0.0
      fa = fit_lib.fit_alpha(res.n, arr[i, :, :, :, steps], floor=floor, fit_mask=in_fit,
                             policy=policy, ref=ref, bootstrap=bootstrap, ci=f["ci"],
                             seed=1000 * i + 7, method=interval)
      row = {"s": float(s), "optimizer": name, "alpha": fa.alpha, "ci_low": fa.ci_low,
             "ci_high": fa.ci_high, "shift": np.nan, "interval_method": interval, "se": fa.se,
             "draws": int(arr.shape[1])}
      row.update(_window_columns(fa, res.n, in_fit, f.get("window", 3)))
      alpha_rows.append(row)
      for j, n in enumerate(res.n):
        sel = arr[i, :, j, fa.selected[j], steps] - floor
        row = {"s": float(s), "optimizer": name, "N": int(n), "steps": steps}
        row.update({f"hp_{k}": v for k, v in grid[fa.selected[j]].items()})
        row.update({"loss_mean": float(sel.mean()),
                    "loss_sem": float(sel.std(ddof=1) / np.sqrt(len(sel))) if len(sel) > 1
                    else 0.0, "in_fit": bool(in_fit[j])})
        loss_rows.append(row)
  base = {r["s"]: r["alpha"] for r in alpha_rows if r["optimizer"] == f["baseline"]}
  for r in alpha_rows:
    r["shift"] = r["alpha"] - base[r["s"]]
  return alpha_rows, loss_rows


def window_warning(alpha_rows: Sequence[dict]) -> str | None:
  """One line when dropping the smallest or largest fitted N moves alpha beyond its interval."""
  flagged = sorted((r for r in alpha_rows if r.get("window_ratio", 0) > 1),
                   key=lambda r: -r["window_ratio"])
  if not flagged:
    return None
  worst = "; ".join(
      f"s={r['s']:g} {r['optimizer']} {r['alpha']:.3f} +- {(r['ci_high'] - r['ci_low']) / 2:.3f}"
      f" -> {r['alpha_drop_first']:.3f} / {r['alpha_drop_last']:.3f}"
      f" ({r['window_ratio']:.1f} half-widths)" for r in flagged[:3])
  return (f"fit window: dropping the smallest or largest fitted N moves alpha by more than its "
          f"interval half-width in {len(flagged)} of {len(alpha_rows)} (s, optimizer) cells, so "
          f"L(N) is not one power law over the fitted range at this precision (window.png, "
          f"alpha.csv columns alpha_drop_*, alpha_win_*, slope_*). Largest: {worst}")


def alpha_table(alpha_rows: list[dict]) -> str:
  """A markdown table: one row per s, one column per optimizer, 'alpha [lo, hi]' ('*' marks a
  cell whose fit-window report exceeds its interval, window_ratio > 1)."""
  names = list(dict.fromkeys(r["optimizer"] for r in alpha_rows))
  svals = sorted({r["s"] for r in alpha_rows})
  get = {(r["s"], r["optimizer"]): r for r in alpha_rows}
  lines = ["| s | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
  for s in svals:
    cells = []
    for nm in names:
      r = get[(s, nm)]
      mark = "*" if r.get("window_ratio", 0) > 1 else ""
      cells.append(f"{r['alpha']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]{mark}")
    lines.append(f"| {s:g} | " + " | ".join(cells) + " |")
  if any(r.get("window_ratio", 0) > 1 for r in alpha_rows):
    lines.append("\n\\* dropping the smallest or largest fitted N moves alpha by more than the "
                 "interval half-width (window report)")
  return "\n".join(lines)


def _write_csv(path: pathlib.Path, rows: list[dict], cols: Sequence[str] | None = None) -> None:
  cols = list(cols or dict.fromkeys(k for r in rows for k in r))
  with path.open("w", newline="") as fh:
    w = csv.DictWriter(fh, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for r in rows:
      w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})


def save_raw(res: SweepResult, path: pathlib.Path) -> None:
  np.savez_compressed(path, s=res.s, n=res.n, floor=res.floor,
                      meta=json.dumps({"cfg": res.cfg, "grids": res.grids,
                                       "timing": res.timing}),
                      **{f"loss__{k}": v for k, v in res.losses.items()})


def load_raw(path: str | pathlib.Path) -> SweepResult:
  z = np.load(path)
  meta = json.loads(str(z["meta"]))
  losses = {k[len("loss__"):]: z[k] for k in z.files if k.startswith("loss__")}
  return SweepResult(meta["cfg"], z["s"], z["n"], losses, meta["grids"], z["floor"],
                     meta["timing"])


def write_outputs(res: SweepResult, out: pathlib.Path, plots: bool = True
                  ) -> tuple[list[dict], list[dict]]:
  """alpha.csv, losses.csv, raw.npz, config.json and (optionally) the PNG plots under out/."""
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  alpha_rows, loss_rows = summarize(res)
  slope_cols = [k for k in alpha_rows[0] if k.startswith("slope_")]
  _write_csv(out / "alpha.csv", alpha_rows, ALPHA_COLUMNS + slope_cols)
  _write_csv(out / "losses.csv", loss_rows)
  save_raw(res, out / "raw.npz")
  (out / "config.json").write_text(json.dumps(res.cfg, indent=2))
  if plots:
    from scaleopt.scaling import plots as plots_lib
    plots_lib.plot_all(res, alpha_rows, loss_rows, out)
  msg = window_warning(alpha_rows)
  if msg:
    warnings.warn(msg, FitWindowWarning, stacklevel=2)
  return alpha_rows, loss_rows


def check_out_dir(out_dir: str | pathlib.Path) -> pathlib.Path:
  """Create the output folder now (before the sweep) or raise OSError with a one-line reason."""
  out = pathlib.Path(out_dir)
  if out.exists() and not out.is_dir():
    raise OSError(f"--out {out}: is a file, expected a directory")
  try:
    out.mkdir(parents=True, exist_ok=True)
    probe = out / ".write_test"
    probe.write_bytes(b"")
    probe.unlink()
  except OSError as e:
    raise OSError(f"--out {out}: cannot write there ({e.strerror or e.__class__.__name__})"
                  ) from None
  return out


def run_and_write(cfg: dict, out: pathlib.Path) -> tuple[SweepResult, list[dict], list[str]]:
  """run_sweep + write_outputs; the small-sample and fit-window warnings come back as lines."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", SmallSampleWarning)
    warnings.simplefilter("always", FitWindowWarning)
    res = run_sweep(cfg)
    alpha_rows, _ = write_outputs(res, out)
  notes = []
  for w in caught:
    if issubclass(w.category, (SmallSampleWarning, FitWindowWarning)):
      notes.append(str(w.message))
    else:
      warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
  return res, alpha_rows, notes


def sweep_main(config_path: str, out_dir: str, overrides: Sequence[str] | None = None) -> int:
  """`scaleopt sweep --config X --out DIR [--set a.b=v ...]`."""
  try:
    cfg = config_lib.load_config(config_path, overrides or [])
    out = check_out_dir(out_dir)
  except (config_lib.ConfigError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  res, alpha_rows, notes = run_and_write(cfg, out)
  print(alpha_table(alpha_rows))
  for msg in notes:
    print(f"WARNING: {msg}", file=sys.stderr)
  print(f"sweep '{cfg['name']}': {res.timing['total_s']:.1f} s "
        f"(first chunk incl. compile {res.timing['first_chunk_s']:.1f} s); outputs in {out_dir}")
  return 0
