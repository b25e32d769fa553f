"""How the benchmark measures: timed blocks, output error, node counts, the share of GEMM/Conv
time that is Tensor-Core eligible, training steps, and where a training step's time goes.

Timing follows ``../shared/device/README.md``: inputs copied to the device once and bound
(IO binding), outputs allocated by the first run and bound for the later ones, warm-up runs, then
the median over timed blocks of the mean time per run in the block. TF32 is a session option
(``use_tf32``), so fp32 is measured both ways. Sessions come from
:func:`onnxcampo.runtime.make_session` and inference runs through
:class:`onnxcampo.runtime.timing.BoundRunner`; outputs are compared by
:mod:`onnxcampo.runtime.compare`. What stays here is the benchmark's own: the training step's
runner, profiles and their breakdown.
"""

from __future__ import annotations

import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from onnxcampo import ir
from onnxcampo import runtime
from onnxcampo.runtime import trace
from onnxcampo.accuracy import evaluate
from onnxcampo.runtime.compare import check_outputs, worst_error
from onnxcampo.runtime.timing import BoundRunner, time_block
from onnxcampo.training.evaluate import training_mode
from onnxcampo.training.scaling import initial_state
from onnxcampo.training.step import LOSS, LR, UPDATED, step_spec
from onnxcampo.training.train_mode import TRAIN_FLAG
from onnxcampo.training.trainer import make_queue

ORT_LOG = 3  # ORT's log severity in benchmark sessions: errors only (its warnings about unused initializers flood the log)


class MeasureError(RuntimeError):
    """A variant that cannot be measured (it fails to run, non-finite output or loss)."""


def _short(exc: BaseException, limit: int = 400) -> str:
    text = f"{exc.__class__.__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + " ..."


def bound(model: str | Path, feeds: Mapping[str, np.ndarray], *, provider: str, tf32: bool = True,
          cuda_graph: bool = False, cuda_options: Mapping[str, str] | None = None,
          session_config: Mapping[str, str] | None = None) -> BoundRunner:
    """A session of ``model`` run through IO binding: :func:`onnxcampo.runtime.make_session` with
    ``use_tf32`` as asked, with ``cuda_graph`` ORT's capture and replay, ``cuda_options`` (more
    CUDA EP options, e.g. ``{"prefer_nhwc": "1"}``) and ``session_config`` (``session.*``
    settings) on top; ORT logs errors only."""
    session = runtime.make_session(model, provider=provider, tf32=tf32, cuda_graph=cuda_graph,
                                   cuda_options=cuda_options, session_config=session_config, log_severity=ORT_LOG)
    return BoundRunner(session, feeds, provider, cuda_graph=cuda_graph)


def timed_blocks(step, *, warmup: int, blocks: int, per_block: int) -> list[float]:
    """Call ``step()`` ``warmup`` times, then ``blocks`` blocks of ``per_block`` calls; ms per call of each block."""
    for _ in range(warmup):
        step()
    return [time_block(step, per_block) for _ in range(blocks)]


def output_error(reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray]) -> dict[str, float]:
    """A row's accuracy, all from :mod:`onnxcampo.runtime.compare`: ``rel_err_max`` and
    ``rel_err_mean``, the worst over the float outputs of max|c - r| / max|r| and of
    mean|c - r| / mean|r| (what the report judges; integer outputs: the share of elements that
    differ), and ``output_error``, the one criterion of ``--validate``, ``--tune`` and
    ``onnxcampo bench`` (relative L2, :func:`~onnxcampo.runtime.compare.worst_error`); from
    :mod:`onnxcampo.accuracy`: ``accurate`` (the default criterion's verdict, ``criterion``),
    ``max_abs_err`` and ``p99_rel_err`` (the worst over the float outputs).

    A missing output, a changed shape, or non-finite values where the reference is finite raise
    MeasureError (a NaN or overflow is a failed conversion, not a large error).
    """
    worst_max, worst_mean = 0.0, 0.0
    for check in check_outputs(reference, candidate):
        if check.error is not None and not np.isfinite(check.error):
            raise MeasureError(f"output {check.name}: {check.note or 'non-finite values (fp16 overflow?)'}")
        if check.measure == "mismatch":
            worst_max = max(worst_max, check.error or 0.0)  # share of differing ints
            continue
        worst_max = max(worst_max, check.diff.scaled_max_err)
        worst_mean = max(worst_mean, check.diff.scaled_mean_err)
    verdict = evaluate(reference, candidate)
    return {"rel_err_max": worst_max, "rel_err_mean": worst_mean, "output_error": worst_error(reference, candidate),
            "accurate": verdict.ok, "criterion": str(verdict.criterion),
            "max_abs_err": verdict.worst("max_abs"), "p99_rel_err": verdict.worst("p99_rel")}


