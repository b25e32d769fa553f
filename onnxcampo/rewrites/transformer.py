"""``--fuse``: ONNX Runtime's transformers optimizer before planning, and the tensor names ONNX
Runtime's own graph fusions generate, renamed in what onnxcampo writes.

What ONNX Runtime users run for BERT and GPT-2 on the CUDA EP is
``onnxruntime.transformers.optimizer.optimize_model`` (SkipLayerNormalization, Attention,
BiasGelu, ...) before an fp16 conversion; on an H200 the fused fp16 BERT-base b32 ran 4.50 ms
against 4.68 ms for campo on the unfused graph. :func:`fuse_transformer` runs that optimizer's
Python fusions on the loaded model before anything is planned, so that campo plans the graph that
will run. The rule, case by case:

1. ``none``: the model is left as it is.
2. Never fused, whatever the mode: a training step (``train-graph``'s, or an ONNX Runtime
   training graph with in-place state ops) and a graph that is already fused (it has
   com.microsoft fused ops, or ORT's transformers optimizer wrote it).
3. ``auto`` (the default) fuses BERT-like and GPT-2-like graphs and nothing else
   (:func:`detect`), case by case, in this order:

   a. No attention Softmax: none whose input is a MatMul of two activations (Q.K^T; between them
      only the scale, the mask and its selection: Add, Sub, Mul, Div, Where, Cast) and whose
      output is the first input of a MatMul with another activation (probs.V; between them only
      Cast, Dropout, Identity, or a Where that passes the probabilities through, such as
      SDPA's ``Where(IsNaN(p), 0, p)``). Not a transformer: left alone, said at info level.
   b. Attention but no layer norm (the LayerNormalization op, or ReduceMean, Sub, then Div by
      the deviation or Mul by its Reciprocal, then a Mul by the scale): left alone, and one
      warning says why and that ``bert`` / ``gpt2`` force it.
   c. Attention and layer norms but no GELU (the Gelu op; the erf form, ``x / sqrt(2)`` or
      ``x * (1 / sqrt(2))`` into Erf; the tanh form, ``sqrt(2 / pi) * (...)`` into Tanh): left
      alone with that warning. An OCR recognizer (SVTR: attention and layer norms, Swish and
      HardSwish activations) ends here.
   d. All three and a causal mask: ``gpt2``. A causal mask is a Trilu, a constant that is lower
      triangular in its last two dims, or a comparison (Less, LessOrEqual, Greater,
      GreaterOrEqual) of two tensors that each come from a Range within six nodes: the
      ``kv_idx <= q_idx`` of transformers' mask functions, as torch.onnx's TorchScript and
      dynamo exporters write it.
   e. All three, no causal mask found, and GELU in the tanh form only (GPT-2's activation;
      BERT's is the exact erf form): ``gpt2``.
   f. Otherwise: ``bert``.

   Quantized graphs are left alone (fusions would break their QDQ patterns). Whatever is left
   alone has its reason in the report.
4. ``bert`` / ``gpt2`` force the model type.
5. ``num_heads`` / ``hidden_size``: the config's when not 0, else detected (hidden size: the
   layer norms' scale length, else the head split's heads x head size; heads: the Reshape that
   splits them, ``[B, S, heads, head_size]``, or ``[B, S, -1, head_size]`` as transformers
   writes it, heads then being the hidden size over the head size), else 0 (ORT's optimizer
   then detects them itself, which it does not on these exports).
6. Fusion options: ORT's for the model type, with the choices that keep the graph's meaning on
   the GPU: the raw 2-D attention mask (the BERT default, a mask index, assumes right-side
   padding), then given to each BERT Attention as an additive attention bias, which means the
   same and lets ORT's CUDA kernel run memory-efficient attention (:mod:`.attention_mask`;
   experimental ``attention_bias=false`` keeps the raw mask); the attention the optimizer leaves
   unfused (transformers' SDPA attention, the dynamo exporter's graphs, GPT-2's) as one
   MultiHeadAttention each (:mod:`.attention`; experimental ``attention_fusion=false`` leaves
   it), exact Gelu (no tanh approximation), no int8 QOrdered ops. ``opt_level=0``: only the
   Python fusions run, no ORT session optimizes (or writes initializers into) the graph.
7. The fused model keeps the input's IR version, opset imports (com.microsoft is declared when
   used), producer, graph inputs and outputs (if the optimizer changed one, or fused nothing, its
   result is dropped); node names are unique and the nodes topologically sorted. ONNX shape
   inference stops at com.microsoft ops, so ORT's symbolic shape inference gives the fused ops'
   outputs their shapes for planning; those entries are dropped again at export
   (:func:`clean_export`), so that no invented shape information is written.

In ``auto`` a failure of the optimizer leaves the model unfused with a warning; a forced mode
raises :class:`UnsupportedModelError`. The pipeline lets the optimizer fuse its own copy of the
model in place (no second copy of the weights) and puts it back when the fusion is not kept.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import re
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from onnxcampo import ir
from onnxcampo import oplists
from onnxcampo.config import OptimizeConfig
from onnxcampo.errors import CampoError, UnsupportedModelError, option
from onnxcampo.ir.topology import toposort_model
from onnxcampo.rewrites import attention, attention_mask
from onnxcampo.rewrites.matcher import GraphView
from onnxcampo.training import scaling

log = logging.getLogger(__name__)

ORT_PRODUCER = "onnxruntime.transformers"
# Marks the value infos made for planning (rule 7): :func:`clean_export` drops them.
PLANNING_SHAPE = "onnxcampo.rewrites.transformer: shape for planning, not written"

# The com.microsoft ops ORT's transformers optimizer makes: a graph with any of them is fused
# already, and the report counts the ones a fusion made.
FUSED_MS_OPS = frozenset({
    "Attention", "MultiHeadAttention", "GroupQueryAttention", "EmbedLayerNormalization",
    "SkipLayerNormalization", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization",
    "Gelu", "FastGelu", "BiasGelu", "GemmFastGelu", "QuickGelu", "BiasSplitGelu", "BiasAdd",
    "RotaryEmbedding", "QOrderedAttention", "QOrderedGelu", "QOrderedLayerNormalization",
    "QOrderedMatMul",
})
# ONNX ops the optimizer also makes; exporters emit them too, so they count only where added.
FUSED_ONNX_OPS = frozenset({"LayerNormalization"})

# --- the graph patterns of rule 3 (op types, data) ----------------------------------------------
_LAYER_NORM = "LayerNormalization"
_MEAN, _CENTRE, _SCALE = "ReduceMean", "Sub", "Mul"
_DIVIDE, _RECIPROCAL = "Div", "Reciprocal"  # (x - mean) / deviation, or (x - mean) * (1 / deviation)
_SOFTMAX = "Softmax"
_MATMUL = "MatMul"
# between Q.K^T and the Softmax: the scale, the mask and its selection
_SCORE_OPS = frozenset({"Add", "Sub", "Div", "Mul", "Where", "Cast"})
# between the Softmax and probs.V: a precision change, dropout, and a Where that passes the
# probabilities through (SDPA's guard for fully masked rows: Where(IsNaN(p), 0, p))
_PROBABILITY_OPS = frozenset({"Cast", "Dropout", "Identity", "Where"})
_WHERE = "Where"
_GELU_OPS = frozenset({"Gelu"})  # the ONNX op (opset 20)
_ERF, _TANH = "Erf", "Tanh"
_ERF_SCALES = (math.sqrt(2.0), 1 / math.sqrt(2.0))  # x / sqrt(2) or x * (1 / sqrt(2)) into Erf
_ERF_SCALE_OPS = frozenset({"Div", "Mul"})
_TANH_SCALE = math.sqrt(2 / math.pi)  # tanh(sqrt(2 / pi) * (x + 0.044715 x^3))
_TANH_SCALE_OP = "Mul"
_TRILU = "Trilu"
_RANGE = "Range"
_COMPARISONS = frozenset({"Less", "LessOrEqual", "Greater", "GreaterOrEqual"})
_RESHAPE, _CONCAT = "Reshape", "Concat"
_CONSTANT = "Constant"
_MAX_MASK_ELEMENTS = 1 << 22  # causal-mask constants examined (GPT-2's bias buffer: 1024 x 1024)
_ANCESTOR_HOPS = 6  # how far back a comparison's inputs are followed to a Range

# --- the names of ORT's C++ graph fusions (clean_export) ---------------------------------------
# ONNX Runtime's graph transformers name the initializers they add with Graph::GenerateNodeName,
# which avoids the names of *nodes*, not of tensors: a model that already holds one (an
# ORT-optimized model saved with ``optimized_model_filepath``, or what a tool wrote from it) fails
# to load with "AddInitializedOrtValue Attempt to replace the existing tensor" as soon as the same
# fusion fires again at session creation. Later ones in a session get ``<base>_token_<n>``.
ORT_GENERATED_NAMES = (
    "gemm_input_shape", "gemm_output_shape",  # core/optimizer/matmul_add_fusion.cc (MatMulAddFusion)
    "squeeze_axes", "splits",  # core/optimizer/gather_fusion.cc (GatherSliceToSplitFusion)
    "SqueezeAxesInitializer", "UnsqueezeAxesInitializer", "SliceAxesInitializer",  # gather_fusion.cc
    "fused_Split",  # core/optimizer/gather_slice_fusion.cc (older releases)
    "ConstAsInitializer",  # orttraining/core/optimizer/conv1d_replacement.cc
)
_ORT_GENERATED = re.compile(rf"(?:{'|'.join(map(re.escape, ORT_GENERATED_NAMES))})(?:_token_\d+)?")
RENAMED_PREFIX = "onnxcampo/"


@dataclass(frozen=True)
class Detection:
    """What :func:`detect` found: ``model_type`` None (with the ``reason``) when the graph is no
    BERT- or GPT-2-like transformer; 0 for a size it could not find; ``attention``: the graph
    has an attention Softmax (rule 3 a), so that a refusal may be a pattern not recognised."""

    model_type: str | None
    num_heads: int = 0
    hidden_size: int = 0
    reason: str = ""
    attention: bool = False


def fuse_transformer(model: onnx.ModelProto, config: OptimizeConfig, *,
                     in_place: bool = False) -> tuple[onnx.ModelProto, dict]:
    """The model to plan (``model`` itself when nothing is fused, else a new one) and the report's
    ``fuse`` entry: ``{"mode", "model_type", "num_heads", "hidden_size", "ops": {op: count},
    "seconds"}`` or ``{"mode", "model_type": None, "reason"}``. ``model`` is not modified.

    ``in_place`` (a caller that owns ``model`` and plans what this returns instead): ORT's
    optimizer fuses ``model`` itself, without a copy of its weights; whenever the fusion is not
    kept (the optimizer failed, changed the graph's interface, fused nothing, wrote an invalid
    graph), ``model`` is put back as it was (:class:`_Kept`) and returned."""
    mode = config.fuse
    if mode == "none":
        return model, _left_alone(mode, "--fuse none")
    refusal = _refusal(model, auto=mode == "auto")
    if refusal:
        log.info("fuse: not fused: %s", refusal)
        return model, _left_alone(mode, refusal)
    detection = detect(model)
    if mode == "auto" and detection.model_type is None:
        if detection.attention:  # rule 3 b, c: perhaps a transformer written in a form not recognised
            log.warning("fuse: not fused: %s; %s or %s fuses it as that model type", detection.reason,
                        option("fuse", "bert"), option("fuse", "gpt2"))
        else:
            log.info("fuse: not fused: %s", detection.reason)
        return model, _left_alone(mode, detection.reason)
    model_type = detection.model_type if mode == "auto" else mode
    num_heads = config.num_heads or detection.num_heads
    hidden_size = config.hidden_size or detection.hidden_size
    if not (num_heads and hidden_size and hidden_size % num_heads == 0):
        # ORT's optimizer asserts both or neither (and heads dividing the size): let it detect both
        num_heads = hidden_size = 0
    start = time.perf_counter()
    # opt_level 0 fuses the proto it is given in place: a copy, so that ours stays whole, or ours
    # with what puts it back
    kept = _Kept(model) if in_place else None
    before = kept.model if kept else model  # the graph as it was, for the comparisons below
    try:
        fused = _run_optimizer(model if kept else copy.deepcopy(model), model_type, num_heads, hidden_size)
    except Exception as exc:  # noqa: BLE001 - ORT's Python fusions fail in many ways on odd graphs
        text = str(exc).strip().splitlines()
        failure = f"ONNX Runtime's transformers optimizer failed ({exc.__class__.__name__}: {text[0] if text else ''})"
        _put_back(kept)
        if mode != "auto":
            raise UnsupportedModelError(f"{option('fuse', mode)}: {failure}; {option('fuse', 'none')} plans the graph unfused") from None
        log.warning("fuse: %s as %s; the graph is planned unfused", failure, model_type)
        return model, _left_alone(mode, failure)
    ops = _fused_op_counts(before, fused)
    problem = _changed_interface(before, fused) or (
        None if ops else "ONNX Runtime's transformers optimizer found nothing to fuse")
    if problem:
        _put_back(kept)
        log.warning("fuse: %s as %s; the graph is planned unfused", problem, model_type)
        return model, _left_alone(mode, problem)
    _restore_model_fields(fused, before)
    biased = attention_mask.mask_as_bias(fused) if config.experimental.attention_bias else 0
    if config.experimental.attention_fusion:
        written = attention.fuse_attention(fused, num_heads=num_heads or detection.num_heads or 0)
        if written:
            ops["MultiHeadAttention"] = ops.get("MultiHeadAttention", 0) + written
            ops = dict(sorted(ops.items()))
    ir.name_nodes(fused)
    toposort_model(fused)
    invalid = _checker_problem(fused)
    if invalid:
        _put_back(kept)
        if mode != "auto":
            raise UnsupportedModelError(f"{option('fuse', mode)}: {invalid}; {option('fuse', 'none')} plans the graph unfused")
        log.warning("fuse: %s as %s; the graph is planned unfused", invalid, model_type)
        return model, _left_alone(mode, invalid)
    shaped = _add_planning_shapes(fused, config)
    seconds = time.perf_counter() - start
    log.info("fuse: %s (%s heads, hidden size %s): %s; %d with the mask as an attention bias; %d fused outputs "
             "shaped for planning (%.1f s)", model_type, num_heads or "ORT-detected", hidden_size or "ORT-detected",
             ", ".join(f"{count} {op}" for op, count in ops.items()), biased, shaped, seconds)
    return fused, {"mode": mode, "model_type": model_type, "num_heads": num_heads, "hidden_size": hidden_size,
                   "ops": ops, "attention_bias": biased, "seconds": round(seconds, 3)}


class _Kept:
    """What puts a model that ORT's optimizer fuses in place back as it was: a copy of it without
    its large initializers (``ir.without_weights``; everything else as it was) and those
    initializers themselves, held by reference. ORT's fusions add and remove initializers but
    never change one's data, and a tensor they remove stays valid while it is held here, so
    putting back copies the held tensors into their stubs' places: no copy of the weights unless
    the fusion is not kept."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.target = model
        self.model, self.weights = ir.without_weights(model, location=_KEPT_LOCATION)

    def put_back(self) -> None:
        self.target.CopyFrom(self.model)
        for tensor in self.target.graph.initializer:
            if tensor.name in self.weights and tensor.data_location == onnx.TensorProto.EXTERNAL:
                tensor.CopyFrom(self.weights[tensor.name])


