"""Shared graph builders, a fake cost model and context helpers for the pass tests.

Every graph is ONNX IR 10, opset 17. Pass tests build a :class:`GraphContext` exactly as
``onnxcampo.api.optimize`` does (read_model -> name_nodes -> infer_tensor_info ->
GraphContext.build) and run passes with a fresh :class:`PrecisionPlan`, so each test states the
cost policy it relies on through :class:`FakeCost`.
"""

from __future__ import annotations

import copy
import ctypes
from collections import Counter

import numpy as np
import onnx
import onnx.parser
from onnx import TensorProto, helper, numpy_helper
from onnxcampo.costdb.features import OpFeatures
from onnxcampo.costdb.model import CostModel
from onnxcampo.passes.manager import PassManager

from onnxcampo import ir
from onnxcampo.config import OptimizeConfig
from onnxcampo.context import GraphContext, Planning
from onnxcampo.plan import Precision, PrecisionPlan

FLOAT, FLOAT16 = TensorProto.FLOAT, TensorProto.FLOAT16
HEADER = '<ir_version: 10, opset_import: ["" : 17]>'


# --- models -------------------------------------------------------------------------------
def parse(text: str, *, header: str = HEADER) -> onnx.ModelProto:
    """An ONNX-text graph (``name (inputs) => (outputs) <initializers> { ... }``) as a model."""
    model = onnx.parser.parse_model(f"{header}\n{text}")
    onnx.checker.check_model(model, full_check=True)
    return model


def make_model(nodes, inputs, outputs, initializers=(), *, value_info=(), opsets=None) -> onnx.ModelProto:
    graph = helper.make_graph(list(nodes), "g", list(inputs), list(outputs), list(initializers),
                              value_info=list(value_info))
    opsets = opsets or [helper.make_opsetid("", 17)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    return model


def tensor_vi(name: str, shape, dtype: int = FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def init(name: str, array) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array), name)


def weight(name: str, shape, *, seed: int = 0, scale: float = 0.1) -> onnx.TensorProto:
    rng = np.random.default_rng(seed)
    return init(name, (rng.standard_normal(shape) * scale).astype(np.float32))


# --- a fake cost model ----------------------------------------------------------------------
class FakeCost(CostModel):
    """Fixed times that make each test's policy explicit.

    * fp32 time of a node: ``op_us[op_type]`` if given, else ``default_us``;
    * fp16 time: fp32 / ``op_speedup[op_type]`` if given, else fp32 / ``speedup`` when the op
      is no GEMM or its dims are Tensor Core aligned, fp32 / ``unaligned_speedup`` for an
      unaligned GEMM (default: the same as ``speedup``);
    * one Cast: ``cast_us`` whatever its size; one Pad or Slice: ``pad_us``.
    """

    name = "fake"

    def __init__(self, *, speedup: float = 2.0, cast_us: float = 1.0, pad_us: float = 1.0,
                 default_us: float = 10.0, op_us: dict[str, float] | None = None,
                 unaligned_speedup: float | None = None, op_speedup: dict[str, float] | None = None) -> None:
        self.speedup = speedup
        self.unaligned_speedup = speedup if unaligned_speedup is None else unaligned_speedup
        self.cast_us = cast_us
        self.pad_us = pad_us
        self.default_us = default_us
        self.op_us = dict(op_us or {})
        self.op_speedup = dict(op_speedup or {})

    def fp32_time(self, features: OpFeatures) -> float:
        return self.op_us.get(features.op_type, self.default_us)

    def fp16_time(self, features: OpFeatures, fp32_time: float) -> float:
        if features.op_type in self.op_speedup:
            return fp32_time / self.op_speedup[features.op_type]
        if features.is_gemm and not features.tensor_core_aligned:
            return fp32_time / self.unaligned_speedup
        return fp32_time / self.speedup

    def cast_time(self, elements: int) -> float:
        return self.cast_us

    def pad_time(self, elements: int, kind: str = "Pad") -> float:
        return self.pad_us


