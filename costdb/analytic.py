"""The embedded default: a roofline model with device peaks, needing no GPU and no database.

Time = launch overhead + max(FLOPs / effective rate, bytes / effective bandwidth). The effective
matrix rate grows with problem size (small GEMMs cannot fill the GPU), following
``peak * F / (F + F_half)``. The H200 figures are fitted to measurements in
``docs/DESIGN.md`` (ORT 1.31 CUDA EP): fp16 8192^3 GEMM 4.9 ms aligned and 10.2 ms at
8192x8191x8191; MatMul 512x768x768 fp32 47 us vs fp16 + casts 57 us; 256x2048x1001 51 vs 65 us;
Pad + Slice about 20 us.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from onnxcampo.costdb.features import OpFeatures
from onnxcampo.costdb.model import CostModel


@dataclass(frozen=True)
class DevicePeaks:
    name: str
    tf32_flops: float  # effective large-GEMM rate, fp32 inputs on TF32 Tensor Cores
    fp32_flops: float  # CUDA cores, when TF32 is off
    fp16_tc_flops: float  # fp16 Tensor Cores, dims aligned to 8
    fp16_unaligned_flops: float  # fp16 with K or N not a multiple of 8
    half_rate_flops: float  # problem size at which a GEMM reaches half its peak rate
    bandwidth: float  # effective bytes / s
    launch_us: float  # per-kernel overhead, the same in both precisions
    cast_us: float  # C_I of a Cast kernel
    pad_us: float  # fixed cost of one Pad or Slice


H200 = DevicePeaks(
    name="nvidia-h200 (analytic)",
    tf32_flops=1.4e14,
    fp32_flops=4.5e13,
    fp16_tc_flops=2.3e14,
    fp16_unaligned_flops=1.1e14,
    half_rate_flops=2.0e9,
    bandwidth=3.3e12,
    launch_us=5.0,
    cast_us=4.5,
    pad_us=10.0,
)


@dataclass(frozen=True)
class HostCosts:
    """What the host adds to a run on the CUDA EP, per launch by class and per run (us). These
    belong to the machine's CPU and ONNX Runtime, not to the GPU's specs: :data:`TYPICAL_HOST`
    holds the figures fitted from whole-model runs on the H200 machine (the shipped database's
    ``host_launch`` and ``run_overhead``), used by the roofline model of a detected GPU until
    ``costdb calibrate`` measures this machine's."""

    conv_us: float
    other_us: float
    run_us: float


TYPICAL_HOST = HostCosts(conv_us=8.1, other_us=3.4, run_us=51.0)


class AnalyticCostModel(CostModel):
    """The roofline of :class:`DevicePeaks`; ``host``: per-launch and per-run host costs, added to
    the GPU's work (None: no host costs, the reference model's behaviour)."""

    def __init__(self, peaks: DevicePeaks = H200, *, use_tf32: bool = True, host: HostCosts | None = None) -> None:
        self.peaks = peaks
        self.use_tf32 = use_tf32
        self.host = host
        self.name = peaks.name

    def launch_us(self, op_class: str = "other", training: bool = False) -> float:
        if self.host is None:
            return super().launch_us(op_class, training)
        return self.host.conv_us if op_class == "conv" else self.host.other_us

    def dispatch_us(self, training: bool = False) -> float:
        return 0.0 if self.host is None else self.host.other_us

    def host_adds(self, training: bool = False) -> bool:
        return self.host is not None

    def run_us(self) -> float:
        return 0.0 if self.host is None else self.host.run_us

    def _gemm_us(self, flops: float, peak: float) -> float:
        if flops <= 0:  # a product of a zero-size dim: no work
            return 0.0
        rate = peak * flops / (flops + self.peaks.half_rate_flops)
        return flops / rate * 1e6

    def _memory_us(self, elements: int, bytes_per_element: int) -> float:
        return elements * bytes_per_element / self.peaks.bandwidth * 1e6

    def _time(self, features: OpFeatures, fp16: bool) -> float:
        if not features.known:
            return self.peaks.launch_us
        memory = self._memory_us(features.elements, 2 if fp16 else 4)
        if not features.is_gemm:
            return self.peaks.launch_us + memory
        if fp16:
            peak = self.peaks.fp16_tc_flops if features.tensor_core_aligned else self.peaks.fp16_unaligned_flops
        else:
            peak = self.peaks.tf32_flops if self.use_tf32 else self.peaks.fp32_flops
        return self.peaks.launch_us + max(self._gemm_us(features.flops, peak), memory)

    def fp32_time(self, features: OpFeatures) -> float:
        return self._time(features, fp16=False)

    def fp16_time(self, features: OpFeatures, fp32_time: float) -> float:
        predicted32 = self._time(features, fp16=False)
        predicted16 = self._time(features, fp16=True)
        # A measured fp32 time scales the prediction: the ratio is what the roofline knows.
        return predicted16 * (fp32_time / predicted32) if predicted32 > 0 else predicted16

    def cast_time(self, elements: int) -> float:
        return self.peaks.cast_us + self._memory_us(elements, 6)

    def pad_time(self, elements: int, kind: str = "Pad") -> float:
        return self.peaks.pad_us + self._memory_us(elements, 4)

    def describe(self) -> dict:
        return {"name": self.name, "kind": "analytic", "use_tf32": self.use_tf32, "peaks": asdict(self.peaks),
                **({"host": asdict(self.host)} if self.host is not None else {}), **self._origin()}
