"""Studies: grids of training runs (arms x learning rates x seeds x keys) with resumable
execution, cheap vmapped cells and seed-interval reports. See docs/studies.md."""

from scaleopt.study.config import Cell, Study, from_dict, load
from scaleopt.study.report import paired_interval, t_interval
from scaleopt.study.runner import run_study, study_main

__all__ = ["Cell", "Study", "from_dict", "load", "paired_interval", "run_study", "study_main",
           "t_interval"]
