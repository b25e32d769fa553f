"""The interface every cost model offers to the passes (tests pass fakes of it)."""

from __future__ import annotations

import abc
from dataclasses import dataclass

from onnxcampo.costdb.features import OpFeatures


@dataclass(frozen=True)
class FusedKernelCost:
    """One ``ai.onnxcampo::FusedElementwise`` kernel: ``fixed_us + bytes / bytes_per_us``, bytes
    being what it reads (its inputs, once) plus what it writes (the outputs read outside it).
    ``measured``: fitted on the device (``benchmarks/fused_elementwise_costs.py``)."""

    bytes_per_us: float
    fixed_us: float
    measured: bool = False

    def time_us(self, nbytes: float) -> float:
        return self.fixed_us + nbytes / self.bytes_per_us


# NOT MEASURED: a first estimate from docs/ops.md's H200 table of the generated kernel, about
# 75 MB moved in 0.031 ms (~2.4e6 bytes/us; the table's three chains give 1.6-4.7e6 bytes/us: the
# erf GELU moves 50 MB in 0.031 ms, the Cast + Mul 75 MB in 0.019 ms, the LayerNorm-backward-like
# chain 38 MB in 0.008 ms), and a fixed cost of the order of a Cast kernel's fitted C_I (0.88 us).
# To be replaced by the fit of benchmarks/fused_elementwise_costs.py on the H200, merged into
# the database (onnxcampo.costdb.fit.merge_fused_elementwise).
DEFAULT_FUSED_KERNEL = FusedKernelCost(bytes_per_us=75e6 / 31.0, fixed_us=1.0, measured=False)


class CostModel(abc.ABC):
    """Predicted times in microseconds on one GPU.

    ``fp16_time`` takes the node's fp32 time because Campo's regression predicts fp16 time *from*
    the fp32 time (``sum_i w_i * f_i + sigma * t_fp32``): when fp32 times are measured by
    profiling, fp16 predictions improve with them.
    """

    name: str = "cost model"
    # which rule chose this model and from where (``onnxcampo.costdb.select``): source, path, gpu,
    # measured (date), age_days; empty for a model built by hand
    origin: dict = {}

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

    def library_launch_us(self, kind: str) -> float | None:
        """Host time of one call of ``kind`` measured whole at inference (``conv_nhwc``: the custom-op
        library's ConvNhwc call; ``custom``: a FusedElementwise call; ``conv_fp16``: ORT's float16
        NCHW Conv with cuDNN's layout transforms), where the database measured it (``costdb
        calibrate``), else None."""
        return None

    def host_adds(self, training: bool = False) -> bool:
        """Whether the host's launches add to the GPU's work (``True``: a run costs both) or hide
        behind it (``False``: the larger of the two, the default)."""
        return False

    def host_overlap(self, training: bool = False) -> float:
        """The share of the smaller of the GPU's work and the host's launches that a run adds to
        the larger: 1 (both add: :meth:`host_adds`), 0 (the larger alone), or a share fitted from
        whole runs (``python -m onnxcampo.benchmarks host-overlap``): the host runs ahead of the
        GPU on large kernels and waits for it on small ones."""
        return 1.0 if self.host_adds(training) else 0.0

    def run_us(self) -> float:
        """Fixed cost of one run whatever its nodes (the call, the launch, the synchronisation):
        the same for every plan of a model, it makes the predicted totals, and with them the
        relative ``min_gain``, those of real runs. 0 where unknown."""
        return 0.0

    def chain_factor(self, pattern: str, precision: str) -> float:
        """Time of a fusable chain (``onnxcampo.costdb.chains``) over the sum of its nodes' times
        when all of them run in ``precision`` ("fp32"/"fp16"); 1.0 where nothing is measured."""
        return 1.0

    def fused_kernel(self) -> FusedKernelCost:
        """What a ``FusedElementwise`` kernel costs (``fused_elementwise`` in a database), else
        :data:`DEFAULT_FUSED_KERNEL` (an estimate, not measured)."""
        return DEFAULT_FUSED_KERNEL

    def describe(self) -> dict:
        return {"name": self.name, **self._origin()}

    def _origin(self) -> dict:
        return {"origin": dict(self.origin)} if self.origin else {}
