"""The benchmark's models: how each is built, its inputs, and its PyTorch twin.

Shared by the suite (``runner``), the other benchmarks and ``tests/gpu/test_policies_cuda.py``. Models come from code, not from
files, because the GPU machine has no network: ResNet-50 (torchvision), BERT-base and GPT-2 small
(transformers configs, random weights) are exported with torch there; the "odd" models (layers
1000/1001 wide, 3 input channels) are written with ``onnx.helper`` and need no torch; corpus
models are read from a folder of cached wheels' ``.onnx`` files (``--corpus-dir``); having no
PyTorch source, their PyTorch twin is the ONNX file converted by onnx2torch (``onnx_twin``).

Exports are cached under ``$ONNXCAMPO_BENCH_CACHE`` (default ``/tmp/onnxcampo-bench``), keyed by
model, batch and purpose, so consecutive runs on the GPU machine reuse them while /tmp lives.

Everything here is importable without torch; torch is imported inside the builders that need it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 10  # ORT 1.31 accepts <= 13; onnx 1.23 would write 14 (DESIGN.md)


def cache_dir() -> Path:
    path = Path(os.environ.get("ONNXCAMPO_BENCH_CACHE", "/tmp/onnxcampo-bench"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class Built:
    """One model ready to measure at one batch.

    ``path``: the fp32 ONNX file. ``feeds``: the inputs (same for every policy; attention masks
    hold zeros, ids are in range). ``labels``: class indices for training (``None`` when the
    model is built for inference). ``torch_module``: a zero-argument factory returning
    ``(module, inputs, labels)`` as torch CPU tensors for the PyTorch baselines, or ``None``.
    """

    key: str
    batch: int
    path: Path
    feeds: dict[str, np.ndarray]
    labels: np.ndarray | None = None
    torch_module: Callable | None = None
    shape_note: str = ""
    build_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    lr: float = 0.01  # the step graph's SGD learning rate (the PyTorch twins use the same)
    # sample(index) -> feeds and labels of another batch (index >= 1), drawn the way ``feeds`` and
    # ``labels`` are; for runs over several batches (``loss_curves``). None: no others.
    sample: Callable[[int], dict[str, np.ndarray]] | None = None

    def training_batch(self, index: int = 0) -> dict[str, np.ndarray]:
        """Feeds and labels of batch ``index``: 0 is the benchmark's own (``feeds``, ``labels``),
        the others come from ``sample(index)`` (seeded by the index, so every run and variant
        gets the same ones)."""
        if self.labels is None:
            raise ValueError(f"{self.key} was built for inference: it has no labels")
        if index == 0:
            return {**self.feeds, "labels": self.labels}
        if self.sample is None:
            raise ValueError(f"{self.key} has only the one batch (no sample())")
        return self.sample(index)

    @property
    def input_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(a.shape) for name, a in self.feeds.items()}


@dataclass(frozen=True)
class ModelSpec:
    """A model of the suite: inference batches, the training batch (``None``: no training)."""

    key: str
    infer_batches: tuple[int, ...]
    train_batch: int | None
    build: Callable[..., Built]  # build(batch, training=bool, quick=bool) -> Built
    needs_torch: bool = False
    description: str = ""


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _finish(model: onnx.ModelProto) -> onnx.ModelProto:
    model.ir_version = min(model.ir_version, IR_VERSION) if model.ir_version else IR_VERSION
    return model


def _save(model: onnx.ModelProto, path: Path) -> Path:
    tmp = path.with_suffix(".tmp")
    onnx.save(model, str(tmp))
    tmp.replace(path)
    return path


SAMPLE_SEED = 17  # with the batch index, the seed of the extra batches (Built.sample)


def sample_rng(index: int) -> np.random.Generator:
    """The generator of extra batch ``index`` (>= 1): a stream of its own, apart from the seeds
    (0, 1, 2) that the benchmark's own feeds and labels come from and from every other index."""
    return np.random.default_rng([SAMPLE_SEED, index])


def _feeds_and_labels(batch: dict[str, np.ndarray], training: bool) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """A drawn batch split into the model's feeds and its labels (None when not training)."""
    feeds = dict(batch)
    labels = feeds.pop("labels")
    return feeds, labels if training else None


