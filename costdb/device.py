"""What the driver says about this machine's GPU, and the roofline peaks that follow from it.

:func:`gpu_spec` reads the first GPU's facts from the CUDA driver (``libcuda``, through ctypes:
name, multiprocessors, SM and memory clocks, memory bus width, compute capability), else its name
and compute capability from ``nvidia-smi``. :func:`peaks_for` turns a spec into the analytic
model's :class:`~onnxcampo.costdb.analytic.DevicePeaks`:

1. dense Tensor Core fp16 rate = SMs x SM clock x fp16 FLOPs per SM per clock of the Tensor Core
   generation (:data:`FP16_TC_PER_SM_CLOCK`, from the compute capability); TF32 at half of it
   from compute capability 8.0 on, CUDA-core fp32 (:data:`FP32_PER_SM_CLOCK`) before;
2. memory bandwidth = 2 x memory clock x bus width (double data rate; HBM and GDDR alike);
3. what a GEMM or an elementwise kernel reaches of those peaks under ONNX Runtime (cuBLAS, cuDNN,
   its own kernels) is a share of them, :data:`EFFICIENCY`: the shares of the analytic model
   fitted on an H200's measurements, applied to this GPU's own peaks; the fixed costs (launch,
   Cast, Pad) are those of the same model.

A spec that misses the multiprocessors or clocks (``nvidia-smi`` only) gives no peaks: the caller
keeps the reference model and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import shutil
import subprocess
from dataclasses import asdict, dataclass, replace

from onnxcampo.costdb.analytic import H200, DevicePeaks

log = logging.getLogger(__name__)

# fp16 Tensor Core FLOPs per SM per clock, dense, by compute capability (major, minor); a major
# alone applies to every minor without its own entry. Volta/Turing 1024, A100 2048, GA10x/Ada and
# consumer Blackwell 512, Hopper 4096, data-centre Blackwell 8192.
FP16_TC_PER_SM_CLOCK = {(7,): 1024, (8, 0): 2048, (8,): 512, (9,): 4096, (10,): 8192, (12,): 512}
# fp32 FLOPs per SM per clock on CUDA cores (2 per FMA): 64 FMA units per SM before GA10x, 128 since
FP32_PER_SM_CLOCK = {(7,): 128, (8, 0): 128, (8,): 256, (9,): 256, (10,): 256, (12,): 256}
# Share of each peak the analytic model reaches (H200's fitted effective rates over its peaks:
# 132 SMs at 1980 MHz, 4.8 TB/s): large GEMMs on TF32 / fp16 Tensor Cores, unaligned fp16 GEMMs,
# CUDA-core fp32, and streaming bandwidth.
_H200_SMS, _H200_CLOCK_HZ, _H200_BANDWIDTH = 132, 1.98e9, 4.8e12
_H200_FP16_PEAK = _H200_SMS * _H200_CLOCK_HZ * 4096
EFFICIENCY = {
    "tf32": H200.tf32_flops / (_H200_FP16_PEAK / 2),
    "fp16_tc": H200.fp16_tc_flops / _H200_FP16_PEAK,
    "fp16_unaligned": H200.fp16_unaligned_flops / _H200_FP16_PEAK,
    "fp32": H200.fp32_flops / (_H200_SMS * _H200_CLOCK_HZ * 256),
    "bandwidth": H200.bandwidth / _H200_BANDWIDTH,
}
# half-rate problem size scales with the machine's width (more SMs need larger GEMMs to fill)
_H200_HALF_RATE_PER_SM = H200.half_rate_flops / _H200_SMS


@dataclass(frozen=True)
class GpuSpec:
    """One GPU as the driver reports it; 0 where unknown."""

    name: str
    compute_capability: str = ""
    multiprocessors: int = 0
    sm_clock_mhz: float = 0.0
    memory_clock_mhz: float = 0.0
    bus_width_bits: int = 0
    memory_mb: int = 0
    source: str = "driver"

    @property
    def complete(self) -> bool:
        return bool(self.multiprocessors and self.sm_clock_mhz and self.memory_clock_mhz and self.bus_width_bits
                    and self.compute_capability)

    @property
    def bandwidth(self) -> float:
        """Peak memory bandwidth, bytes/s."""
        return 2.0 * self.memory_clock_mhz * 1e6 * self.bus_width_bits / 8

    def describe(self) -> str:
        if not self.complete:
            return f"{self.name} (compute capability {self.compute_capability or 'unknown'})"
        return (f"{self.name}: {self.multiprocessors} SMs at {self.sm_clock_mhz:.0f} MHz, "
                f"{self.bandwidth / 1e12:.2f} TB/s, compute capability {self.compute_capability}")

    def to_json(self) -> dict:
        return asdict(self)


def _per_clock(table: dict, capability: str) -> int | None:
    try:
        major, minor = (int(part) for part in capability.split(".")[:2])
    except ValueError:
        return None
    return table.get((major, minor), table.get((major,)))


def peaks_for(spec: GpuSpec) -> DevicePeaks | None:
    """The analytic model's peaks for ``spec`` (rules 1-3 of the module), None where the spec
    lacks what they need or the architecture is unknown (before Volta: no Tensor Cores)."""
    if not spec.complete:
        return None
    fp16_clock = _per_clock(FP16_TC_PER_SM_CLOCK, spec.compute_capability)
    fp32_clock = _per_clock(FP32_PER_SM_CLOCK, spec.compute_capability)
    if fp16_clock is None or fp32_clock is None:
        return None
    per_second = spec.multiprocessors * spec.sm_clock_mhz * 1e6
    fp16_peak, fp32_peak = per_second * fp16_clock, per_second * fp32_clock
    tf32_peak = fp16_peak / 2 if float(spec.compute_capability) >= 8.0 else fp32_peak
    tf32_share = EFFICIENCY["tf32"] if float(spec.compute_capability) >= 8.0 else EFFICIENCY["fp32"]
    return replace(
        H200,
        name=f"{spec.name} (analytic, from its specs)",
        tf32_flops=tf32_peak * tf32_share,
        fp32_flops=fp32_peak * EFFICIENCY["fp32"],
        fp16_tc_flops=fp16_peak * EFFICIENCY["fp16_tc"],
        fp16_unaligned_flops=fp16_peak * EFFICIENCY["fp16_unaligned"],
        half_rate_flops=_H200_HALF_RATE_PER_SM * spec.multiprocessors,
        bandwidth=spec.bandwidth * EFFICIENCY["bandwidth"],
    )


# CUdevice_attribute values (cuda.h)
_ATTRIBUTES = {"sm_clock_khz": 13, "multiprocessors": 16, "memory_clock_khz": 36, "bus_width_bits": 37,
               "major": 75, "minor": 76}


def _from_driver() -> GpuSpec | None:
    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    try:
        cuda = ctypes.CDLL(name)
    except OSError:
        return None
    device, value = ctypes.c_int(0), ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGet(ctypes.byref(device), 0) != 0:
        return None
    buffer = ctypes.create_string_buffer(256)
    if cuda.cuDeviceGetName(buffer, 256, device) != 0:
        return None
    facts = {}
    for key, attribute in _ATTRIBUTES.items():
        if cuda.cuDeviceGetAttribute(ctypes.byref(value), attribute, device) != 0:
            return None
        facts[key] = value.value
    total = ctypes.c_size_t(0)
    getter = getattr(cuda, "cuDeviceTotalMem_v2", None)
    memory_mb = total.value // 2**20 if getter is not None and getter(ctypes.byref(total), device) == 0 else 0
    return GpuSpec(name=buffer.value.decode(errors="replace").strip(),
                   compute_capability=f"{facts['major']}.{facts['minor']}",
                   multiprocessors=facts["multiprocessors"], sm_clock_mhz=facts["sm_clock_khz"] / 1e3,
                   memory_clock_mhz=facts["memory_clock_khz"] / 1e3, bus_width_bits=facts["bus_width_bits"],
                   memory_mb=int(memory_mb), source="driver")


def _from_nvidia_smi() -> GpuSpec | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap,clocks.max.sm,clocks.max.memory,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    if out.returncode != 0 or not lines:
        return None
    parts = [part.strip() for part in lines[0].split(",")]

    def number(index: int) -> float:
        try:
            return float(parts[index])
        except (IndexError, ValueError):
            return 0.0

    return GpuSpec(name=parts[0], compute_capability=parts[1] if len(parts) > 1 else "",
                   sm_clock_mhz=number(2), memory_clock_mhz=number(3), memory_mb=int(number(4)), source="nvidia-smi")


@functools.lru_cache(maxsize=1)
def gpu_spec() -> GpuSpec | None:
    """The first GPU's spec (the driver's, else ``nvidia-smi``'s), None without a GPU."""
    spec = _from_driver() or _from_nvidia_smi()
    if spec is not None:
        log.debug("GPU: %s (from the %s)", spec.describe(), spec.source)
    return spec
