"""Short op chains whose cost depends on the neighbours: ONNX Runtime may fuse them on CUDA.

A node's time measured alone is not its time inside a chain that ONNX Runtime's graph optimizer
fuses into one kernel (a bias Add becomes a GEMM epilogue, an Add before LayerNormalization
becomes SkipLayerNormalization, a Relu after a Conv becomes FusedConv, ...), and the fusion only
happens when the chain runs in one precision: a Cast between two members breaks it.

Patterns (:data:`PATTERNS`): ``matmul_bias`` (MatMul by a weight -> Add of a bias), ``bias_gelu``
(Add of a bias -> erf GELU as exported by torch: Div, Erf, Add, Mul, Mul), ``add_layernorm``
(Add of two activations -> LayerNormalization), ``conv_relu`` (Conv -> Relu) and
``conv_add_relu`` (Conv -> Add of a residual -> Relu).

The harness (``onnxcampo costdb measure``) times each chain as one model and each of its nodes
alone, at shapes of BERT, GPT-2 and ResNet, in fp32 and fp16 (sample field ``chain``). The fit
stores, per pattern and precision, the median ratio ``chain time / sum of the parts' times``
(:func:`fit_chains`). The optimizer finds the patterns in a graph
(:func:`onnxcampo.patterns.fusion_chains`) and scales the members' times by the ratio when all
members run in the same precision (:func:`onnxcampo.estimate.node_time`).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

TIME_FLOOR_US = 0.5  # as onnxcampo.costdb.fit
PATTERNS = ("matmul_bias", "bias_gelu", "add_layernorm", "conv_relu", "conv_add_relu")
_OPSET = 17
_IR = 8


@dataclass(frozen=True)
class ChainCase:
    pattern: str
    dims: tuple[int, ...]

    @property
    def key(self) -> str:
        return f"chain:{self.pattern}|dims={'x'.join(map(str, self.dims))}"


def chain_cases() -> list[ChainCase]:
    """Shapes of BERT-base (b32 s128), GPT-2 small (b8 s256), the bundled MLP and ResNet-50."""
    cases = []
    for rows, k, n in [(32 * 128, 768, 768), (32 * 128, 768, 3072), (32 * 128, 3072, 768), (8 * 256, 768, 2304),
                       (16384, 256, 900), (4096, 1023, 1001), (512, 768, 768)]:
        cases.append(ChainCase("matmul_bias", (rows, k, n)))
    for rows, n in [(32 * 128, 3072), (8 * 256, 3072), (16384, 900), (512, 3072), (4096, 1001)]:
        cases.append(ChainCase("bias_gelu", (rows, n)))
    for rows, n in [(32 * 128, 768), (8 * 256, 768), (512, 768), (16384, 256), (4096, 1024)]:
        cases.append(ChainCase("add_layernorm", (rows, n)))
    for batch, c_in, size, c_out, kernel in [(32, 64, 56, 64, 3), (32, 64, 56, 256, 1), (32, 128, 28, 128, 3),
                                             (32, 256, 14, 256, 3), (32, 512, 7, 512, 3), (8, 3, 224, 64, 7)]:
        for pattern in ("conv_relu", "conv_add_relu"):
            cases.append(ChainCase(pattern, (batch, c_in, size, c_out, kernel)))
    return cases


@dataclass
class ChainGraph:
    """Nodes of one chain; ``inputs`` are fed at run time, ``weights`` are initializers."""

    nodes: list[onnx.NodeProto]
    inputs: dict[str, tuple[int, ...]]
    weights: dict[str, tuple[int, ...]]
    scalars: dict[str, float]


def chain_graph(case: ChainCase) -> ChainGraph:
    make = helper.make_node
    if case.pattern == "matmul_bias":
        rows, k, n = case.dims
        return ChainGraph([make("MatMul", ["x", "w"], ["mm"], name="matmul"),
                           make("Add", ["mm", "bias"], ["out"], name="bias")],
                          {"x": (rows, k)}, {"w": (k, n), "bias": (n,)}, {})
    if case.pattern == "bias_gelu":
        rows, n = case.dims
        return ChainGraph([make("Add", ["x", "bias"], ["h"], name="bias"),
                           make("Div", ["h", "sqrt2"], ["scaled"], name="gelu/div"),
                           make("Erf", ["scaled"], ["erf"], name="gelu/erf"),
                           make("Add", ["erf", "one"], ["erf1"], name="gelu/add"),
                           make("Mul", ["h", "erf1"], ["prod"], name="gelu/mul"),
                           make("Mul", ["prod", "half"], ["out"], name="gelu/half")],
                          {"x": (rows, n)}, {"bias": (n,)}, {"sqrt2": 2 ** 0.5, "one": 1.0, "half": 0.5})
    if case.pattern == "add_layernorm":
        rows, n = case.dims
        return ChainGraph([make("Add", ["x", "residual"], ["sum"], name="residual"),
                           make("LayerNormalization", ["sum", "scale", "shift"], ["out"], name="norm", axis=-1)],
                          {"x": (rows, n), "residual": (rows, n)}, {"scale": (n,), "shift": (n,)}, {})
    if case.pattern in ("conv_relu", "conv_add_relu"):
        batch, c_in, size, c_out, kernel = case.dims
        stride = 2 if kernel == 7 else 1
        out_size = (size + 2 * (kernel // 2) - kernel) // stride + 1
        conv = make("Conv", ["x", "w", "b"], ["conv"], name="conv", pads=[kernel // 2] * 4,
                    strides=[stride, stride], kernel_shape=[kernel, kernel])
        inputs = {"x": (batch, c_in, size, size)}
        weights = {"w": (c_out, c_in, kernel, kernel), "b": (c_out,)}
        if case.pattern == "conv_relu":
            return ChainGraph([conv, make("Relu", ["conv"], ["out"], name="relu")], inputs, weights, {})
        inputs["residual"] = (batch, c_out, out_size, out_size)
        return ChainGraph([conv, make("Add", ["conv", "residual"], ["sum"], name="residual"),
                           make("Relu", ["sum"], ["out"], name="relu")], inputs, weights, {})
    raise ValueError(f"unknown chain pattern {case.pattern!r}")


def _model(nodes, inputs, weights, scalars, outputs, elem, values) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    np_dtype = np.float16 if elem == TensorProto.FLOAT16 else np.float32
    initializers = [numpy_helper.from_array(values(shape, np_dtype), name) for name, shape in weights.items()]
    initializers += [numpy_helper.from_array(np.array(value, np_dtype), name) for name, value in scalars.items()]
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info(n, elem, list(s)) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, elem, list(s)) for n, s in outputs.items()], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)], ir_version=_IR)
    return model, {name: values(shape, np_dtype) for name, shape in inputs.items()}


def build_chain(case: ChainCase, precision: str, values) -> tuple[
        tuple[onnx.ModelProto, dict], list[tuple[str, onnx.ModelProto, dict]]]:
    """The chain's model and one single-node model per member (op type, model, feeds).

    ``values(shape, dtype)`` makes input data (the harness's positive, denormal-free values).
    """
    elem = TensorProto.FLOAT16 if precision == "fp16" else TensorProto.FLOAT
    chain = chain_graph(case)
    shapes = _tensor_shapes(chain)
    whole = _model(chain.nodes, chain.inputs, chain.weights, chain.scalars,
                   {"out": shapes["out"]}, elem, values)
    parts = []
    for node in chain.nodes:
        inputs = {t: shapes[t] for t in node.input if t not in chain.weights and t not in chain.scalars}
        weights = {t: chain.weights[t] for t in node.input if t in chain.weights}
        scalars = {t: chain.scalars[t] for t in node.input if t in chain.scalars}
        parts.append((node.op_type, *_model([node], inputs, weights, scalars,
                                            {node.output[0]: shapes[node.output[0]]}, elem, values)))
    return whole, parts


def _tensor_shapes(chain: ChainGraph) -> dict[str, tuple[int, ...]]:
    typed = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s))
             for n, s in (*chain.inputs.items(), *chain.weights.items())]
    typed += [helper.make_tensor_value_info(n, TensorProto.FLOAT, []) for n in chain.scalars]
    graph = helper.make_graph(chain.nodes, "shapes", typed, [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)])
    inferred = onnx.shape_inference.infer_shapes(
        helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)], ir_version=_IR), strict_mode=True)
    shapes = {**chain.inputs, **chain.weights}
    for value in (*inferred.graph.value_info, *inferred.graph.output):
        shapes[value.name] = tuple(d.dim_value for d in value.type.tensor_type.shape.dim)
    return shapes


def fit_chains(rows: Iterable[dict]) -> dict:
    """Per pattern: ``{"fp32": ratio, "fp16": ratio, "samples": n, "ratios": {...}}`` where a
    ratio is the median over shapes of chain time / sum of its parts' times."""
    ratios: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        parts = row.get("parts_us") or []
        time = row.get("time_us")
        if not parts or not all(isinstance(t, (int, float)) for t in (time, *parts)):
            continue
        # the fit's floor: tiny kernel times minus a baseline can come out near zero
        total = sum(max(t, TIME_FLOOR_US) for t in parts)
        ratios[row["chain"]][row["precision"]].append(max(time, TIME_FLOOR_US) / total)
    fitted = {}
    for pattern, by_precision in sorted(ratios.items()):
        entry = {precision: round(statistics.median(values), 4) for precision, values in sorted(by_precision.items())}
        entry["samples"] = sum(len(v) for v in by_precision.values())
        entry["range"] = {p: [round(min(v), 3), round(max(v), 3)] for p, v in sorted(by_precision.items())}
        fitted[pattern] = entry
    return fitted


__all__ = ["PATTERNS", "ChainCase", "build_chain", "chain_cases", "chain_graph", "fit_chains"]