def hf_feeds(batch: int, seq: int, vocab: int, seed: int | np.random.Generator = 0) -> dict[str, np.ndarray]:
    """Token ids in range and an attention mask with zeros (padded tails on most rows).

    Zeros matter: the masked path (a large negative added before Softmax) is what overflows
    when converted carelessly to fp16, and all-ones masks never exercise it.
    """
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), np.int64)
    for row in range(batch):
        pad = (row % 4) * seq // 8  # rows padded by 0, 1/8, 2/8, 3/8 of the sequence
        if pad:
            mask[row, seq - pad:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def export_torch(module, args: tuple, path: Path, input_names: list[str], output_names: list[str]) -> Path:
    """``torch.onnx.export`` (TorchScript exporter, opset 17, static shapes) into ``path``."""
    import torch

    module = module.eval()
    tmp = path.with_suffix(".export.onnx")
    with torch.no_grad():
        torch.onnx.export(module, args, str(tmp), input_names=input_names, output_names=output_names,
                          opset_version=OPSET, dynamo=False, do_constant_folding=True)
    model = onnx.load(str(tmp))
    tmp.unlink()
    return _save(_finish(model), path)


def export_for_training(module, args: tuple, path: Path, input_names: list[str], output_names: list[str]) -> Path:
    """``onnxcampo.training.export`` (the default exporter): every parameter one initializer named
    after it, tied ones once, BatchNorm in training mode, nothing folded."""
    from onnxcampo.training.export import export

    tmp = path.with_suffix(".export.onnx")
    export(module, args, tmp, input_names=input_names, output_names=output_names)
    model = onnx.load(str(tmp))
    tmp.unlink()
    return _save(_finish(model), path)


class _HFWrapper:
    """Builds a torch module returning one tensor from a transformers model (lazy torch import)."""

    @staticmethod
    def make(inner, output: str):
        import torch

        class Wrapper(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, input_ids, attention_mask):
                out = self.inner(input_ids=input_ids, attention_mask=attention_mask)
                return getattr(out, output)

        return Wrapper(inner)


def distinct_parameters(module, seed: int = 0):
    """Add small seeded noise to every parameter, in place; returns the module.

    Freshly initialised models hold many equal tensors (LayerNorm weights all ones, biases all
    zeros), and the TorchScript exporter stores equal initializers once: the step graph would then
    train one tensor shared by every layer while PyTorch trains each. Distinct values keep the
    ONNX model's weights one to one with the module's parameters.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return module


def fold_batchnorm(module):
    """Fold every eval-mode BatchNorm2d into the Conv2d before it (torchvision ResNet layout), in place.

    The exporter folds them anyway in eval mode; folding first gives the PyTorch baseline the
    same layers and parameters as the ONNX model (conv weights and biases, no BatchNorm).
    """
    import torch
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    def fold(parent, conv_name, bn_name):
        conv, bn = getattr(parent, conv_name), getattr(parent, bn_name)
        setattr(parent, conv_name, fuse_conv_bn_eval(conv.eval(), bn.eval()))
        setattr(parent, bn_name, torch.nn.Identity())

    for parent in list(module.modules()):
        for index in (None, 1, 2, 3):
            conv, bn = ("conv1", "bn1") if index is None else (f"conv{index}", f"bn{index}")
            if isinstance(getattr(parent, conv, None), torch.nn.Conv2d) and isinstance(getattr(parent, bn, None), torch.nn.BatchNorm2d):
                fold(parent, conv, bn)
        down = getattr(parent, "downsample", None)
        if isinstance(down, torch.nn.Sequential) and len(down) == 2 and isinstance(down[1], torch.nn.BatchNorm2d):
            parent.downsample = torch.nn.Sequential(fuse_conv_bn_eval(down[0].eval(), down[1].eval()))
    left = [n for n, m in module.named_modules() if isinstance(m, torch.nn.BatchNorm2d)]
    if left:
        raise ValueError(f"BatchNorm layers not folded: {left[:3]}")
    return module


def export_hf(name: str, build, batch: int, seq: int, vocab: int, directory: Path, *, output: str = "last_hidden_state",
              seed: int = 0) -> tuple[onnx.ModelProto, dict[str, np.ndarray], dict[str, tuple[int, ...]]]:
    """Export a transformers model (``build()`` returns it) with inputs (input_ids, attention_mask).

    Returns the loaded model, the feeds and the input shapes. Used by ``gpu_check.py`` (hidden
    states) and by the benchmark (hidden states for inference, logits for training).
    """
    import torch

    torch.manual_seed(seed)
    module = _HFWrapper.make(build().eval(), output)
    feeds = hf_feeds(batch, seq, vocab, seed)
    args = (torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["attention_mask"]))
    path = directory / f"{name}.onnx"
    export_torch(module, args, path, ["input_ids", "attention_mask"], ["output"])
    model = onnx.load(str(path))
    return model, feeds, {k: v.shape for k, v in feeds.items()}


def _cached(name: str, make: Callable[[Path], None]) -> tuple[Path, float]:
    """The cached file ``name`` in the cache, made by ``make(path)`` when missing; (path, build s)."""
    import time

    path = cache_dir() / name
    if path.is_file():
        return path, 0.0
    start = time.perf_counter()
    make(path)
    return path, time.perf_counter() - start


# --------------------------------------------------------------------------------------------
# odd models: onnx.helper, no torch
# --------------------------------------------------------------------------------------------


def _dense_weights(widths: list[int], seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [((rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32),
             (0.01 * rng.standard_normal(b)).astype(np.float32)) for a, b in zip(widths, widths[1:])]


def odd_mlp_model(batch: int, widths: list[int], seed: int = 0) -> onnx.ModelProto:
    """x[batch, w0] -> (MatMul + Add + Relu) ... -> logits[batch, w_last]; no Relu at the end."""
    nodes, inits = [], []
    current = "x"
    layers = _dense_weights(widths, seed)
    for i, (w, b) in enumerate(layers):
        inits += [numpy_helper.from_array(w, f"fc{i}.weight"), numpy_helper.from_array(b, f"fc{i}.bias")]
        nodes.append(helper.make_node("MatMul", [current, f"fc{i}.weight"], [f"fc{i}/mm"], name=f"fc{i}/MatMul"))
        nodes.append(helper.make_node("Add", [f"fc{i}/mm", f"fc{i}.bias"], [f"fc{i}/out"], name=f"fc{i}/Add"))
        current = f"fc{i}/out"
        if i < len(layers) - 1:
            nodes.append(helper.make_node("Relu", [current], [f"fc{i}/relu"], name=f"fc{i}/Relu"))
            current = f"fc{i}/relu"
    nodes.append(helper.make_node("Identity", [current], ["logits"], name="output"))
    graph = helper.make_graph(nodes, "odd_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, widths[0]])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, widths[-1]])], inits)
    return _finish(helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)]))


def odd_cnn_model(batch: int, channels: list[int], size: int, classes: int, seed: int = 0) -> onnx.ModelProto:
    """x[batch, 3, size, size] -> (Conv 3x3 stride 2 + Relu) per channel step -> GAP -> Gemm."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    current = "x"
    for i, (cin, cout) in enumerate(zip(channels, channels[1:])):
        w = (rng.standard_normal((cout, cin, 3, 3)) / np.sqrt(cin * 9)).astype(np.float32)
        b = (0.01 * rng.standard_normal(cout)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"conv{i}.weight"), numpy_helper.from_array(b, f"conv{i}.bias")]
        nodes.append(helper.make_node("Conv", [current, f"conv{i}.weight", f"conv{i}.bias"], [f"conv{i}/out"],
                                      name=f"conv{i}/Conv", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]))
        nodes.append(helper.make_node("Relu", [f"conv{i}/out"], [f"conv{i}/relu"], name=f"conv{i}/Relu"))
        current = f"conv{i}/relu"
    fw = (rng.standard_normal((channels[-1], classes)) / np.sqrt(channels[-1])).astype(np.float32)
    fb = (0.01 * rng.standard_normal(classes)).astype(np.float32)
    inits += [numpy_helper.from_array(fw, "fc.weight"), numpy_helper.from_array(fb, "fc.bias")]
    nodes += [
        helper.make_node("GlobalAveragePool", [current], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten", axis=1),
        helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["logits"], name="fc/Gemm"),
    ]
    graph = helper.make_graph(nodes, "odd_cnn",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, channels[0], size, size])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])], inits)
    return _finish(helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)]))


