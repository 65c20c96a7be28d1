"""scaleopt.train: pretraining from configs (see docs/training.md).

  train_main(config_path, out_dir, overrides=["a.b=v"], resume=False) -> exit code   (main.py)
  train(cfg, out_dir, resume=False) -> summary dict                                   (loop.py)
  load_config(path, overrides) -> TrainConfig; from_dict(raw) -> TrainConfig         (config.py)
  prepare_main(input, out, tokenizer="bytes") -> exit code                           (data.py)
  run_default(out_dir)                                                                (demo.py)

Imports are lazy so that ``import scaleopt.train`` stays cheap.
"""

__all__ = ["train_main", "train", "load_config", "from_dict", "prepare_main", "run_default"]


def __getattr__(name):
  if name == "train_main":
    from scaleopt.train.main import train_main
    return train_main
  if name == "train":
    from scaleopt.train.loop import train
    return train
  if name in ("load_config", "from_dict"):
    from scaleopt.train import config
    return getattr(config, name)
  if name == "prepare_main":
    from scaleopt.train.data import prepare_main
    return prepare_main
  if name == "run_default":
    from scaleopt.train.demo import run_default
    return run_default
  raise AttributeError(name)
