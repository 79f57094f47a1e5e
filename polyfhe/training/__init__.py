"""Training loop, recipe and checkpoints for polynomial networks (GPU when present, CPU otherwise).

``polyfhe.train(model_name, data, epochs, out_dir)`` is the entry point; see ``docs/training.md``.
"""

from polyfhe.training.api import TrainResult, train
from polyfhe.training.config import TrainConfig
from polyfhe.training.data import Normalization
from polyfhe.training.loop import TrainingDiverged
from polyfhe.training.metrics import EpochRecord, TrainMetrics

__all__ = ["EpochRecord", "Normalization", "TrainConfig", "TrainMetrics", "TrainResult", "TrainingDiverged", "train"]