def _torch_twin(model_path: Path, feeds: dict[str, np.ndarray], labels: np.ndarray | None):
    """A torch module with the ONNX model's weights, for the helper-built odd models."""
    def make():
        import torch

        model = onnx.load(str(model_path))
        weights = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in model.graph.initializer}

        class Twin(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.params = torch.nn.ParameterDict({k.replace(".", "_"): torch.nn.Parameter(v) for k, v in weights.items()})
                self.ops = [(n.op_type, list(n.input), list(n.output), n) for n in model.graph.node]

            def forward(self, x):
                env = {"x": x}
                get = lambda name: env[name] if name in env else self.params[name.replace(".", "_")]  # noqa: E731
                for op, ins, outs, node in self.ops:
                    a = [get(i) for i in ins]
                    if op == "MatMul":
                        y = a[0] @ a[1]
                    elif op == "Add":
                        y = a[0] + a[1]
                    elif op == "Relu":
                        y = torch.relu(a[0])
                    elif op == "Identity":
                        y = a[0]
                    elif op == "Conv":
                        y = torch.nn.functional.conv2d(a[0], a[1], a[2], stride=2, padding=1)
                    elif op == "GlobalAveragePool":
                        y = a[0].mean(dim=(2, 3), keepdim=True)
                    elif op == "Flatten":
                        y = a[0].flatten(1)
                    elif op == "Gemm":
                        y = a[0] @ a[1] + a[2]
                    else:  # pragma: no cover - the odd models use only the ops above
                        raise NotImplementedError(op)
                    env[outs[0]] = y
                return env[model.graph.output[0].name]

        inputs = {name: torch.from_numpy(value) for name, value in feeds.items()}
        return Twin(), inputs, None if labels is None else torch.from_numpy(labels)
    return make


def _odd_mlp(batch: int, *, training: bool = False, quick: bool = False) -> Built:
    widths = [33, 32, 31, 9] if quick else [1001, 1000, 1001, 1000, 1001]
    name = f"odd_mlp-b{batch}{'-quick' if quick else ''}.onnx"
    path, seconds = _cached(name, lambda p: _save(odd_mlp_model(batch, widths), p))

    def draw(rng):
        return {"x": rng.standard_normal((batch, widths[0])).astype(np.float32),
                "labels": rng.integers(0, widths[-1], batch, dtype=np.int64)}
    feeds, labels = _feeds_and_labels(draw(np.random.default_rng(1)), training)
    return Built("odd_mlp", batch, path, feeds, labels, _torch_twin(path, feeds, labels), build_s=seconds,
                 shape_note=f"widths {'-'.join(map(str, widths))}", sample=lambda index: draw(sample_rng(index)))


def _odd_cnn(batch: int, *, training: bool = False, quick: bool = False) -> Built:
    channels, size, classes = ([3, 5, 7], 16, 9) if quick else ([3, 63, 127, 255], 112, 1001)
    name = f"odd_cnn-b{batch}{'-quick' if quick else ''}.onnx"
    path, seconds = _cached(name, lambda p: _save(odd_cnn_model(batch, channels, size, classes), p))

    def draw(rng):
        return {"x": rng.standard_normal((batch, 3, size, size)).astype(np.float32),
                "labels": rng.integers(0, classes, batch, dtype=np.int64)}
    feeds, labels = _feeds_and_labels(draw(np.random.default_rng(1)), training)
    return Built("odd_cnn", batch, path, feeds, labels, _torch_twin(path, feeds, labels), build_s=seconds,
                 shape_note=f"channels {'-'.join(map(str, channels))}, {size}x{size}, {classes} classes",
                 sample=lambda index: draw(sample_rng(index)))


# --------------------------------------------------------------------------------------------
# torch-exported models
# --------------------------------------------------------------------------------------------


def _resnet50(batch: int, *, training: bool = False, quick: bool = False) -> Built:
    size = 32 if quick else 224
    arch = "resnet18" if quick else "resnet50"

    def module():
        import torch
        import torchvision

        torch.manual_seed(0)
        # zero_init_residual (each block's last BatchNorm scale 0, here 0 + the seeded noise): the
        # folded model starts near identity per block. With the default scale 1 and BatchNorm folded
        # (no normalisation left) the logits start in the thousands and SGD diverges at once.
        net = getattr(torchvision.models, arch)(weights=None, zero_init_residual=True)
        if training:  # as PyTorch users train it: BatchNorm in training mode, exported for training
            return net.train()
        return fold_batchnorm(distinct_parameters(net.eval()))

    def draw(rng):
        return {"x": rng.standard_normal((batch, 3, size, size)).astype(np.float32),
                "labels": rng.integers(0, 1000, batch, dtype=np.int64)}
    feeds, labels = _feeds_and_labels(draw(np.random.default_rng(1)), training)

    def make(path: Path) -> None:
        import torch

        if training:
            export_for_training(module(), (torch.from_numpy(feeds["x"]),), path, ["x"], ["logits"])
        else:
            export_torch(module(), (torch.from_numpy(feeds["x"]),), path, ["x"], ["logits"])

    path, seconds = _cached(f"{arch}-zir-b{batch}-{size}{'-bntrain' if training else ''}.onnx", make)

    def twin():
        import torch

        return module(), {"x": torch.from_numpy(feeds["x"])}, None if labels is None else torch.from_numpy(labels)
    # lr 1e-3: at 1e-2 (momentum 0.9) the loss on one batch of 8 jumped 2.3 -> 11.8 within 12 steps
    note = f"{arch} {size}x{size}" + (", BatchNorm training" if training else "")
    return Built("resnet50", batch, path, feeds, labels, twin, build_s=seconds, shape_note=note,
                 lr=1e-3, sample=lambda index: draw(sample_rng(index)))


def _hf_model(key: str, batch: int, training: bool, quick: bool) -> Built:
    """BERT-base (inference: hidden states; training: 2-class sequence classifier) or GPT-2 small
    with its LM head (logits over the unaligned vocabulary 50257), random weights, eager attention,
    dropout off (eval mode, as the ONNX export and the onnx-ad step graph compute)."""
    small = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128) if quick else {}
    if key == "minilm":  # MiniLM-L3-H384 (all-MiniLM-L6-v2's family, cut to 3 layers): a BERT of width 384
        small = small or dict(num_hidden_layers=3, hidden_size=384, num_attention_heads=12, intermediate_size=1536)
    if key in ("bert", "minilm"):
        seq, vocab = (16 if quick else 128), 30522

        def module():
            import torch
            from transformers import BertConfig, BertForSequenceClassification, BertModel

            torch.manual_seed(0)
            config = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2,
                                attn_implementation="eager", **small)
            inner = (BertForSequenceClassification if training else BertModel)(config)
            if training:  # exported for training: every parameter its own initializer, by name
                return _HFWrapper.make(inner.train(), "logits")
            return _HFWrapper.make(distinct_parameters(inner.eval()), "last_hidden_state")
        classes, label_shape = 2, (batch,)
    else:
        seq, vocab = (16 if quick else 256), 50257
        gpt_small = dict(n_layer=2, n_embd=64, n_head=2) if quick else {}

        def module():
            import torch
            from transformers import GPT2Config, GPT2LMHeadModel

            torch.manual_seed(0)
            # training: GPT-2 as it is, its LM head tied to the token embedding, exported for training
            # (the tie kept); inference: untied, the inference export's merged equal values kept apart
            config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
                                tie_word_embeddings=training, **gpt_small)
            if training:
                return _HFWrapper.make(GPT2LMHeadModel(config).train(), "logits")
            return _HFWrapper.make(distinct_parameters(GPT2LMHeadModel(config).eval()), "logits")
        classes, label_shape = vocab, (batch, seq)
    feeds = hf_feeds(batch, seq, vocab)
    labels = np.random.default_rng(2).integers(0, classes, label_shape, dtype=np.int64) if training else None

    def sample(index: int) -> dict[str, np.ndarray]:  # random tokens (the same masks), random labels
        rng = sample_rng(index)
        return {**hf_feeds(batch, seq, vocab, rng), "labels": rng.integers(0, classes, label_shape, dtype=np.int64)}

    def make(path: Path) -> None:
        import torch

        args = (torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["attention_mask"]))
        if training:
            export_for_training(module(), args, path, ["input_ids", "attention_mask"], ["logits"])
        else:
            export_torch(module(), args, path, ["input_ids", "attention_mask"], ["logits" if key == "gpt2" else "hidden"])

    purpose = "trainexport" if training else "fwd"
    path, seconds = _cached(f"{key}-b{batch}-s{seq}-{purpose}{'-quick' if quick else ''}.onnx", make)

    def twin():
        import torch

        inputs = {k: torch.from_numpy(v) for k, v in feeds.items()}
        return module(), inputs, None if labels is None else torch.from_numpy(labels)
    note = f"s{seq}" + ((" (tied LM head, vocab 50257)" if training else " (untied LM head, vocab 50257)") if key == "gpt2"
                        else (" (2-class head)" if training else " (hidden states)"))
    return Built(key, batch, path, feeds, labels, twin, build_s=seconds, shape_note=note, sample=sample)


