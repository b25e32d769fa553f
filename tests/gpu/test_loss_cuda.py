"""The row-wise loss and normalization ops on CUDA against their numpy references, and timed
against the unfused graphs of a training step (tests/gpu/conftest.py: skipped without a GPU):
``SoftmaxCrossEntropy`` and ``SoftmaxCrossEntropyGrad`` (``onnxcampo.ops.xent``),
``LayerNormGrad`` (``onnxcampo.ops.norm.layer_norm``) and ``SoftmaxGrad`` (``onnxcampo.ops.norm.softmax``).

1. Cross entropy: float32 and float16 logits and outputs, padded rows (``classes`` < width), the
   gradient written in padded rows (``output_columns``: zeros after the classes, as loss fusion
   rule 5 writes GPT-2's), labels counted from the end and out of range, one scale or one per
   row; class counts from 1 to 50257 (one warp to 1024 threads a row), plain and replayed.
   ``lse`` within 2e-6 relative, ``picked`` and ``dx`` within float32 rounding of the reference
   (float16 outputs: one float16 rounding).
2. LayerNormGrad: float32 and float16 tensors (mixed), with and without ``acc``, rows of 1 to
   4096 (one warp to 1024 threads a row), plain and replayed; dx within float32 rounding (float16
   outputs: one rounding, relative to the row's largest value). SoftmaxGrad likewise.
3. Timed side by side, plain and replayed: the fused pair against the unfused loss graph (Cast,
   LogSoftmax, OneHot, Mul, ReduceSum; Expand, Mul, ReduceSum, Exp, Mul, Sub) on GPT-2's float16
   logits [2048, 50257]; LayerNormGrad against the step graph's float16 backward (Mul, ReduceMean,
   Sub, Mul, ReduceMean, Mul, Sub, Mul, Sum) on BERT-base's [4096, 768]; SoftmaxGrad against Mul,
   ReduceSum, Sub, Mul, Mul on GPT-2's attention [8 * 12 * 256, 256].
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxcampo.ops import xent as ce
from onnxcampo.ops.norm import layer_norm as ln
from onnxcampo.ops import nodes
from onnxcampo.ops.norm import softmax as sm

F32, F16 = TensorProto.FLOAT, TensorProto.FLOAT16
NUMPY = {F32: np.float32, F16: np.float16}
NAME = {F32: "f32", F16: "f16"}


def _model(graph_nodes, inputs: dict, outputs: dict, initializers=()) -> onnx.ModelProto:
    """inputs / outputs: name -> (ONNX type, shape)."""
    graph = helper.make_graph(graph_nodes, "g", [helper.make_tensor_value_info(k, t, s) for k, (t, s) in inputs.items()],
                              [helper.make_tensor_value_info(k, t, s) for k, (t, s) in outputs.items()], list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    nodes.import_domain(model)
    return model


def _slow_if_large(cases, size):
    return [pytest.param(*case, marks=pytest.mark.slow) if size(case) > 1 << 20 else case for case in cases]


# ---- SoftmaxCrossEntropy(Grad) -------------------------------------------------------------------

# (x type, output type, rows, width, classes, scale per row, output columns or None)
CROSS_ENTROPY = [(F32, F32, 5, 1, 1, False, None), (F32, F32, 7, 33, 33, True, None), (F16, F16, 6, 40, 37, True, None),
                 (F16, F32, 9, 4100, 4097, True, None), (F32, F16, 3, 1000, 1000, False, None),
                 (F32, F16, 9, 40, 37, True, 40), (F16, F16, 4, 37, 37, False, 48),
                 (F16, F32, 64, 1000, 1000, False, None), (F32, F32, 32, 2, 2, False, None),
                 (F16, F32, 2048, 50264, 50257, True, None), (F32, F32, 256, 50257, 50257, True, None),
                 (F32, F16, 2048, 50264, 50257, True, 50264)]  # GPT-2's, as loss fusion rule 5 writes it


def cross_entropy_model(x_type, out_type, rows, width, classes, scale_rows, columns=None) -> onnx.ModelProto:
    made = [nodes.softmax_cross_entropy("x", "labels", picked="picked", lse="lse", output_type=out_type,
                                        classes=classes if classes != width else None, name="loss"),
            nodes.softmax_cross_entropy_grad("x", "lse", "labels", "scale", output="dx", output_type=out_type,
                                             classes=classes if classes != width else None,
                                             output_shape=[rows, columns or classes], output_columns=columns,
                                             name="grad")]
    return _model(made, {"x": (x_type, [rows, width]), "labels": (TensorProto.INT64, [rows]),
                         "scale": (F32, [scale_rows, 1])},
                  {"picked": (out_type, [rows]), "lse": (F32, [rows]), "dx": (out_type, [rows, columns or classes])})


def unfused_loss_model(rows, classes) -> onnx.ModelProto:
    """The loss and its gradient as the step graph computes them, float16 logits widened first."""
    constants = [numpy_helper.from_array(np.array(classes, np.int64), "depth"),
                 numpy_helper.from_array(np.array([0.0, 1.0], np.float32), "values"),
                 numpy_helper.from_array(np.array([-1], np.int64), "axis"),
                 numpy_helper.from_array(np.array([rows, classes], np.int64), "full")]
    made = [helper.make_node("Cast", ["x"], ["xf"], to=F32),
            helper.make_node("LogSoftmax", ["xf"], ["logp"], axis=-1),
            helper.make_node("OneHot", ["labels", "depth", "values"], ["onehot"], axis=-1),
            helper.make_node("Mul", ["onehot", "logp"], ["p"]),
            helper.make_node("ReduceSum", ["p", "axis"], ["picked"], keepdims=0),
            helper.make_node("Expand", ["scale", "full"], ["a"]),
            helper.make_node("Mul", ["a", "onehot"], ["g"]),
            helper.make_node("ReduceSum", ["g", "axis"], ["t"], keepdims=1),
            helper.make_node("Exp", ["logp"], ["e"]),
            helper.make_node("Mul", ["e", "t"], ["m"]),
            helper.make_node("Sub", ["g", "m"], ["dx"])]
    return _model(made, {"x": (F16, [rows, classes]), "labels": (TensorProto.INT64, [rows]), "scale": (F32, [rows, 1])},
                  {"picked": (F32, [rows]), "dx": (F32, [rows, classes])}, constants)


def cross_entropy_feeds(x_type, rows, width, classes, per_row, seed) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, width)) * 3).astype(NUMPY[x_type])
    x[:, classes:] = 3e4  # padding: never read
    labels = rng.integers(0, classes, size=rows).astype(np.int64)
    specials = [-1, classes, -classes - 1, -classes][:rows]
    labels[:len(specials)] = specials  # from the end, past the end, before the start, the first from the end
    scale = rng.standard_normal((rows if per_row else 1, 1)).astype(np.float32)
    return {"x": x, "labels": labels, "scale": scale}


@pytest.mark.parametrize("replayed", [False, True], ids=["plain", "replayed"])
@pytest.mark.parametrize("x_type, out_type, rows, width, classes, per_row, columns",
                         _slow_if_large(CROSS_ENTROPY, lambda c: c[2] * c[3]),
                         ids=[f"{NAME[x]}-{NAME[o]}-{r}x{w}-c{c}-{'rows' if p else 'one'}-o{n}"
                              for x, o, r, w, c, p, n in CROSS_ENTROPY])
def test_cross_entropy_and_its_gradient_match_numpy(device, x_type, out_type, rows, width, classes, per_row, columns,
                                                    replayed):
    feeds = cross_entropy_feeds(x_type, rows, width, classes, per_row, rows + width)
    picked, lse = ce.forward(feeds["x"], feeds["labels"], classes=classes, output_type=out_type)
    dx = ce.grad(feeds["x"], lse, feeds["labels"], feeds["scale"], classes=classes, output_type=out_type,
                 output_columns=columns)
    got = device.run(cross_entropy_model(x_type, out_type, rows, width, classes, feeds["scale"].shape[0], columns), feeds,
                     cuda_graph=replayed)
    tol = 2.0 ** -10 if out_type == F16 else 4e-6
    errors = {
        "lse": float(np.max(np.abs(got["lse"] - lse) / np.maximum(1.0, np.abs(lse)))),
        "picked": float(np.max(np.abs(got["picked"].astype(np.float64) - picked) /
                               np.maximum(1.0, np.abs(picked.astype(np.float64))))),
        "dx": float(np.max(np.abs(got["dx"].astype(np.float64) - dx.astype(np.float64)))
                    / max(1.0, float(np.abs(feeds["scale"]).max()))),
    }
    assert errors["lse"] <= 2e-6 and errors["picked"] <= tol * 4 and errors["dx"] <= tol, errors
    padding = got["dx"][:, classes:]
    assert np.all(padding == 0) and not np.signbit(padding).any(), "the padded columns are +0"


@pytest.mark.slow
def test_the_fused_loss_timed_against_the_unfused_graph_on_gpt2_logits(device, results):
    rows, classes = 2048, 50257
    feeds = cross_entropy_feeds(F16, rows, classes, classes, True, 99)
    runners = {}
    for graph in ((True, False) if device.cuda else (False,)):
        suffix = "-graph" if graph else ""
        runners[f"fused{suffix}"] = device.bound(cross_entropy_model(F16, F32, rows, classes, classes, rows), feeds,
                                                 cuda_graph=graph)
        runners[f"unfused{suffix}"] = device.bound(unfused_loss_model(rows, classes), feeds, cuda_graph=graph)
    figures = device.time(runners, rounds=5)
    fused, unfused = runners["fused"].outputs(), runners["unfused"].outputs()
    results.record(shape=[rows, classes], x="float16", timing=figures,
                   max_abs_difference={k: float(np.max(np.abs(fused[k] - unfused[k]))) for k in ("picked", "dx")})


# ---- LayerNormGrad -------------------------------------------------------------------------------

NAMES = ("dy", "xhat", "invstd", "gamma", "acc")
HALF, FULL = dict.fromkeys(NAMES, F16), dict.fromkeys(NAMES, F32)
MIXED = {"dy": F16, "xhat": F16, "invstd": F32, "gamma": F16, "acc": F32}
# (types of dy, xhat, invstd, gamma, acc; output type; rows; cols; acc given)
LAYER_NORM = [(FULL, F32, 3, 1, True), (FULL, F32, 5, 33, False), (HALF, F16, 7, 768, True), (MIXED, F32, 4, 100, True),
              (HALF, F32, 2, 4096, False), (HALF, F16, 4096, 768, True), (MIXED, F16, 2048, 768, True),
              (FULL, F32, 512, 3072, False)]


def _types_id(types) -> str:
    return {id(HALF): "half", id(FULL): "full", id(MIXED): "mixed"}[id(types)]


def _shapes(rows, cols):
    return {"dy": [rows, cols], "xhat": [rows, cols], "invstd": [rows, 1], "gamma": [cols], "acc": [rows, cols]}


def layer_norm_grad_model(types: dict, rows: int, cols: int, out_type: int, acc: bool) -> onnx.ModelProto:
    names = NAMES if acc else NAMES[:4]
    shapes = _shapes(rows, cols)
    node = nodes.layer_norm_grad(*names[:4], acc="acc" if acc else None, output="dx", output_type=out_type, name="grad")
    return _model([node], {n: (types[n], shapes[n]) for n in names}, {"dx": (out_type, [rows, cols])})


def unfused_layer_norm_grad_model(rows: int, cols: int) -> onnx.ModelProto:
    """The step graph's layer-norm input gradient, every node float16 (the campo plan's)."""
    made = [helper.make_node("Mul", ["dy", "gamma"], ["p"]),
            helper.make_node("ReduceMean", ["p"], ["a"], axes=[-1], keepdims=1),
            helper.make_node("Sub", ["p", "a"], ["d1"]),
            helper.make_node("Mul", ["xhat", "p"], ["q"]),
            helper.make_node("ReduceMean", ["q"], ["b"], axes=[-1], keepdims=1),
            helper.make_node("Mul", ["xhat", "b"], ["m"]),
            helper.make_node("Sub", ["d1", "m"], ["d2"]),
            helper.make_node("Mul", ["invstd", "d2"], ["d"]),
            helper.make_node("Sum", ["acc", "d"], ["dx"])]
    shapes = _shapes(rows, cols)
    return _model(made, {n: (F16, shapes[n]) for n in NAMES}, {"dx": (F16, [rows, cols])})


def layer_norm_feeds(types: dict, rows: int, cols: int, acc: bool, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = _shapes(rows, cols)
    feeds = {n: rng.standard_normal(shapes[n]).astype(NUMPY[types[n]]) for n in (NAMES if acc else NAMES[:4])}
    feeds["invstd"] = (np.abs(feeds["invstd"].astype(np.float32)) + 0.5).astype(NUMPY[types["invstd"]])
    return feeds


@pytest.mark.parametrize("replayed", [False, True], ids=["plain", "replayed"])
@pytest.mark.parametrize("types, out_type, rows, cols, acc", _slow_if_large(LAYER_NORM, lambda c: c[2] * c[3]),
                         ids=[f"{_types_id(t)}-{NAME[o]}-{r}x{c}{'-acc' if a else ''}" for t, o, r, c, a in LAYER_NORM])
def test_layer_norm_grad_matches_numpy(device, types, out_type, rows, cols, acc, replayed):
    feeds = layer_norm_feeds(types, rows, cols, acc, rows + cols)
    want = ln.reference(feeds["dy"], feeds["xhat"], feeds["invstd"], feeds["gamma"], feeds.get("acc"),
                        output_type=out_type).astype(np.float64)
    got = device.run(layer_norm_grad_model(types, rows, cols, out_type, acc), feeds, cuda_graph=replayed)["dx"]
    scale = np.maximum(1.0, np.abs(want).max(axis=1, keepdims=True))
    error = float(np.max(np.abs(got.astype(np.float64) - want) / scale))
    assert error <= (2.0 ** -10 if out_type == F16 else 2e-6), error


@pytest.mark.slow
def test_layer_norm_grad_timed_against_the_unfused_backward_on_bert(device, results):
    rows, cols = 4096, 768
    feeds = layer_norm_feeds(HALF, rows, cols, True, 99)
    runners = {}
    for graph in ((True, False) if device.cuda else (False,)):
        suffix = "-graph" if graph else ""
        runners[f"fused{suffix}"] = device.bound(layer_norm_grad_model(HALF, rows, cols, F16, True), feeds,
                                                 cuda_graph=graph)
        runners[f"unfused{suffix}"] = device.bound(unfused_layer_norm_grad_model(rows, cols), feeds, cuda_graph=graph)
    figures = device.time(runners, rounds=5)
    difference = np.abs(runners["fused"].outputs()["dx"].astype(np.float64)
                        - runners["unfused"].outputs()["dx"].astype(np.float64))
    results.record(shape=[rows, cols], dtype="float16", timing=figures, max_abs_difference=float(difference.max()))


# ---- SoftmaxGrad ---------------------------------------------------------------------------------

# (dy, y types; output type; rows; cols; scale)
SOFTMAX = [((F32, F32), F32, 5, 1, 1.0), ((F16, F16), F16, 7, 128, 0.125), ((F32, F16), F32, 3, 1000, 0.5),
           ((F16, F16), F16, 24576, 256, 0.125), ((F16, F16), F16, 49152, 128, 0.125)]


def softmax_grad_model(types, rows, cols, out_type, scale, fused: bool) -> onnx.ModelProto:
    constants = []
    if fused:
        made = [nodes.softmax_grad("dy", "y", output="dx", cols=cols, scale=scale, output_type=out_type, name="grad")]
    else:  # the step graph's backward of Softmax, then the attention's scale
        made = [helper.make_node("Mul", ["y", "dy"], ["p"]), helper.make_node("ReduceSum", ["p", "axes"], ["t"], keepdims=1),
                helper.make_node("Sub", ["dy", "t"], ["s"]), helper.make_node("Mul", ["y", "s"], ["d"]),
                helper.make_node("Mul", ["d", "scale"], ["dx"])]
        constants = [numpy_helper.from_array(np.array([-1], np.int64), "axes"),
                     numpy_helper.from_array(np.array([scale], NUMPY[out_type]), "scale")]
    return _model(made, {"dy": (types[0], [rows, cols]), "y": (types[1], [rows, cols])}, {"dx": (out_type, [rows, cols])},
                  constants)


def softmax_feeds(types, rows, cols, seed) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((rows, cols)) * 2
    y = np.exp(logits - logits.max(axis=1, keepdims=True))
    y /= y.sum(axis=1, keepdims=True)
    return {"dy": rng.standard_normal((rows, cols)).astype(NUMPY[types[0]]), "y": y.astype(NUMPY[types[1]])}


@pytest.mark.parametrize("replayed", [False, True], ids=["plain", "replayed"])
@pytest.mark.parametrize("types, out_type, rows, cols, scale", _slow_if_large(SOFTMAX, lambda c: c[2] * c[3]),
                         ids=[f"{NAME[t[0]]}-{NAME[t[1]]}-{NAME[o]}-{r}x{c}" for t, o, r, c, _ in SOFTMAX])
def test_softmax_grad_matches_numpy(device, types, out_type, rows, cols, scale, replayed):
    feeds = softmax_feeds(types, rows, cols, rows + cols)
    want = sm.reference(feeds["dy"], feeds["y"], cols=cols, scale=scale, output_type=out_type).astype(np.float64)
    got = device.run(softmax_grad_model(types, rows, cols, out_type, scale, True), feeds, cuda_graph=replayed)["dx"]
    error = float(np.max(np.abs(got.astype(np.float64) - want) / np.maximum(1e-3, np.abs(want).max(axis=1, keepdims=True))))
    assert error <= (2.0 ** -10 if out_type == F16 else 2e-6), error


@pytest.mark.slow
def test_softmax_grad_timed_against_the_unfused_backward_on_gpt2_attention(device, results):
    rows, cols = 8 * 12 * 256, 256
    feeds = softmax_feeds((F16, F16), rows, cols, 98)
    runners = {}
    for graph in ((True, False) if device.cuda else (False,)):
        for fused in (True, False):
            runners[f"{'fused' if fused else 'unfused'}{'-graph' if graph else ''}"] = device.bound(
                softmax_grad_model((F16, F16), rows, cols, F16, 0.125, fused), feeds, cuda_graph=graph)
    results.record(shape=[rows, cols], dtype="float16", timing=device.time(runners, rounds=5))