def node_counts(model: onnx.ModelProto) -> dict[str, int]:
    """Cast and Pad nodes (subgraphs included) and all nodes of a model."""
    counts: Counter = Counter()

    def walk(graph):
        for node in graph.node:
            counts[node.op_type] += 1
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g)
                for g in attr.graphs:
                    walk(g)
    walk(model.graph)
    return {"casts": counts["Cast"], "pads": counts["Pad"], "nodes": sum(counts.values())}


# --------------------------------------------------------------------------------------------
# ORT profiler traces
# --------------------------------------------------------------------------------------------

GEMM_OPS = frozenset({"MatMul", "Gemm", "FusedGemm", "FusedMatMul", "Conv", "FusedConv", "ConvTranspose",
                      "Attention", "MultiHeadAttention", "GroupQueryAttention", "MatMulInteger", "ConvInteger"})
_HALF = frozenset({"float16", "bfloat16"})
_CONV_OPS = frozenset({"Conv", "FusedConv", "ConvTranspose", "ConvInteger"})


def kernel_events(profile: str | Path | list, *, skip_runs: int = 1) -> tuple[list[dict[str, Any]], int]:
    """Kernel events of the runs after the first ``skip_runs`` (warm-up), and how many runs that is.

    ORT writes an event when it ends, so runs are found by time window (the Session/model_run
    events), not by file order.
    """
    events = trace.read_events(profile)
    windows = trace.run_windows(events)
    kept = windows[skip_runs:]
    if not kept:
        raise MeasureError(f"the profile has {len(windows)} runs, none left after skipping {skip_runs}")
    kernels = [e for e in events
               if trace.is_kernel_event(e) and any(start <= int(e["ts"]) <= end for start, end in kept)]
    return kernels, len(kept)


def first_shape(entries) -> tuple[str, list[int]] | None:
    """(dtype, shape) of the first entry of a profiler event's ``input_type_shape``/``output_type_shape``."""
    for entry in entries or ():
        for dtype, shape in entry.items():
            return dtype, list(shape)
    return None


def tensor_core_eligible(op: str, inputs, outputs) -> bool:
    """fp16/bf16 GEMM or Conv whose K and N (channels in and out) are multiples of 8.

    The rule of ``costdb/features.py`` (``tensor_core_aligned``): M is no row stride and does not
    matter.

    Read from the profiler's ``input_type_shape``/``output_type_shape`` of the first input and
    output: ORT does not list prepacked weights, so K is the activation's last dim and N the
    output's last dim (GEMMs), channels are dim 1 of input and output (Conv). Attention ops count
    when fp16 with a hidden size that is a multiple of 8.
    """
    first_in, first_out = first_shape(inputs), first_shape(outputs)
    if first_in is None or first_out is None:
        return False
    dtype, x = first_in
    _, y = first_out
    if dtype not in _HALF:
        return False
    if op in _CONV_OPS:
        return len(x) > 1 and len(y) > 1 and x[1] % 8 == 0 and y[1] % 8 == 0
    if not x or not y:
        return False
    return x[-1] % 8 == 0 and y[-1] % 8 == 0


def tensor_core_share(profile: str | Path | list, *, skip_runs: int = 1) -> dict[str, float]:
    """GEMM/Conv kernel time as a share of all kernel time, and the Tensor-Core-eligible share of it."""
    events, runs = kernel_events(profile, skip_runs=skip_runs)
    total = gemm = eligible = 0.0
    gemm_nodes, eligible_nodes = set(), set()
    for e in events:
        dur = float(e.get("dur", 0))
        total += dur
        args = e.get("args", {})
        op = args.get("op_name", "")
        if op in GEMM_OPS:
            gemm += dur
            gemm_nodes.add(e["name"])
            if tensor_core_eligible(op, args.get("input_type_shape"), args.get("output_type_shape")):
                eligible += dur
                eligible_nodes.add(e["name"])
    return {
        "kernel_us_per_run": total / runs,
        "gemm_share": gemm / total if total else 0.0,
        "tc_share_of_gemm": eligible / gemm if gemm else 0.0,
        "gemm_nodes": len(gemm_nodes),
        "tc_nodes": len(eligible_nodes),
    }