def _bert(batch: int, *, training: bool = False, quick: bool = False) -> Built:
    return _hf_model("bert", batch, training, quick)


def _minilm(batch: int, *, training: bool = False, quick: bool = False) -> Built:
    return _hf_model("minilm", batch, training, quick)


def _gpt2(batch: int, *, training: bool = False, quick: bool = False) -> Built:
    return _hf_model("gpt2", batch, training, quick)


# --------------------------------------------------------------------------------------------
# corpus models (CORPUS.md), read from a folder laid out like the corpus cache
# --------------------------------------------------------------------------------------------

# key -> (inference batches (1 and, where the batch dim is dynamic, a large one), training batch)
CORPUS_BENCH = {
    "ppocr_det": ((1, 8, 16), None),
    "ppocr_rec": ((1, 32), 16),
    "ppocr_cls": ((1,), None),  # its file fixes the batch dim at 1 (measured: every policy unavailable at 64)
    "magika": ((1, 64, 256), 64),
    "layout_cdla": ((1,), None),
    "silero_vad_v6_fw": ((8,), None),
}


# trained models whose logits are large: SGD momentum at 0.01 on random labels diverges (NaN in fp32
# within 11 steps for ppocr_rec, also at 0.001); 1e-4 keeps the 55 compared steps finite
CORPUS_LR = {"ppocr_rec": float(os.environ.get("BENCH_PPOCR_LR", "0.0001"))}