# --- contexts -------------------------------------------------------------------------------
def build_context(model: onnx.ModelProto, *, cost: CostModel | None = None,
                  config: OptimizeConfig | None = None, **options) -> Planning:
    """The context ``optimize`` builds, as the passes see it: a Planning with a fresh plan (the input
    model is not modified)."""
    config = (config or OptimizeConfig()).replace(**options) if options else (config or OptimizeConfig())
    working, source = ir.read_model(model)
    ir.name_nodes(working)
    info, unresolved = ir.infer_tensor_info(
        working, input_shapes=config.input_shapes, dim_values=config.dim_values, require_static=False
    )
    ctx = GraphContext.build(working, source, config, cost or FakeCost(), info, unresolved)
    return Planning(ctx, PrecisionPlan())


def run_passes(ctx: GraphContext, *passes, check_invariants: bool = True):
    manager = PassManager(passes, check_invariants=check_invariants)
    manager.run(ctx)
    return manager.results


def precisions(ctx: GraphContext) -> dict[str, str]:
    """Node name -> "fp16" / "fp32" for every decided node."""
    return {name: d.precision.value for name, d in ctx.plan.items()}


def reasons(ctx: GraphContext) -> dict[str, str]:
    """Node name -> Reason name for every decided node."""
    return {name: d.reason.name for name, d in ctx.plan.items()}


def decide(ctx: GraphContext, **precisions_by_node: str) -> None:
    """Pre-decide nodes as a previous pass would (``decide(ctx, mm="fp16")``)."""
    from onnxcampo.plan import Reason

    for node, value in precisions_by_node.items():
        precision = Precision(value)
        reason = Reason.POLICY_FP16 if precision is Precision.FP16 else Reason.POLICY_FP32
        ctx.plan.decide(node, precision, reason)


def export(ctx: GraphContext) -> onnx.ModelProto:
    """The context's current graph as a model (as ``optimize`` exports it)."""
    return ir.export_model(ctx.graph.copy(), ctx.model, ctx.dtypes, {})


# --- inspecting results ---------------------------------------------------------------------
def ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def op_counts(model: onnx.ModelProto) -> Counter:
    return Counter(ops(model))


def node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    found = [n for n in model.graph.node if n.name == name]
    assert len(found) == 1, f"no single node {name!r} in {[n.name for n in model.graph.node]}"
    return found[0]


def producer(model: onnx.ModelProto, tensor: str) -> onnx.NodeProto | None:
    for n in model.graph.node:
        if tensor in n.output:
            return n
    return None


def consumers(model: onnx.ModelProto, tensor: str) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if tensor in n.input]


def casts(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "Cast"]


def cast_to(node_proto: onnx.NodeProto) -> int:
    return next(a.i for a in node_proto.attribute if a.name == "to")


def elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor after ONNX shape inference (initializers included)."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    g = inferred.graph
    types = {t.name: t.data_type for t in g.initializer}
    for vi in (*g.input, *g.value_info, *g.output):
        types[vi.name] = vi.type.tensor_type.elem_type
    for n in g.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    types[n.output[0]] = a.t.data_type
    return types


def io_types(model: onnx.ModelProto) -> dict[str, int]:
    inits = {t.name for t in model.graph.initializer}
    return {vi.name: vi.type.tensor_type.elem_type
            for vi in (*model.graph.input, *model.graph.output) if vi.name not in inits}


def initializer(model: onnx.ModelProto, name: str) -> np.ndarray:
    for t in model.graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    raise KeyError(name)


def cast_round_trips(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """(first, second) Cast pairs where the second casts back to the first's source dtype."""
    types = elem_types(model)
    found = []
    for n in model.graph.node:
        if n.op_type != "Cast":
            continue
        up = producer(model, n.input[0])
        if up is not None and up.op_type == "Cast" and types.get(up.input[0]) == cast_to(n):
            found.append((up.name, n.name))
    return found


def reference_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Outputs from ONNX's reference evaluator: it computes fp16 ops in fp16 (unlike ORT CPU)."""
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, feeds)


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Outputs from ORT's CPU provider: a wiring check only (it runs most fp16 ops in fp32)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def copy_model(model: onnx.ModelProto) -> onnx.ModelProto:
    return copy.deepcopy(model)