def profile_runs(model: str | Path, feeds: Mapping[str, np.ndarray], *, provider: str, directory: Path,
                 runs: int = 10, optimization: str = "all", tf32: bool = True) -> str:
    """Run ``model`` 1 + ``runs`` times under ORT's profiler; the trace's path (first run = warm-up)."""
    session = runtime.make_session(model, provider=provider, tf32=tf32, profiling=True, optimization_level=optimization,
                                   profile_file_prefix=str(directory / "ort_profile"), log_severity=ORT_LOG)
    runner = BoundRunner(session, feeds, provider)
    for _ in range(1 + runs):
        runner()
    return session.end_profiling()


# --------------------------------------------------------------------------------------------
# training steps
# --------------------------------------------------------------------------------------------


class StepRunner:
    """Runs a training-step graph step after step, like ``onnxcampo.training.Trainer``.

    Same binding scheme as the Trainer (weights and optimizer state in two device buffer sets,
    swapped every step; the loss is the one value copied back), with two differences a benchmark
    needs: the batch is copied to the device once and stays bound (the PyTorch baselines keep
    theirs on the GPU too), and the session options are the benchmark's (TF32 on or off,
    profiling, optimization level, CUDA EP options) where the Trainer takes the defaults; both
    sessions come from :func:`onnxcampo.runtime.make_session`, so ``use_tf32`` and
    ``enable_cuda_graph`` are set the same way. ``tests/test_bench.py`` checks that it computes
    the Trainer's losses.
    """

    def __init__(self, step_path: str | Path, *, weights: Mapping[str, np.ndarray], batch: Mapping[str, np.ndarray],
                 provider: str, lr: float | None = None, tf32: bool = True, profiling: bool = False,
                 profile_prefix: str | None = None, optimization: str = "all",
                 model: onnx.ModelProto | None = None, cuda_graph: bool = False,
                 cuda_options: Mapping[str, str] | None = None, session_config: Mapping[str, str] | None = None,
                 read_every: int = 1) -> None:
        # ``cuda_graph``: each of the two bindings is captured into its own CUDA graph (run option
        # gpu_graph_id) and replayed; the loss then stays on the device and is copied back after
        # ``model``: the step graph already loaded (a caller that has it saves reading it again)
        # ``read_every``: on CUDA, steps queue as the Trainer's do (onnxcampo.training.queue) and the
        # loss is read every ``read_every`` steps (a call returns None in between); 1: every step,
        # each waited for. ``sync()`` waits for the queued steps.
        model = model if model is not None else onnx.load(str(step_path), load_external_data=False)
        self.spec = step_spec(model)
        self.device = "cuda" if provider == "cuda" else "cpu"
        lr = lr if lr is not None else float(ir.metadata(model, "onnxcampo.lr", "0.01"))
        shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
        starts = initial_state(model)
        stepping = step_path
        if any(t.name == TRAIN_FLAG for t in model.graph.initializer):  # as the Trainer's session: switches resolved
            stepping = training_mode(model)  # a copy: the weights it left on disk are read into it, not the caller's
            onnx.load_external_data_for_model(stepping, str(Path(step_path).parent))
        del model
        self.read_every = max(1, int(read_every))
        # the Trainer's queue (on CUDA under CUDA graphs) when the loss is read less often than every step
        self._queue = make_queue(provider, None if self.read_every > 1 else False, cuda_graph)
        if self._queue is not None:
            self._queue.keep(self)  # the session goes after the steps queued on it
        if self._queue is not None and provider == "cuda":
            cuda_options = {**(cuda_options or {}), "user_compute_stream": str(self._queue.stream)}
        self.session = runtime.make_session(stepping, provider=provider, tf32=tf32, profiling=profiling,
                                            profile_file_prefix=profile_prefix, optimization_level=optimization,
                                            cuda_graph=cuda_graph, cuda_options=cuda_options,
                                            session_config=session_config, log_severity=ORT_LOG)
        # copies: on CPU the buffers are updated in place, which must not change the caller's arrays
        initial = {name: np.array(weights[name], dtype=np.float32, order="C", copy=True) for name in self.spec.weights}
        for name in self.spec.state:
            initial[name] = np.full(shapes[name], starts.get(name, 0.0), np.float32)
        self._arrays: list[np.ndarray] = []  # on CPU an OrtValue borrows its numpy buffer: keep them alive

        def put(array: np.ndarray) -> ort.OrtValue:
            self._arrays.append(array)
            return ort.OrtValue.ortvalue_from_numpy(array, self.device, 0)
        self._buffers = [{n: put(v) for n, v in initial.items()}, {n: put(np.empty_like(v)) for n, v in initial.items()}]
        missing = sorted(set(self.spec.batch) - set(batch))
        if missing:
            raise MeasureError(f"batch lacks {missing}")
        # copies too: on CPU set_batch writes into the bound buffer, which must not be the caller's array
        self._batch = {name: put(np.array(batch[name], order="C", copy=True)) for name in self.spec.batch}
        self._batch_types = {name: (np.asarray(batch[name]).dtype, tuple(np.shape(batch[name]))) for name in self.spec.batch}
        self._lr = put(np.array(lr, np.float32))
        on_device = cuda_graph or self._queue is not None
        self._loss = ort.OrtValue.ortvalue_from_numpy(np.zeros((), np.float32), self.device if on_device else "cpu", 0)
        self._bindings = [self._binding(0), self._binding(1)]
        self._run_options = [ort.RunOptions(), ort.RunOptions()]
        if cuda_graph:
            for k, options in enumerate(self._run_options):
                options.add_run_config_entry("gpu_graph_id", str(k + 1))
        if self._queue is not None:
            self._queue.runtime.synchronize(None)  # the buffers' copies from the host, before the stream reads them
            for options in self._run_options:
                self._queue.run_options(options)
        self._current = 0
        self._losses: list = []  # floats, or the queue's Loss objects

    def _binding(self, current: int):
        binding = self.session.io_binding()
        for name, value in self._batch.items():
            binding.bind_ortvalue_input(name, value)
        binding.bind_ortvalue_input(LR, self._lr)
        source, target = self._buffers[current], self._buffers[1 - current]
        for name, value in source.items():
            binding.bind_ortvalue_input(name, value)
        for name, value in target.items():
            binding.bind_ortvalue_output(name + UPDATED, value)
        binding.bind_ortvalue_output(LOSS, self._loss)
        return binding

    def __call__(self) -> float | None:
        binding = self._bindings[self._current]
        try:
            self.session.run_with_iobinding(binding, self._run_options[self._current])
        except Exception as exc:  # noqa: BLE001
            raise MeasureError(f"ONNX Runtime failed to run the step: {_short(exc)}") from None
        self._current = 1 - self._current
        if self._queue is not None:
            loss = self._queue.loss(self._loss, len(self._losses) + 1)
            self._losses.append(loss)
            return float(loss) if len(self._losses) % self.read_every == 0 else None
        binding.synchronize_outputs()
        loss = float(self._loss.numpy())
        self._losses.append(loss)
        return loss

    def sync(self) -> None:
        """Wait for the queued steps (nothing to wait for when each step is waited for)."""
        if self._queue is not None:
            self._queue.drain()

    @property
    def losses(self) -> list[float]:
        """Every step's loss so far (waits for the queued steps)."""
        self.sync()
        return [float(loss) for loss in self._losses]

    def set_batch(self, batch: Mapping[str, np.ndarray]) -> None:
        """Copy ``batch`` into the bound batch buffers: the next steps train on it. Names, shapes
        and dtypes must be the first batch's; the bindings (and a captured CUDA graph, which reads
        those buffers) stay valid."""
        for name, value in self._batch.items():
            array = np.ascontiguousarray(batch[name])
            dtype, shape = self._batch_types[name]
            if array.shape != shape or array.dtype != dtype:
                raise MeasureError(f"batch {name} is {array.dtype}{list(array.shape)}, the bound one {dtype}{list(shape)}")
            if self._queue is not None:  # on the steps' stream: after the queued steps' reads
                self._queue.upload(value, array)
            else:
                value.update_inplace(array)

    def state(self, name: str) -> float | None:
        value = self._buffers[self._current].get(name)
        self.sync()
        return None if value is None else float(value.numpy().reshape(-1)[0])