_KEPT_LOCATION = "onnxcampo-fuse-kept"  # what the stubs of _Kept's copy name; never a file


def _put_back(kept: _Kept | None) -> None:
    if kept is not None:
        kept.put_back()


def _checker_problem(fused: onnx.ModelProto) -> str | None:
    """Why the fused graph is no valid ONNX model, or None: ORT's optimizer writes
    LayerNormalization in the default domain, which ONNX defines from opset 17 only (an opset-14
    export fused so loads in ORT but is refused by the checker, and so by onnxcampo itself)."""
    try:
        ir.check_model(fused)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else exc.__class__.__name__
        return f"ONNX Runtime's transformers optimizer wrote an invalid ONNX graph ({first})"
    return None


def _left_alone(mode: str, reason: str) -> dict:
    return {"mode": mode, "model_type": None, "reason": reason}


def _refusal(model: onnx.ModelProto, *, auto: bool) -> str | None:
    """Why the model must not be fused (rule 2; quantized graphs in ``auto``), or None."""
    if scaling.is_train_step(model):
        return "a training-step graph: its forward and backward ops are planned as they are"
    nodes = model.graph.node
    if any(oplists.updates_state_in_place(n.op_type, n.domain) for n in nodes):
        return "an ONNX Runtime training graph: its forward and backward ops are planned as they are"
    fused = Counter(n.op_type for n in nodes if n.domain == oplists.MS_DOMAIN and n.op_type in FUSED_MS_OPS)
    if fused:
        return "already fused (" + ", ".join(f"{count} {op}" for op, count in sorted(fused.items())) + ")"
    if model.producer_name == ORT_PRODUCER:
        return "already written by ONNX Runtime's transformers optimizer"
    if auto and any(n.op_type in oplists.QUANTIZE_OPS for n in nodes):
        return "a quantized graph: fusing would break its quantization patterns"
    return None


