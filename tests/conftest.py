"""Suite-wide pytest settings."""

import os
import pathlib

# Compiling dominates this suite's CPU time. Two settings that leave every program's HLO as it
# is and change how fast it compiles: LLVM at its lowest optimisation level (XLA's own passes
# are unchanged; test programs are small and run briefly), and a compilation cache in the clone,
# so that a program another test (or the other worker) already compiled is loaded instead.
# Each only where the caller has not set it; the optimisation level only where the tests run
# on CPU (on a GPU machine it would also apply to the GPU kernels). `make clean` empties the
# cache.
_accelerator = (any(pathlib.Path("/dev").glob("nvidia[0-9]*"))
                or pathlib.Path("/dev/accel0").exists())
_on_cpu = os.environ.get("JAX_PLATFORMS", "" if _accelerator else "cpu") == "cpu"
if _on_cpu and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_backend_optimization_level=0").strip()
# On an accelerator, float32 matmuls at full precision (a GPU's default is TF32): the tests
# compare float32 programs with float64 references and with each other at float32 tolerances.
# Tests of the TF32 paths set their precision explicitly.
if not _on_cpu:
  os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      str(pathlib.Path(__file__).resolve().parents[1] / ".jaxcache" / "tests"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

# ``make test`` and ``make test-integration`` each run two workers, each taking whole files in
# collection order. These files take longest on CPU in their tier (integration first, then the
# fast tier's); they are handed out first, so that the two workers finish together instead of
# one waiting for the other's last long file.
FIRST = ("train/test_shampoo_blocks.py", "train/test_train.py", "optim/test_shipped_configs.py",
         "train/test_device_microbatches.py", "study/test_study_run.py",
         "optim/test_shampoo_multidevice.py", "train/test_telemetry.py", "train/test_phased.py",
         "train/test_shard_optimizer.py", "study/test_study_vmapped.py",
         "scaling/test_lm_alpha_study.py", "optim/test_shampoo_sharded.py",
         "train/test_kill_loop.py", "train/test_multiprocess.py",
         "models/test_models_moe.py", "models/test_models_fold.py",
         "models/test_models_variants.py", "optim/test_mu_dtype.py", "models/test_models_norm.py",
         "scaling/test_sweep.py", "optim/test_sophia.py", "optim/test_shampoo.py",
         "study/test_study_contrasts.py", "train/test_prepare.py", "train/test_storage.py")


def pytest_collection_modifyitems(session, config, items):
  del session, config
  rank = {f: i for i, f in enumerate(FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"),
                                       len(FIRST)))  # stable: other files keep their order
