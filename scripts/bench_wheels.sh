#!/usr/bin/env bash
# Downloads the wheels the benchmark's anchors need on the GPU machine (Python 3.12, x86_64, no
# network there) into the git-ignored .benchwheels/ of the checkout. The benchmarks
# (onnxcampo.benchmarks.policies) install the ones that fit the running Python into /tmp/benchpkgs
# with `pip install --no-deps --no-index --target` and append that folder to sys.path (packages
# already installed there win).
#
# Usage, in the project root:   bash scripts/bench_wheels.sh     (then carry .benchwheels)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
dest=.benchwheels
rm -rf "$dest"
mkdir -p "$dest"
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
# ModelOpt AutoCast and what it imports (five wheels, --no-deps as the issue prescribes), plus
# nvidia-ml-py (pynvml), which modelopt.onnx imports and the GPU image may lack;
# onnxconverter-common (pure Python); onnx-ad in case the onnxcampo install there lacks it;
# onnx2torch (pure Python: the PyTorch twins of the corpus models), which needs torch and imports
# torchvision when imported (its NMS and RoiAlign converters): the GPU image has both;
# onnxscript, onnx-ir and ml-dtypes: torch.onnx's default (dynamo) exporter, which
# onnxcampo.training.export uses for the training benchmarks' models.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d "$dest" \
  nvidia-modelopt==0.47.0 lief==1.0.0 polygraphy==0.53.6 onnxslim==0.1.98 onnx-graphsurgeon==0.6.1 \
  onnxconverter-common==1.16.0 onnx-ad==0.3.0 nvidia-ml-py==13.615.71 onnx2torch==1.5.15 \
  onnxscript==0.7.2 onnx-ir==1.1.0 ml-dtypes==0.7.0
ls -l "$dest"
du -sh "$dest"
