"""Suite-wide pytest settings."""

# ``make test`` runs two workers, each taking whole files in collection order. These files take
# longest on CPU (each a minute or more); they are handed out first, so that the two workers
# finish together instead of one waiting for the other's last long file.
FIRST = ("train/test_shampoo_blocks.py", "train/test_device_microbatches.py",
         "train/test_train.py", "study/test_study_run.py", "optim/test_shampoo_multidevice.py",
         "optim/test_shipped_configs.py", "scaling/test_sweep.py", "train/test_phased.py",
         "train/test_shard_optimizer.py", "train/test_offload.py",
         "optim/test_shampoo_sharded.py", "scaling/test_lm_alpha_study.py",
         "train/test_multiprocess.py", "train/test_telemetry.py",
         "study/test_study_contrasts.py")


def pytest_collection_modifyitems(session, config, items):
  del session, config
  rank = {f: i for i, f in enumerate(FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"),
                                       len(FIRST)))  # stable: other files keep their order