# --- detection (rule 3 and 5) -------------------------------------------------------------------
def detect(model: onnx.ModelProto) -> Detection:
    """Whether the graph is BERT-like or GPT-2-like, and its heads and hidden size (rule 3, 5)."""
    index = _Index(model)
    if not index.has_attention_softmax():
        return Detection(None, reason="not a transformer: no attention Softmax between MatMuls of activations")
    norms = index.layer_norm_sizes()
    if not norms:
        return Detection(None, reason="not BERT- or GPT-2-like: attention, but no layer norm (LayerNormalization or "
                         "its pattern)", attention=True)
    forms = index.gelu_forms()
    if not forms:
        return Detection(None, reason="not BERT- or GPT-2-like: attention and layer norms, but no Gelu (the op, its "
                         "erf or tanh form)", attention=True)
    causal = index.has_causal_mask()
    tanh_only = forms == {"tanh"}
    model_type = "gpt2" if causal or tanh_only else "bert"
    sizes = Counter(size for size in norms if size)
    hidden = sizes.most_common(1)[0][0] if sizes else 0
    splits = Counter(split for split in index.head_splits(hidden) if not hidden or split[0] * split[1] == hidden)
    heads = 0
    if splits:
        (heads, head_size), _ = splits.most_common(1)[0]
        hidden = hidden or heads * head_size
    found = "a causal mask" if causal else ("GPT-2's tanh GELU" if tanh_only else "no causal mask")
    return Detection(model_type, heads, hidden, f"layer norms, attention Softmax, Gelu and {found}", attention=True)


