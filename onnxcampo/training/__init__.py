"""Training on ONNX Runtime: step graphs in standard ops and a runner."""

from onnxcampo.training.export import export
from onnxcampo.training.step import LOSSES, OPTIMIZERS, build_train_step, initial_weights, step_spec
from onnxcampo.training.trainer import Trainer

__all__ = ["LOSSES", "OPTIMIZERS", "Trainer", "build_train_step", "export", "initial_weights", "step_spec"]