# --------------------------------------------------------------------------------------------
# where a training step's time goes
# --------------------------------------------------------------------------------------------

CATEGORIES = ("forward", "loss", "backward", "update", "loss_scale", "cast", "pad", "memcpy")
_CAST_NAME = re.compile(r"/cast_fp(16|32)$")
_PAD_NAME = re.compile(r"/(pad_[a-z]+|slice_[a-z]+)$")
_LOSS_SCALE_NAME = re.compile(r"^(loss_scale(/|$)|found_inf$)")


def classify_node(name: str, op: str, *, forward: set[str], weights: tuple[str, ...], state: tuple[str, ...]) -> str:
    """The part of a training step a node belongs to, from its name (step graphs' conventions).

    In order: ``memcpy`` (ORT's Memcpy nodes); ``cast`` (onnxcampo's ``<tensor>/cast_fp16|fp32``
    and ORT's inserted casts); ``pad`` (``<node>/pad_k``, ``<node>/slice_n``); ``loss_scale``
    (``loss_scale/*``, ``found_inf``, the unscale ``<w>/grad`` and ``<w>/grad.*``, the
    skip-step ``Where`` named ``<w or state>.updated``); ``update`` (``update/*`` and
    ``<w>/...``: squeeze, momentum, Adam, the update itself); ``loss`` (``loss/*``);
    ``forward`` (a node name of the forward model); ``backward`` (the rest: onnx-ad's nodes).
    """
    if op.startswith("Memcpy") or name.startswith("Memcpy"):
        return "memcpy"
    if _CAST_NAME.search(name) or (op == "Cast" and "InsertedPrecisionFreeCast" in name):
        return "cast"
    if _PAD_NAME.search(name) and op in ("Pad", "Slice"):
        return "pad"
    if _LOSS_SCALE_NAME.search(name):
        return "loss_scale"
    if name.endswith(UPDATED) and name[: -len(UPDATED)] in set(weights) | set(state):
        return "loss_scale"
    owner = _owner(name, weights)
    if owner is not None:
        rest = name[len(owner) + 1:]
        if rest == "grad" or rest.startswith("grad."):
            return "loss_scale"
        return "update"
    if name.startswith("update/"):
        return "update"
    if name.startswith("loss/"):
        return "loss"
    if name in forward:
        return "forward"
    return "backward"