class _Index(GraphView):
    """The shared matcher's tables of one model (producers, readers, constants), for the
    detection's pattern checks (no shapes: they read ops and constants)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        super().__init__(model, {}, fresh_prefix="fuse")
        self.nodes = list(model.graph.node)

    def is_constant(self, name: str) -> bool:
        return name in self.constants

    def value(self, name: str, max_elements: int = 64) -> np.ndarray | None:
        tensor = self.constants.get(name)
        if tensor is None or math.prod(tensor.dims) > max_elements:
            return None
        try:
            return numpy_helper.to_array(tensor)
        except (ValueError, TypeError, OSError):
            return None

    def _close_to(self, name: str, targets: tuple[float, ...]) -> bool:
        value = self.value(name, max_elements=1)
        return value is not None and value.dtype.kind == "f" and any(
            math.isclose(float(value.reshape(-1)[0]), t, rel_tol=1e-3) for t in targets)

    def _produced_by(self, name: str, op_type: str) -> onnx.NodeProto | None:
        node = self.producers.get(name)
        return node if node is not None and node.op_type == op_type else None

    def layer_norm_sizes(self) -> list[int | None]:
        """One entry per layer norm: the length of its scale (None where unknown)."""
        sizes: list[int | None] = []
        for node in self.nodes:
            if node.op_type == _LAYER_NORM and node.domain in oplists.DEFAULT_DOMAINS:
                scale = self.constants.get(node.input[1]) if len(node.input) > 1 else None
                sizes.append(int(scale.dims[-1]) if scale is not None and scale.dims else None)
            elif node.op_type == _MEAN and node.input:
                sizes.extend(self._decomposed_norm(node))
        return sizes

    def _decomposed_norm(self, mean: onnx.NodeProto) -> list[int | None]:
        """``(x - mean(x)) / sqrt(var + eps)`` times a scale: ``[scale length]``, or ``[]``."""
        x, m = mean.input[0], mean.output[0]
        for centre in self.consumers[m]:
            if centre.op_type != _CENTRE or list(centre.input) != [x, m]:
                continue
            for normalize in self.consumers[centre.output[0]]:
                if not self._normalizes(normalize, centre.output[0]):
                    continue
                for scale in self.consumers[normalize.output[0]]:
                    other = [i for i in scale.input if i != normalize.output[0]]
                    if scale.op_type == _SCALE and other and self.is_constant(other[0]):
                        dims = self.constants[other[0]].dims
                        return [int(dims[-1]) if dims else None]
                return [None]
        return []

    def _normalizes(self, node: onnx.NodeProto, centred: str) -> bool:
        """``centred / deviation`` or ``centred * (1 / deviation)``."""
        if node.op_type == _DIVIDE:
            return node.input[0] == centred
        others = [i for i in node.input if i != centred]
        return node.op_type == _SCALE and len(others) == 1 and self._produced_by(others[0], _RECIPROCAL) is not None

    def _from_activation_matmul(self, name: str, hops: int = 6) -> bool:
        node = self.producers.get(name)
        if node is None or hops == 0:
            return False
        if node.op_type == _MATMUL:
            return not any(self.is_constant(i) for i in node.input)
        if node.op_type in _SCORE_OPS:
            return any(self._from_activation_matmul(i, hops - 1) for i in node.input if i and not self.is_constant(i))
        return False

    def _feeds_activation_matmul(self, name: str, hops: int = 3) -> bool:
        for node in self.consumers[name]:
            if node.op_type == _MATMUL and node.input[0] == name and not self.is_constant(node.input[1]):
                return True
            passes = node.op_type in _PROBABILITY_OPS and (node.op_type != _WHERE or name in node.input[1:])
            if hops > 1 and passes and self._feeds_activation_matmul(node.output[0], hops - 1):
                return True
        return False

    def has_attention_softmax(self) -> bool:
        return any(node.op_type == _SOFTMAX and self._from_activation_matmul(node.input[0])
                   and self._feeds_activation_matmul(node.output[0]) for node in self.nodes)

    def gelu_forms(self) -> set[str]:
        """The forms of GELU in the graph: ``op`` (the Gelu op), ``erf`` (BERT's exact form),
        ``tanh`` (GPT-2's approximation)."""
        forms = set()
        for node in self.nodes:
            if node.op_type in _GELU_OPS and node.domain in oplists.DEFAULT_DOMAINS:
                forms.add("op")
            if node.op_type == _ERF:
                scale = self.producers.get(node.input[0])
                if scale is not None and scale.op_type in _ERF_SCALE_OPS and any(
                        self._close_to(i, _ERF_SCALES) for i in scale.input[1:]):
                    forms.add("erf")
            if node.op_type == _TANH:
                scale = self.producers.get(node.input[0])
                if scale is not None and scale.op_type == _TANH_SCALE_OP and any(
                        self._close_to(i, (_TANH_SCALE,)) for i in scale.input):
                    forms.add("tanh")
        return forms

    def has_causal_mask(self) -> bool:
        if any(node.op_type == _TRILU for node in self.nodes):
            return True
        if any(_is_triangular(self.value(name, _MAX_MASK_ELEMENTS)) for name, tensor in self.constants.items()
               if len(tensor.dims) >= 2 and tensor.dims[-1] == tensor.dims[-2] > 1):
            return True
        # positions compared with positions: q_index >= kv_index, both from Range
        return any(node.op_type in _COMPARISONS and len(node.input) == 2
                   and all(self._has_range_ancestor(i, _ANCESTOR_HOPS) for i in node.input) for node in self.nodes)

    def _has_range_ancestor(self, name: str, hops: int) -> bool:
        node = self.producers.get(name)
        if node is None or hops == 0:
            return False
        return node.op_type == _RANGE or any(self._has_range_ancestor(i, hops - 1) for i in node.input if i)

    def head_splits(self, hidden: int) -> list[tuple[int, int]]:
        """``(heads, head size)`` of every Reshape to ``[B, S, heads, head size]``; where heads
        is -1 or computed (transformers' ``view(*shape, -1, head_dim)``), ``hidden`` over the
        head size."""
        splits = []
        for node in self.nodes:
            if node.op_type != _RESHAPE or len(node.input) < 2:
                continue
            shape = self._shape_values(node.input[1])
            if not shape or len(shape) != 4 or not shape[3] or shape[3] < 2:
                continue
            heads, head_size = shape[2], shape[3]
            if heads in (-1, None) and hidden and hidden % head_size == 0:
                heads = hidden // head_size
            if heads and heads > 1:
                splits.append((heads, head_size))
        return splits

    def _shape_values(self, name: str) -> list[int | None] | None:
        """A shape tensor's entries: a constant's, or a Concat's (None for a computed piece)."""
        value = self.value(name)
        if value is not None:
            return [int(v) for v in value.reshape(-1)]
        concat = self._produced_by(name, _CONCAT)
        if concat is None:
            return None
        entries: list[int | None] = []
        for part in concat.input:
            value = self.value(part)
            entries.extend([int(v) for v in value.reshape(-1)] if value is not None else [None])
        return entries


def _is_triangular(mask: np.ndarray | None) -> bool:
    """A constant whose last two (square) dims hold one value on and below the diagonal and
    another above it, the same in every leading position: a causal mask (bool, 0/1, 0/-inf)."""
    if mask is None or mask.ndim < 2 or mask.shape[-1] != mask.shape[-2] or mask.shape[-1] < 2:
        return False
    square = mask.reshape(-1, *mask.shape[-2:])
    lower = np.tril(np.ones(square.shape[-2:], dtype=bool))
    on, above = square[0][lower], square[0][~lower]
    return bool(np.all(on == on[0]) and np.all(above == above[0]) and on[0] != above[0]
                and np.all(square == square[0]))


# --- running ORT's optimizer (rule 6) -----------------------------------------------------------
@contextlib.contextmanager
def _ort_transformers_logs():
    """ORT's transformers modules log under their file names (they import each other as top-level
    modules); their warnings are about patterns they did not find: shown with ``-vv`` only."""
    import onnxruntime.transformers as package

    if log.isEnabledFor(logging.DEBUG):
        yield
        return
    names = [path.stem for path in Path(package.__file__).parent.glob("*.py")]
    names += ["symbolic_shape_infer", "onnxruntime.tools.symbolic_shape_infer"]
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def _run_optimizer(model: onnx.ModelProto, model_type: str, num_heads: int, hidden_size: int) -> onnx.ModelProto:
    with _ort_transformers_logs():
        from onnxruntime.transformers.fusion_options import FusionOptions
        from onnxruntime.transformers.optimizer import optimize_model

        options = FusionOptions(model_type)
        options.use_raw_attention_mask(True)
        options.enable_gelu_approximation = False
        options.enable_qordered_matmul = False
        # opt_level 0: only the Python fusions, on ``model`` itself
        with _shape_inference_on_weightless_copies():
            optimizer = optimize_model(model, model_type=model_type, num_heads=num_heads, hidden_size=hidden_size,
                                       optimization_options=options, opt_level=0, use_gpu=True)
    return optimizer.model


@contextlib.contextmanager
def _shape_inference_on_weightless_copies():
    """ORT's fusions run its symbolic shape inference on the model several times (BERT-base:
    five), and each run copies the whole model, weights included, at least twice (``_preprocess``,
    then each pass of ``_infer_impl``): BERT-base b32 on 2 cores, ORT's optimizer takes 5.6 s, and
    1.6 s in this context. In it, each run copies a copy of the model without the weights' data
    instead (:func:`ir.skeleton`: type and dims kept) and reads the initializers' values, where an
    op's shape depends on them, from the model itself: the same tensors, so the same shapes. ORT's
    fusions import the helper by its top-level module name (``shape_infer_helper``), which is
    where it is replaced. A graph with subgraphs (If, Loop, Scan) is inferred as ORT does it:
    their inference copies the outer initializers into a temporary graph."""
    import shape_infer_helper as module  # importable once onnxruntime.transformers is

    base = module.SymbolicShapeInferenceHelper

    class WeightlessCopies(base):
        def _preprocess(self, in_mp):
            if any(ir.has_subgraph(node) for node in in_mp.graph.node):
                super()._preprocess(in_mp)
                return
            super()._preprocess(ir.skeleton(in_mp))
            self.initializers_ = {tensor.name: tensor for tensor in in_mp.graph.initializer}

    module.SymbolicShapeInferenceHelper = WeightlessCopies
    try:
        yield
    finally:
        module.SymbolicShapeInferenceHelper = base


def _interface(model: onnx.ModelProto) -> list[tuple[str, str, int]]:
    entries = [("input", vi.name, vi.type.tensor_type.elem_type) for vi in ir.graph_inputs(model)]
    return entries + [("output", vi.name, vi.type.tensor_type.elem_type) for vi in model.graph.output]


def _changed_interface(model: onnx.ModelProto, fused: onnx.ModelProto) -> str | None:
    before, after = _interface(model), _interface(fused)
    if before == after:
        return None
    changed = sorted({f"{kind} {name!r}" for kind, name, _ in set(before) ^ set(after)})
    return f"ONNX Runtime's transformers optimizer changed graph {', '.join(changed[:4])}"


def _fused_op_counts(model: onnx.ModelProto, fused: onnx.ModelProto) -> dict[str, int]:
    def counts(m: onnx.ModelProto) -> Counter:
        return Counter(n.op_type for n in m.graph.node
                       if (n.domain == oplists.MS_DOMAIN and n.op_type in FUSED_MS_OPS)
                       or (n.domain in oplists.DEFAULT_DOMAINS and n.op_type in FUSED_ONNX_OPS))

    return dict(sorted((counts(fused) - counts(model)).items()))


def _restore_model_fields(fused: onnx.ModelProto, model: onnx.ModelProto) -> None:
    """Rule 7: the input's IR version, opsets and producer; every domain the graph uses declared."""
    fused.ir_version = model.ir_version
    fused.producer_name, fused.producer_version = model.producer_name, model.producer_version
    del fused.opset_import[:]
    fused.opset_import.extend(model.opset_import)
    declared = {entry.domain for entry in fused.opset_import}
    for domain in sorted({n.domain for n in fused.graph.node} - declared - set(oplists.DEFAULT_DOMAINS)):
        fused.opset_import.add(domain=domain, version=1)


def _add_planning_shapes(model: onnx.ModelProto, config: OptimizeConfig) -> int:
    """Rule 7: value infos (marked :data:`PLANNING_SHAPE`) for the outputs of ops that ONNX
    shape inference cannot see through, from ORT's symbolic shape inference on a weightless copy
    with the config's pins. Returns how many were added."""
    graph = model.graph
    declared = {vi.name for vi in (*graph.input, *graph.output, *graph.value_info)}
    wanted = [name for node in graph.node if node.domain not in oplists.DEFAULT_DOMAINS
              for name in node.output if name and name not in declared]
    if not wanted:
        return 0
    skeleton = ir.skeleton(model, weights_as_inputs=True)
    with contextlib.suppress(CampoError):  # a bad pin: shape inference at load reports it
        ir.pin_input_shapes(skeleton, config.input_shapes, config.dim_values, require_static=False)
    try:
        with _ort_transformers_logs():
            from onnxruntime.transformers.shape_infer_helper import SymbolicShapeInferenceHelper

            helper = SymbolicShapeInferenceHelper(skeleton, auto_merge=True)
            helper.infer(dict(config.dim_values))
        known = helper.known_vi_
    except Exception as exc:  # noqa: BLE001 - sympy missing, or an op it does not know
        log.info("fuse: no shapes for the fused ops (ORT's symbolic shape inference: %s: %s); they are planned "
                 "without sizes", exc.__class__.__name__, str(exc).strip().splitlines()[0] if str(exc).strip() else "")
        return 0
    added = 0
    for name in wanted:
        entry = known.get(name)
        if entry is None or not entry.type.tensor_type.elem_type or not entry.type.tensor_type.HasField("shape"):
            continue
        value_info = onnx.ValueInfoProto.FromString(entry.SerializeToString())
        value_info.doc_string = PLANNING_SHAPE
        graph.value_info.append(value_info)
        added += 1
    return added


# --- export -------------------------------------------------------------------------------------
def clean_export(model: onnx.ModelProto) -> None:
    """What the written model must not carry, removed in place: the planning-only value infos
    (rule 7) and tensor names ONNX Runtime's graph fusions generate (:func:`rename_ort_generated_names`)."""
    drop_planning_shapes(model)
    renamed = rename_ort_generated_names(model)
    if renamed:
        log.info("renamed %d tensors named like ONNX Runtime's fusion outputs (%s), which would collide when ORT "
                 "fuses again at load", len(renamed), ", ".join(sorted(renamed)[:4]))


def drop_planning_shapes(model: onnx.ModelProto) -> int:
    graph = model.graph
    kept = [vi for vi in graph.value_info if vi.doc_string != PLANNING_SHAPE]
    dropped = len(graph.value_info) - len(kept)
    if dropped:
        del graph.value_info[:]
        graph.value_info.extend(kept)
    return dropped


def rename_ort_generated_names(model: onnx.ModelProto) -> dict[str, str]:
    """Give every tensor named like ORT's fusions name theirs (:data:`ORT_GENERATED_NAMES`,
    optionally ``_token_<n>``) a name of ours, everywhere it appears (subgraphs included); graph
    inputs and outputs keep theirs (callers bind them by name). Returns old -> new."""
    graph = model.graph
    interface = {vi.name for vi in ir.graph_inputs(model)} | {vi.name for vi in graph.output}
    names = _tensor_names(graph)
    mapping: dict[str, str] = {}
    for name in sorted(names):
        if name not in interface and _ORT_GENERATED.fullmatch(name):
            new = RENAMED_PREFIX + name
            while new in names or new in mapping.values():
                new += "_"
            mapping[name] = new
    if mapping:
        ir.rename_tensors(graph, mapping)
    return mapping


def _tensor_names(graph: onnx.GraphProto) -> set[str]:
    names = {t.name for t in graph.initializer} | {t.values.name for t in graph.sparse_initializer}
    names |= {vi.name for vi in (*graph.input, *graph.output, *graph.value_info)}
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
        for sub in _subgraphs(node):
            names |= _tensor_names(sub)
    names.discard("")
    return names


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    found = []
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            found.append(attr.g)
        elif attr.type == onnx.AttributeProto.GRAPHS:
            found.extend(attr.graphs)
    return found