def corpus_module():
    from onnxcampo.benchmarks import corpus

    return corpus


def corpus_files(keys=tuple(CORPUS_BENCH)) -> list[tuple[str, Path, Path]]:
    """(key, path in the local cache, path relative to the cache root) of the benchmarked corpus models."""
    corpus = corpus_module()
    out = []
    for key in keys:
        entry = corpus.get(key)
        out.append((key, corpus.cached_path(entry), corpus.cached_path(entry).relative_to(corpus.cache_root())))
    return out


def _corpus(key: str):
    def build(batch: int, *, training: bool = False, quick: bool = False) -> Built:
        import dataclasses

        corpus = corpus_module()
        entry = corpus.get(key)
        source = corpus.cached_path(entry)
        if not source.is_file():
            raise FileNotFoundError(f"corpus model {key} not found at {source} (pass --corpus-dir)")
        original = onnx.load(str(source))
        shapes = {name: tuple(dims) for name, dims in entry.input_shapes.items()}
        pinned_batch = next((dims[0] for dims in shapes.values() if dims), 1)
        if batch != pinned_batch:
            dynamic = [vi.name for vi in original.graph.input if vi.name in shapes and shapes[vi.name]
                       and not vi.type.tensor_type.shape.dim[0].dim_value]
            if not dynamic:
                from onnxcampo.benchmarks.policies import Unavailable

                raise Unavailable(f"corpus model {key}: its batch dim is fixed; no input has a dynamic one to set to {batch}")
            shapes = {name: (batch, *dims[1:]) if name in dynamic else dims for name, dims in shapes.items()}
        entry = dataclasses.replace(entry, input_shapes=shapes)
        model = corpus.pin_input_shapes(original, entry)
        del model.graph.value_info[:]  # shapes recorded for another batch would contradict the pins
        note = ", ".join(f"{k}{list(v)}" for k, v in shapes.items())
        if training:
            cut = logits_before_softmax(model)
            if cut:
                note += f" (trained on the logits: final {cut} removed)"
        model = onnx.shape_inference.infer_shapes(model)
        path = cache_dir() / f"corpus-{key}-b{batch}{'-train' if training else ''}.onnx"
        _save(_finish(model), path)
        feeds = corpus.make_inputs(entry, proto=model)
        labels, sample = None, None
        if training:
            dims = _output_shape(model, path, feeds)
            labels = np.random.default_rng(2).integers(0, dims[-1], dims[:-1], dtype=np.int64)

            def sample(index: int) -> dict[str, np.ndarray]:
                seed = [SAMPLE_SEED, index]  # the corpus entry's value rules, another seed
                return {**corpus.make_inputs(entry, seed=seed, proto=model),
                        "labels": sample_rng(index).integers(0, dims[-1], dims[:-1], dtype=np.int64)}
        return Built(key, batch, path, feeds, labels, onnx_twin(path, feeds, labels), shape_note=note,
                     lr=CORPUS_LR.get(key, 0.01), sample=sample)
    return build