# --- the graph rewrites (fuse_elementwise, fuse_reductions) -----------------------------------

def named_model(text: str, *, opset: int = 17) -> onnx.ModelProto:
    """An ONNX-text graph as an IR 8 model with every node named (``ir.name_nodes``), unchecked."""
    model = onnx.parser.parse_model(f'<ir_version: 8, opset_import: ["" : {opset}]>\n' + text)
    ir.name_nodes(model)
    return model


def add_ints(model: onnx.ModelProto, name: str, values) -> None:
    """Append an int64 initializer (axes, shapes) to ``model``."""
    model.graph.initializer.append(numpy_helper.from_array(np.array(values, np.int64), name))


def float16_sum_read_as_float32(rows: int, cols: int) -> onnx.ModelProto:
    """``z = Cast(ReduceSum(h, axis 0), float32)`` for a float16 ``h`` of ``[rows, cols]``: the
    unfused graph rounds the sum to float16 first, a fused BlockReduceSum writes the float32 sum."""
    model = named_model(f"""
    g (float16[{rows},{cols}] h) => (float[{cols}] z) {{
      t = ReduceSum <keepdims = 0> (h, axes)
      z = Cast <to = 1> (t)
    }}""")
    add_ints(model, "axes", [0])
    return model


def fused_outputs(model: onnx.ModelProto, fuse, feeds: dict[str, np.ndarray], new_ops):
    """``fuse`` (a rewrite that edits a model in place and returns its result) run on a copy of
    ``model``, the copy checked; returns the copy, the result, and the outputs of ``model`` and of
    the copy on onnx's reference evaluator (``new_ops``: the reference ops of the custom ops)."""
    from onnx.reference import ReferenceEvaluator

    want = ReferenceEvaluator(model).run(None, feeds)
    fused = copy_model(model)
    result = fuse(fused)
    onnx.checker.check_model(fused)
    got = ReferenceEvaluator(fused, new_ops=new_ops).run(None, feeds)
    return fused, result, want, got


def fused_first_output_on_ort(model: onnx.ModelProto, fuse, feeds: dict[str, np.ndarray]):
    """``fuse`` run on a copy of ``model``; returns its result and the first output of ``model``
    and of the copy on ONNX Runtime (``make_session``'s default provider, the library loaded)."""
    from onnxcampo.runtime import make_session

    want = make_session(model).run(None, feeds)[0]
    fused = copy_model(model)
    result = fuse(fused)
    got = make_session(fused).run(None, feeds)[0]
    return result, want, got


# The fp16 bias + erf GELU of a campo plan with Casts at its edges: x float32, bias float16 (and the
# float16 scalars s, one and half), y float32.
BIAS_GELU_CHAIN = """
      h = Cast <to = 10> (x)
      a = Add(h, bias)
      u = Mul(a, s)
      e = Erf(u)
      p = Add(e, one)
      m = Mul(a, half)
      g16 = Mul(m, p)
      y = Cast <to = 1> (g16)"""


# An 8x8 weight of 0.125s, and the chain most pass tests start from.
W_INIT = "float[8,8] w = {" + ",".join(["0.125"] * 64) + "}"

# MatMul -> Add -> Relu -> MatMul: two allow-list ops joined by infer/clear ops.
MM_ADD_RELU_MM = f"""
g (float[4,8] x) => (float[4,8] y) <{W_INIT}, float[8] b = {{1,2,3,4,5,6,7,8}}> {{
  [mm1] a = MatMul(x, w)
  [add] s = Add(a, b)
  [relu] r = Relu(s)
  [mm2] y = MatMul(r, w)
}}
"""