def _owner(name: str, weights) -> str | None:
    """The weight ``w`` for which ``name`` starts with ``w/`` (weight names may hold slashes)."""
    known = weights if isinstance(weights, (set, frozenset)) else set(weights)
    index = name.find("/")
    while index > 0:
        if name[:index] in known:
            return name[:index]
        index = name.find("/", index + 1)
    return None


def breakdown(profile_json: str | Path | list, step_model: onnx.ModelProto | str | Path,
              forward_model: onnx.ModelProto | str | Path, *, skip_runs: int = 1) -> dict[str, Any]:
    """Kernel time per step (us) split into :data:`CATEGORIES`, from an ORT profile of a step graph.

    Profile with graph optimizations off (``optimization="disable"``): fused nodes get new
    names that no longer say which part of the step they came from. Returns ``{"per_step_us":
    {category: us}, "share": {category: fraction}, "nodes": {category: count}, "steps": n,
    "top_backward": [(op, us), ...]}``.
    """
    def load(m):
        return m if isinstance(m, onnx.ModelProto) else onnx.load(str(m), load_external_data=False)

    step, forward = load(step_model), load(forward_model)
    spec = step_spec(step)
    forward_names = {n.name for n in forward.graph.node if n.name}
    events, runs = kernel_events(profile_json, skip_runs=skip_runs)
    per = defaultdict(float)
    nodes: dict[str, set] = defaultdict(set)
    backward_ops: Counter = Counter()
    for e in events:
        name = e["name"][: -len(trace.KERNEL_SUFFIX)]
        op = e.get("args", {}).get("op_name", "")
        part = classify_node(name, op, forward=forward_names, weights=spec.weights, state=spec.state)
        dur = float(e.get("dur", 0))
        per[part] += dur
        nodes[part].add(name)
        if part == "backward":
            backward_ops[op] += dur
    total = sum(per.values())
    return {
        "steps": runs,
        "per_step_us": {c: per[c] / runs for c in CATEGORIES},
        "share": {c: (per[c] / total if total else 0.0) for c in CATEGORIES},
        "nodes": {c: len(nodes[c]) for c in CATEGORIES},
        "total_us": total / runs,
        "top_backward": [(op, us / runs) for op, us in backward_ops.most_common(6)],
    }


