"""Build the ONNX Runtime training-artifact fixtures in ``tests/fixtures/ort_artifacts/``.

Two small models, exported in eval mode at opset 17 and turned into training artifacts by
``onnxruntime.training.artifacts.generate_artifacts`` (cross-entropy loss, AdamW):

* ``mlp``: 64 -> Linear(128) -> ReLU -> Linear(10);
* ``cnn``: 3x8x8 -> Conv(8, 3x3) -> BatchNorm -> ReLU -> MaxPool(2) -> Linear(10).

Each folder gets ``training_model.onnx``, ``eval_model.onnx``, ``optimizer_model.onnx`` and
``checkpoint``. The batch dim is dynamic (``batch``), as in an application's export. Weights are
seeded, so a rerun writes the same files (up to the generator's own node naming).

It needs the training build, which has its own venv (docs/benchmarks/training/ort-artifacts.md says
how to make it): ``onnxruntime-training-cpu==1.19.2``, ``onnx==1.16.2`` (newer onnx writes IR versions it
refuses) and ``torch==2.13.0`` (needed to import it)::

    /work/ortt-venv/bin/python scripts/make_ort_artifacts.py [--out tests/fixtures/ort_artifacts]
"""

from __future__ import annotations

import argparse
import io
import shutil
import sys
from pathlib import Path

import onnx
import torch
from onnxruntime.training import artifacts

OPSET = 17
SEED = 0
FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "ort_artifacts"


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 128)
        self.fc2 = torch.nn.Linear(128, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class CNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.pool = torch.nn.MaxPool2d(2)
        self.fc = torch.nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        y = self.pool(torch.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(y, 1))


# name -> (module class, input shape without the batch dim)
MODELS = {"mlp": (MLP, (64,)), "cnn": (CNN, (3, 8, 8))}


def export(name: str) -> onnx.ModelProto:
    torch.manual_seed(SEED)
    cls, shape = MODELS[name]
    module = cls().eval()
    if name == "cnn":
        # Non-trivial running statistics, so that eval-mode BatchNorm is not an identity.
        with torch.no_grad():
            module.bn.running_mean.uniform_(-0.5, 0.5)
            module.bn.running_var.uniform_(0.5, 1.5)
    buffer = io.BytesIO()
    torch.onnx.export(
        module, (torch.randn(2, *shape),), buffer, dynamo=False, opset_version=OPSET,
        input_names=["input"], output_names=["output"],
        dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
        # TrainingMode.PRESERVE keeps BatchNormalization as a node (EVAL folds it into the Conv):
        # the training graph then has ORT's BatchNormInternal and its gradient.
        training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False,
    )
    return onnx.load_from_string(buffer.getvalue())


def build(name: str, out: Path) -> None:
    model = export(name)
    folder = out / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    params = [t.name for t in model.graph.initializer]
    frozen = [p for p in params if p.endswith(("running_mean", "running_var", "num_batches_tracked"))]
    artifacts.generate_artifacts(
        model,
        requires_grad=[p for p in params if p not in frozen],
        frozen_params=frozen,
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=artifacts.OptimType.AdamW,
        artifact_directory=folder,
    )
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    print(f"wrote {folder} ({size / 1e3:.0f} kB): " + ", ".join(sorted(p.name for p in folder.iterdir())))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=FIXTURES)
    parser.add_argument("models", nargs="*", metavar="MODEL", help=f"any of {', '.join(MODELS)} (default: all)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    for name in args.models or MODELS:
        build(name, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