def onnx_twin(model_path: Path, feeds: dict[str, np.ndarray], labels: np.ndarray | None):
    """A torch twin converted from the ONNX file itself by onnx2torch, for models with no PyTorch source.

    It converts the file the step graph trains and trains the same weights (``_train_like_step_graph``).
    The module takes the ONNX inputs by name and returns the first output (the logits). onnx2torch
    and torch are imported when the twin is made; missing, or a model they cannot convert, is
    ``Unavailable`` with the reason, so the row records why. Shapes computed in the graph are
    fixed to the feeds' (``fixed_shapes``), so that ``torch.compile`` can trace the module.
    """
    def make():
        from onnxcampo.benchmarks.policies import Unavailable

        try:
            import onnx2torch
            import torch
        except ModuleNotFoundError as exc:
            raise Unavailable(f"{exc.name} not installed (needed for the onnx2torch twin of an ONNX-only model)") from None
        from onnxcampo.training.trainable import constants_to_initializers, select_trainable

        model = onnx.load(str(model_path))
        constants_to_initializers(model)  # Paddle's Constant-node weights: the step graph lifts them too
        weights = set(select_trainable(model).weights)
        model = _with_shapes(model)
        try:
            _add_converters()
            graph_module = onnx2torch.convert(model, attach_onnx_mapping=True)
        except Exception as exc:  # noqa: BLE001 - the converter's limits: say which op and why
            op = _unconvertible(model)
            raise Unavailable(f"onnx2torch cannot convert {op}: it has no converter for it" if op else
                              f"onnx2torch cannot convert {model_path.name}: {exc.__class__.__name__}: {str(exc)[:300]}"
                              ) from None
        _train_like_step_graph(graph_module, model, weights)
        initializers = {t.name for t in model.graph.initializer}
        names = [i.name for i in model.graph.input if i.name not in initializers]
        inputs = {name: torch.from_numpy(value) for name, value in feeds.items()}
        fixed_shapes(graph_module, [inputs[name] for name in names])

        class Twin(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.converted = graph_module

            def forward(self, **inputs):
                out = self.converted(*(inputs[name] for name in names))  # placeholders in graph-input order
                return out[0] if isinstance(out, (tuple, list)) else out

        return Twin(), inputs, None if labels is None else torch.from_numpy(labels)
    return make


def _with_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with the shapes ORT's symbolic inference finds, or as it is where that gives up.

    onnx2torch's BatchNorm converter needs its input's rank; onnx's own inference (which the
    converter runs) stops at Reshapes to computed shapes, as in ppocr_rec, and ORT's follows them.
    """
    import contextlib
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, contextlib.chdir(tmp):  # where it gives up it saves a model in the cwd
        try:
            from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference  # needs sympy (torch has it)

            return SymbolicShapeInference.infer_shapes(model) or model
        except Exception:  # noqa: BLE001 - incomplete (or no sympy): the converter's own inference may do
            return model


def fixed_shapes(graph_module, inputs: list) -> None:
    """Give onnx2torch's shape-reading modules Python ints, so that dynamo can trace them (in place).

    onnx2torch's Reshape, Expand, Squeeze and Slice read the target shape, axes or bounds from
    tensors at run time (``torch.Size(tensor)``), which dynamo cannot trace ("torch.Size() takes an
    iterable of 'int' (item 0 is 'FakeTensor')"). The twin's input shapes are pinned, so where that
    tensor depends on nothing but constants and tensor shapes it has one value: one run on
    ``inputs`` records it, and the module becomes a call with ints: Reshape and Squeeze a reshape
    to the shape they produced, Expand an ``expand`` to it (onnx2torch multiplies by ones of that
    shape: the same values, without the copy), Slice onnx2torch's own indexing with the bounds it
    computes. The shape subgraphs left unused are removed. A tensor that depends on data or on a
    parameter is left as it was, and so are the parameters.
    """
    import torch
    from onnx2torch.node_converters.slice import _do_slice, _get_slices

    graph = graph_module.graph
    constant: set = set()  # nodes whose value is fixed once the input shapes are
    for node in graph.nodes:
        if node.op == "get_attr":
            owner, attr = node.target.rpartition(".")[::2]
            if not isinstance(getattr(graph_module.get_submodule(owner), attr), torch.nn.Parameter):
                constant.add(node)
        elif node.op == "call_module":
            module = graph_module.get_submodule(node.target)
            if type(module).__name__ == "OnnxShape" or (
                    next(module.parameters(), None) is None and all(a in constant for a in node.all_input_nodes)):
                constant.add(node)
    kinds = {"OnnxReshape": "reshape", "OnnxSqueezeDynamicAxes": "reshape", "OnnxExpand": "expand",
             "OnnxSlice": "slice"}
    targets = {}
    for node in graph.nodes:
        kind = kinds.get(type(graph_module.get_submodule(node.target)).__name__) if node.op == "call_module" else None
        if kind and len(node.args) > 1 and not node.kwargs and all(a in constant for a in node.args[1:]):
            targets[node] = kind
    if not targets:
        return
    wanted = {a for node in targets for a in node.args[1:]}
    shapes, values = {}, {}  # the targets' output shapes, their shape arguments' values

    class Record(torch.fx.Interpreter):
        def run_node(self, node):
            out = super().run_node(node)
            if node in targets:
                shapes[node] = tuple(out.shape)
            if node in wanted:
                values[node] = out
            return out

    training = graph_module.training
    with torch.no_grad():  # in eval mode: a training-mode BatchNorm would update its running statistics
        Record(graph_module.eval()).run(*inputs)
    graph_module.train(training)

    def ints(part):
        if not isinstance(part, slice):
            return part
        return slice(*(None if v is None else int(v) for v in (part.start, part.stop, part.step)))

    calls = {}
    for node, kind in targets.items():
        x = node.args[0]
        if kind == "slice":  # the bounds onnx2torch's OnnxSlice computes, as Python ints
            flips, pos, neg = _get_slices(*(values[a] for a in node.args[1:]), *[None] * (5 - len(node.args)))
            calls[node] = ("call_function", _do_slice,
                           (x, [int(d) for d in flips], tuple(map(ints, pos)), tuple(map(ints, neg))))
        elif kind == "reshape":
            calls[node] = ("call_function", torch.reshape, (x, shapes[node]))
        else:
            calls[node] = ("call_method", "expand", (x, shapes[node]))
    for node, call in calls.items():  # all made before any is replaced: a target may feed another
        with graph.inserting_before(node):
            calls[node] = graph.create_node(*call)
    for node, new in calls.items():
        node.replace_all_uses_with(new)
        graph.erase_node(node)
    graph.eliminate_dead_code()
    graph_module.delete_all_unused_submodules()
    graph_module.recompile()


def _add_converters() -> None:
    """Register what onnx2torch 1.5.15 lacks and the trained corpus models use (GlobalMaxPool:
    magika's conv block), through its ``add_converter``; once, and not over a converter it has."""
    import torch
    from onnx2torch.node_converters.registry import add_converter, get_converter
    from onnx2torch.utils.common import OperationConverterResult, onnx_mapping_from_node

    try:
        get_converter("GlobalMaxPool", 1)
        return
    except NotImplementedError:
        pass

    class GlobalMaxPool(torch.nn.Module):
        def forward(self, x):
            return x.amax(dim=tuple(range(2, x.dim())), keepdim=True)

    add_converter(operation_type="GlobalMaxPool", version=1)(
        lambda node, graph: OperationConverterResult(GlobalMaxPool(), onnx_mapping_from_node(node)))


def _unconvertible(model: onnx.ModelProto) -> str | None:
    """The first op onnx2torch has no converter for, as ``op (opset N)``."""
    from onnx2torch.node_converters.registry import get_converter

    opsets = {o.domain: o.version for o in model.opset_import}
    for node in model.graph.node:
        try:
            get_converter(node.op_type, opsets[node.domain], node.domain)
        except NotImplementedError:
            return f"{node.op_type} (opset {opsets[node.domain]})"
    return None


def _train_like_step_graph(graph_module, model: onnx.ModelProto, weights: set[str]) -> None:
    """Make the converted module's trainable tensors the step graph's weights, one to one (in place).

    onnx2torch makes the initializers a Conv, Gemm or normalization absorbs that module's
    parameters, and every other initializer a buffer, one per use (magika's dense layers are
    MatMul/Add buffers: PyTorch would train nothing there). A weight used as a buffer becomes one
    parameter shared by its uses; an absorbed tensor the step graph freezes (a grouped Conv's
    weight, ``trainable.py``) stops requiring grad.
    """
    import math

    import torch
    from onnxcampo.benchmarks.policies import Unavailable

    producers = {out: node for node in model.graph.node for out in node.output}
    sizes = {t.name: math.prod(t.dims) for t in model.graph.initializer}
    trained: dict[str, torch.nn.Parameter] = {}
    for node in graph_module.graph.nodes:
        if node.op != "call_module":
            continue
        module = graph_module.get_submodule(node.target)
        mapping = module.onnx_mapping
        # the node's arguments are the mapping's inputs less the empty ones, in order (onnx2torch.convert)
        for value, arg in zip([v for v in mapping.inputs if v], [*node.args, *node.kwargs.values()]):
            if value in weights and isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
                owner, attr = arg.target.rsplit(".", 1)
                holder = graph_module.get_submodule(owner)
                tensor = getattr(holder, attr)
                delattr(holder, attr)
                holder.register_parameter(attr, trained.setdefault(value, torch.nn.Parameter(tensor)))
        absorbed = [v for v in producers[mapping.outputs[0]].input if v in sizes and v not in mapping.inputs]
        own = list(module.named_parameters(recurse=False))
        if len(own) > len(absorbed) or any(p.numel() != sizes[v] for (_, p), v in zip(own, absorbed)):
            raise Unavailable(f"onnx2torch's {type(module).__name__} for {node.target}: its parameters do not "
                              f"match the ONNX initializers {absorbed}")
        for (attr, param), value in zip(own, absorbed):
            if value not in weights:
                param.requires_grad_(False)
            elif value in trained and trained[value].shape == param.shape:
                setattr(module, attr, trained[value])
            else:
                trained.setdefault(value, param)
    missing = sorted(weights - set(trained))
    if missing:
        raise Unavailable(f"the onnx2torch module holds {len(missing)} of the step graph's weights as no tensor "
                          f"it can train ({', '.join(missing[:3])})")


def logits_before_softmax(model: onnx.ModelProto) -> str | None:
    """Make the first output the logits when the model ends in a softmax (in place); what was cut.

    Classifiers shipped for inference end in a Softmax (PaddleOCR) or a written-out one,
    ``Exp(x - max) / sum`` (magika, jax2tf). The step graph's cross-entropy would take those
    probabilities as logits: a loss stuck at log(classes) and gradients ~1/classes, nothing like
    training. The model's output becomes the softmax's input (the max shift is dropped:
    log-softmax does not change with it) and the nodes no longer needed are removed.
    """
    graph = model.graph
    producers = {out: node for node in graph.node for out in node.output}
    output = graph.output[0]
    node = producers.get(output.name)
    logits, cut = None, None
    if node is not None and node.op_type == "Softmax":
        logits, cut = node.input[0], "Softmax"
    elif node is not None and node.op_type == "Div" and getattr(producers.get(node.input[0]), "op_type", None) == "Exp":
        exp = producers[node.input[0]]
        shift = producers.get(exp.input[0])
        logits = shift.input[0] if shift is not None and shift.op_type == "Sub" else exp.input[0]
        cut = "Exp/ReduceSum/Div softmax"
    if logits is None:
        return None
    new_output = onnx.ValueInfoProto()
    new_output.CopyFrom(output)  # a softmax keeps its input's type and shape
    new_output.name = logits
    del graph.output[:]
    graph.output.append(new_output)
    needed, kept = {logits}, []
    for other in reversed(graph.node):
        if any(out in needed for out in other.output):
            kept.append(other)
            needed.update(other.input)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    used = {name for other in graph.node for name in other.input}
    initializers = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    del graph.value_info[:]
    return cut


def _output_shape(model: onnx.ModelProto, path: Path, feeds: dict[str, np.ndarray]) -> list[int]:
    """The static shape of the first output: from shape inference with data propagation, else one
    CPU run (graph outputs often keep symbolic dims that inference does not overwrite)."""
    from onnxcampo import ir

    name = model.graph.output[0].name
    info, _ = ir.infer_tensor_info(model)
    shape = info[name].shape if name in info else None
    if shape and None not in shape and all(d > 0 for d in shape):
        return list(shape)
    from onnxcampo.runtime import make_session

    session = make_session(path, provider="cpu", log_severity=3)
    return list(session.run([name], feeds)[0].shape)


# --------------------------------------------------------------------------------------------
# the suite
# --------------------------------------------------------------------------------------------

MODELS: dict[str, ModelSpec] = {
    spec.key: spec for spec in (
        ModelSpec("odd_mlp", (1, 4096), 1024, _odd_mlp, description="MLP 1001-1000-1001-1000-1001 (onnx.helper)"),
        ModelSpec("odd_cnn", (1, 128), 64, _odd_cnn,
                  description="CNN 3-63-127-255 channels, 3x3 stride 2, 112x112, 1001 classes (onnx.helper)"),
        ModelSpec("resnet50", (1, 64), 64, _resnet50, needs_torch=True, description="torchvision ResNet-50, 224x224"),
        ModelSpec("bert", (1, 32), 32, _bert, needs_torch=True, description="BERT-base, s128 (transformers, random init)"),
        ModelSpec("gpt2", (1, 8), 8, _gpt2, needs_torch=True, description="GPT-2 small + LM head (vocab 50257), s256"),
        ModelSpec("minilm", (1, 64), None, _minilm, needs_torch=True,
                  description="MiniLM-L3-H384-shaped BERT, s128 (transformers, random init)"),
        *(ModelSpec(key, batches, train, _corpus(key), description=f"corpus: {key}")
          for key, (batches, train) in CORPUS_BENCH.items()),
    )
}

QUICK_BATCHES = {"infer": (1, 4), "train": 4}