def median(values) -> float:
    return float(statistics.median(values))


# --------------------------------------------------------------------------------------------
# GPU time per kernel (CUPTI, through torch.profiler)
# --------------------------------------------------------------------------------------------

# ORT's profiler times nodes on the host (onnxruntime-gpu ships without CUPTI); torch's profiler
# brings CUPTI and sees every kernel of the process, ORT's included. Kernels are put in classes by
# name; the first pattern that matches wins: ORT's Cast is an elementwise kernel templated on
# OP_Cast; cuDNN's BatchNorm, pooling and reductions come before its convolutions, and those
# (implicit-GEMM kernels name both) before the GEMMs; what else cuDNN runs is "cudnn-other".
KERNEL_CLASSES: tuple[tuple[str, str], ...] = (
    ("cast", r"Cast"),
    ("update", r"onnxcampo::|Sgd|AdamW|Unscale|multi_tensor|IsFinite|IsAllFinite|MixedPrecisionScale"),
    ("softmax", r"[Ss]oftmax"),
    ("norm", r"LayerNorm|layer_norm|BatchNorm|batch_norm|[Bb]n_fw|[Bb]n_bw"),
    ("pool", r"[Pp]ool"),
    ("reduce", r"[Rr]educ|cub::|[Aa]rg[Mm]ax"),
    ("conv", r"fprop|dgrad|wgrad|winograd|implicit_convolve|[Cc]onv(?!ert)"),
    ("gemm", r"gemm|gemv|cutlass|xmma|nvjet|cublas|[Mm]at[Mm]ul"),
    ("transpose", r"[Tt]ranspose|nchwToNhwc|nhwcToNchw"),
    ("copy", r"Slice|Concat|Gather|Scatter|Expand|Pad|Tile|Split|[Cc]opy|[Mm]emcpy|Fill"),
    ("memset", r"[Mm]emset"),
    ("elementwise", r"[Ee]lement[Ww]ise|Unary|Binary|Variadic|Relu|Gelu|Where|Sigmoid|Tanh|Erf|Clip|[Dd]ropout"),
    ("cudnn-other", r"cudnn"),
)
_KERNEL_CLASS_RE = [(name, re.compile(pattern)) for name, pattern in KERNEL_CLASSES]


def kernel_class(name: str) -> str:
    """The class of a GPU kernel by its (demangled) name: see :data:`KERNEL_CLASSES`; else ``other``."""
    return next((label for label, pattern in _KERNEL_CLASS_RE if pattern.search(name)), "other")


def cupti_kernels(fn, runs: int) -> list[tuple[str, float, float]] | None:
    """(kernel name, GPU ms per call of ``fn``, launches per call) for ``runs`` calls, largest first,
    as CUPTI sees them through ``torch.profiler`` (``onnxcampo.runtime.standalone.cuda_kernel_times``);
    None without torch or CUDA (or when the profiler API does not answer)."""
    from onnxcampo.runtime.standalone import cuda_kernel_times

    rows = cuda_kernel_times(fn, runs)
    return None if rows is None else [(name, us / 1e3, launches) for name, us, launches in rows]


def gpu_split(kernels: list[tuple[str, float, float]], *, top: int = 40) -> dict[str, Any]:
    """GPU ms per call in all and per kernel class, with the largest kernels (names cut to 120)."""
    by_class: dict[str, float] = defaultdict(float)
    launches: dict[str, float] = defaultdict(float)
    for name, ms, count in kernels:
        label = kernel_class(name)
        by_class[label] += ms
        launches[label] += count
    return {"total_ms": round(sum(ms for _, ms, _ in kernels), 4),
            "by_class_ms": {k: round(v, 4) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
            "launches": {k: round(v, 1) for k, v in launches.items()},
            "top": [(name[:120], round(ms, 4), round(count, 1)) for name, ms, count in kernels[:top]]}
