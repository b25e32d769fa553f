"""The interface every cost model offers to the passes (tests pass fakes of it)."""

from __future__ import annotations

import abc

from onnxcampo.costdb.features import OpFeatures


class CostModel(abc.ABC):
    """Predicted times in microseconds on one GPU.

    ``fp16_time`` takes the node's fp32 time because Campo's regression predicts fp16 time *from*
    the fp32 time (``sum_i w_i * f_i + sigma * t_fp32``): when fp32 times are measured by
    profiling, fp16 predictions improve with them.
    """

    name: str = "cost model"

    @abc.abstractmethod
    def fp32_time(self, features: OpFeatures) -> float:
        """fp32 time of the op (TF32 Tensor Cores for products, as ORT's CUDA EP does)."""

    @abc.abstractmethod
    def fp16_time(self, features: OpFeatures, fp32_time: float) -> float:
        """fp16 time given the fp32 time; Tensor Cores when ``features.tensor_core_aligned``."""

    @abc.abstractmethod
    def cast_time(self, elements: int) -> float:
        """One Cast kernel fp32<->fp16 over ``elements`` elements: ``C_I + r * elements``."""

    @abc.abstractmethod
    def pad_time(self, elements: int, kind: str = "Pad") -> float:
        """One ``Pad`` or ``Slice`` (``kind``) of an fp16 tensor of ``elements`` output elements."""

    def dispatch_us(self, training: bool = False) -> float:
        """Host time ONNX Runtime needs to launch one node that the node times do not include.

        A run cannot be faster than ``dispatch_us * nodes``: with small kernels the GPU waits for
        the host (``onnxcampo.estimate.plan_time``). ``training``: per node of a training step,
        where ORT's executor costs more per node than for the single ops the database measures.
        0 for models whose node times include it."""
        return 0.0

    def launch_us(self, op_class: str = "other", training: bool = False) -> float:
        """Host time of one launch of a node of ``op_class`` ("conv": convolutions, whose cuDNN
        calls cost the host more; "other"), fitted from whole-model runs where the database has
        it (``host_launch``), else :meth:`dispatch_us`."""
        return self.dispatch_us(training)

    def host_adds(self, training: bool = False) -> bool:
        """Whether the host's launches add to the GPU's work (``True``: a run costs both) or hide
        behind it (``False``: the larger of the two, the default)."""
        return False

    def run_us(self) -> float:
        """Fixed cost of one run whatever its nodes (the call, the launch, the synchronisation):
        the same for every plan of a model, it makes the predicted totals, and with them the
        relative ``min_gain``, those of real runs. 0 where unknown."""
        return 0.0

    def chain_factor(self, pattern: str, precision: str) -> float:
        """Time of a fusable chain (``onnxcampo.costdb.chains``) over the sum of its nodes' times
        when all of them run in ``precision`` ("fp32"/"fp16"); 1.0 where nothing is measured."""
        return 1.0

    def describe(self) -> dict:
        return {"name": self.name}