# An Exp (deny list) feeding the Add between two MatMuls.
EXP_BETWEEN_MATMULS = f"""
g (float[4,8] x) => (float[4,8] y) <{W_INIT}> {{
  [mm1] a = MatMul(x, w)
  [exp] e = Exp(x)
  [add] s = Add(a, e)
  [mm2] y = MatMul(s, w)
}}
"""


# --- training steps --------------------------------------------------------------------------

def step_feeds(step: onnx.ModelProto, batch: dict[str, np.ndarray], *, lr: float) -> dict[str, np.ndarray]:
    """Feeds for a training step graph: ``batch`` as given, each weight its starting value (its
    ``onnxcampo.initial/<name>`` initializer), ``lr``, a loss scale of 1024 (mixed-precision
    steps) and zeros for the rest (the optimizer's state)."""
    initial = {t.name: numpy_helper.to_array(t) for t in step.graph.initializer}
    feeds = dict(batch)
    for value in step.graph.input:
        name = value.name
        if name in feeds:
            continue
        if f"onnxcampo.initial/{name}" in initial:
            feeds[name] = initial[f"onnxcampo.initial/{name}"]
        elif name == "lr":
            feeds[name] = np.array(lr, np.float32)
        elif name == "loss_scale":
            feeds[name] = np.array(1024.0, np.float32)
        else:
            dims = [d.dim_value for d in value.type.tensor_type.shape.dim]
            feeds[name] = np.zeros(dims, helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type))
    return feeds


# --- device batches --------------------------------------------------------------------------

class DLPackOnly:
    """A tensor or array seen through DLPack alone (``__dlpack__`` and ``__dlpack_device__``):
    host memory as a torch CPU tensor shows itself, or CUDA memory read by OrtValue.from_dlpack."""

    def __init__(self, tensor):
        self._tensor = tensor

    def __dlpack__(self, **options):
        return self._tensor.__dlpack__(**options)

    def __dlpack_device__(self):
        return self._tensor.__dlpack_device__()


# --- the command line -----------------------------------------------------------------------

def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``onnxcampo.cli.main(argv)`` in this process: its exit code, stdout and stderr."""
    from onnxcampo.cli import main

    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str, *fragments: str) -> str:
    """Assert that stderr is one ``onnxcampo: error:`` line holding every fragment, no traceback;
    return the line."""
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1, err
    assert lines[0].startswith("onnxcampo: error:") and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


# a bias gradient: the column sums of an elementwise chain's output (fusion costing and A/B tests)
BIAS_GRADIENT = """
g (float[64,32] x, float[64,32] dy, float[32,32] w) => (float[64,32] dx, float[32] db) {
  [mul] m = Mul(x, dy)
  [tanh] g = Tanh(m)
  [mm] dx = MatMul(g, w)
  [axes] axes = Constant <value = int64[1] {0}> ()
  [sum] db = ReduceSum <keepdims = 0> (g, axes)
}
"""


FAKE_STREAM, FAKE_EVENT = 0x5170, 0xE7


class FakeRuntime:
    """The CUDA runtime calls StepQueue makes, on host memory: copies at once, waits recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self._blocks: list[ctypes.Array] = []

    def create_stream(self) -> int:
        return FAKE_STREAM

    def create_event(self) -> int:
        return FAKE_EVENT

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        assert stream == FAKE_STREAM, "every copy goes on the queue's stream"
        ctypes.memmove(dst, src, nbytes)
        self.calls.append(("copy", nbytes))

    def synchronize(self, stream=0) -> None:
        self.calls.append(("synchronize", stream))

    def wait(self, stream: int, after: int, event: int) -> None:
        self.calls.append(("wait", stream, after))

    def host_alloc(self, nbytes: int) -> int:
        block = ctypes.create_string_buffer(nbytes)
        self._blocks.append(block)
        return ctypes.addressof(block)

    def host_free(self, pointer: int) -> None:
        self.calls.append(("free", pointer))

    def syncs(self) -> int:
        return sum(call[0] == "synchronize" for call in self.calls)
