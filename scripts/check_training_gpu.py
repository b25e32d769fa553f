"""Train the test MLP on the CUDA EP and on the CPU EP with the same step graph and compare the
loss curves (run on the GPU machine):

    PYTHONPATH=/tmp/oc:/tmp/ortgpu python3 scripts/check_training_gpu.py
"""

from __future__ import annotations

import sys

import numpy as np

import onnxcampo
from onnxcampo.examples.training_mlp import CLASSES, X, mlp
from onnxcampo.training import Trainer, build_train_step, initial_weights


def main() -> int:
    forward = mlp()
    step = build_train_step(forward, loss="cross_entropy", optimizer="adamw", lr=0.01)
    variants = {"fp32": step, "campo": onnxcampo.optimize(step, policy="campo").model,
                "amp": onnxcampo.optimize(step, policy="amp").model}
    curves = {}
    for name, model in variants.items():
        for provider in ("cpu", "cuda"):
            trainer = Trainer(model, weights=initial_weights(forward, step), provider=provider)
            curves[(name, provider)] = [trainer.step({"x": X, "labels": CLASSES}) for _ in range(50)]
    for (name, provider), losses in curves.items():
        print(f"{name:6s} {provider:5s} loss {losses[0]:.5f} -> {losses[-1]:.5f}")
    reference = np.array(curves[("fp32", "cpu")])
    for key, losses in curves.items():
        gap = float(np.max(np.abs(np.array(losses) - reference) / reference))
        print(f"{key}: largest relative gap to fp32 on CPU {100 * gap:.3f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
