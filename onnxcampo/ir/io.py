"""Reading and writing models: load and check, metadata, atomic writes (external data past 2 GB).

A model is read once (:func:`read_model`): checked by ``onnx.checker`` (ONNX Runtime's
default-domain training ops checked as foreign ones), its external data loaded, its opset
checked; every failure is one :class:`~onnxcampo.errors.ModelLoadError` line. A model is written
whole or not at all (:func:`save_model`): a temporary file in the same folder, test-loaded by ONNX
Runtime, then renamed. Checks and sessions that need the graph but not the weights' bytes get a
copy without them (:func:`without_weights`), so that a model of some hundred MB is not serialized
again for each.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import copy
import glob
import logging
import math
import os
import re
import secrets
import tempfile
from pathlib import Path

import onnx
import onnx.defs
from google.protobuf.message import DecodeError
from onnx import TensorProto

from onnxcampo import oplists
from onnxcampo.errors import ModelLoadError, OutputPathError, UnsupportedModelError

log = logging.getLogger(__name__)

MIN_OPSET = 11
_PROTOBUF_LIMIT = (1 << 31) - (1 << 20)
_FOREIGN_DOMAIN = "onnxcampo.ort_training"  # where check_model puts ORT's default-domain training ops
# Element types whose raw data has a size known from the dims (bytes per element): the initializers
# :func:`without_weights` may hold out.
ELEMENT_BYTES = {
    TensorProto.FLOAT: 4, TensorProto.FLOAT16: 2, TensorProto.DOUBLE: 8, TensorProto.BOOL: 1,
    TensorProto.INT8: 1, TensorProto.UINT8: 1, TensorProto.INT16: 2, TensorProto.UINT16: 2,
    TensorProto.INT32: 4, TensorProto.UINT32: 4, TensorProto.INT64: 8, TensorProto.UINT64: 8,
}
WEIGHTLESS_MIN_BYTES = 1024  # initializers this large are held out of a weightless copy
# check_model checks a model with this much weight data from a copy without it (see check_model)
WEIGHTLESS_CHECK_BYTES = 16 << 20
_CHECK_DATA = "onnxcampo-checked-without-data"  # the empty file a weightless copy's stubs name


def read_model(source: str | os.PathLike | onnx.ModelProto) -> tuple[onnx.ModelProto, Path | None]:
    """The model and the file it came from, checked by ``onnx.checker``; every failure is a
    :class:`ModelLoadError` or :class:`UnsupportedModelError` with a one-line message.

    A file is loaded, then checked as :func:`check_model` checks a model of ours: from a copy
    without its weights when they are large (never a second copy of them); a file with external
    data, or over 2 GB, is checked by path (the checker resolves the data where the file lies),
    and again in memory with ORT's default-domain training ops set aside when that fails.
    """
    if isinstance(source, onnx.ModelProto):
        model, path = copy.deepcopy(source), None
        invalid = None if exceeds_protobuf_limit(model) else _checker_error(model)
    else:
        path = Path(source)
        if not path.exists():
            raise ModelLoadError(f"{path}: no such file")
        if not path.is_file():
            raise ModelLoadError(f"{path}: not a file")
        try:
            model = onnx.load(str(path), load_external_data=False)
        except (DecodeError, ValueError, RuntimeError, OSError) as exc:
            raise ModelLoadError(f"{path}: not an ONNX model, or the file is truncated ({exc.__class__.__name__})") from None
        if model.ir_version == 0 or not model.HasField("graph"):
            raise ModelLoadError(f"{path}: not an ONNX model (no IR version or graph)")
        if _uses_external_data(model.graph) or path.stat().st_size >= _PROTOBUF_LIMIT:
            invalid = _checker_error(str(path))
            if invalid and ort_default_domain_nodes(model) and not exceeds_protobuf_limit(model):
                invalid = _checker_error(model)  # again, with ORT's default-domain training ops set aside
        else:
            invalid = _checker_error(model)
    where = str(path) if path else "model"
    if invalid:
        raise ModelLoadError(f"{where}: invalid ONNX model: {invalid}")
    if path is not None:
        try:
            onnx.load_external_data_for_model(model, str(path.parent))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: cannot read its external data: {exc}") from None
    _check_opset(model, where)
    repaired = repair_utf8(model)
    if repaired:
        names = dict((text, kind) for kind, text in reversed(repaired))  # each text once, its first field
        shown = ", ".join(f"{kind} '{text}'" for text, kind in list(names.items())[:3])
        log.warning("%s: %d string(s) not valid UTF-8 (%s%s): read with the bad bytes as \\xNN escapes, which the "
                    "written model keeps", where, len(names), shown, ", ..." if len(names) > 3 else "")
    return model, path


def repair_utf8(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """Make every string field of ``model`` valid UTF-8, in place; returns ``(field, new value)``
    of those changed.

    The checker and ONNX Runtime accept a node name (or any other string) that is not valid
    UTF-8; Python's protobuf hands such a field over as ``bytes``, on which the graph editing and
    the export fail. Each one becomes its text with the bad bytes as ``\\xNN`` escapes
    (``bytes.decode("utf-8", "backslashreplace")``), the same everywhere it occurs, so a tensor
    name stays connected; the written model has the escaped names (a protobuf string field
    cannot be given the original bytes back from Python). Tensor data (``raw_data``, string
    tensors' ``string_data``) are bytes fields and are not touched.
    """
    changed: list[tuple[str, str]] = []
    _repair_message(model, changed)
    return changed


_STRING = 9  # FieldDescriptor.TYPE_STRING
_TENSOR_STRINGS = ("name", "doc_string")  # a TensorProto's string fields (its data is left unread)


def _repair_message(message, changed: list[tuple[str, str]]) -> None:
    if isinstance(message, onnx.TensorProto):
        for name in _TENSOR_STRINGS:
            value = getattr(message, name)
            if isinstance(value, bytes):
                setattr(message, name, _decoded(value, changed, f"tensor {name}"))
        for entry in message.external_data:
            _repair_message(entry, changed)
        return
    kind = type(message).__name__.removesuffix("Proto").lower()
    for field, value in message.ListFields():
        repeated = _repeated(field)
        if field.type == _STRING:
            if repeated:
                if any(isinstance(item, bytes) for item in value):
                    fixed = [_decoded(item, changed, f"{kind} {field.name}") if isinstance(item, bytes) else item for item in value]
                    del value[:]
                    value.extend(fixed)
            elif isinstance(value, bytes):
                setattr(message, field.name, _decoded(value, changed, f"{kind} {field.name}"))
        elif field.message_type is not None:
            for item in value if repeated else (value,):
                _repair_message(item, changed)


def _decoded(value: bytes, changed: list[tuple[str, str]], kind: str) -> str:
    text = value.decode("utf-8", "backslashreplace")
    changed.append((kind, text))
    return text


def _checker_error(model: onnx.ModelProto | str) -> str | None:
    try:
        check_model(model)
    except (onnx.checker.ValidationError, ValueError, RuntimeError, OSError) as exc:
        text = str(exc).strip()
        return text.splitlines()[0] if text else exc.__class__.__name__
    return None


def ort_default_domain_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """Top-level nodes of ONNX Runtime training ops that sit in the default domain without being
    ONNX ops (MaxPoolGrad in ``generate_artifacts`` output; see ``oplists.ORT_DEFAULT_DOMAIN_OPS``)."""
    return [
        node for node in model.graph.node
        if node.domain in oplists.DEFAULT_DOMAINS and node.op_type in oplists.ORT_DEFAULT_DOMAIN_OPS
        and not onnx.defs.has(node.op_type)
    ]


def check_model(model: onnx.ModelProto | str, *, full_check: bool = False) -> None:
    """``onnx.checker.check_model``, except that ONNX Runtime's default-domain training ops are
    checked like ops of a foreign domain (the checker knows no schema for them; every other node
    is checked as usual). A path goes to the checker as it is (external data, > 2 GB);
    ``read_model`` checks such a model again in memory when the path check fails.

    A ModelProto with at least :data:`WEIGHTLESS_CHECK_BYTES` of weights is checked (without
    ``full_check``) from a copy whose weights are stubs stored in an empty external file, written
    to a temporary folder and checked by path: the checker reads an external tensor's location,
    never its bytes, and this path is taken only when every held-out tensor's raw data has exactly
    the size its type and dims give, which is all the checker asks of it: the verdict is the same,
    without the weights serialized for the checker. A model with external tensors of its own is
    checked in memory, as their location is resolved where the check runs.
    """
    if isinstance(model, str):
        onnx.checker.check_model(model, full_check=full_check)
        return
    if not full_check and not _uses_external_data(model.graph):
        stub, held = without_weights(model, location=_CHECK_DATA)
        if sum(map(declared_bytes, held.values())) >= WEIGHTLESS_CHECK_BYTES and all(
                len(tensor.raw_data) == declared_bytes(tensor) for tensor in held.values()):
            _set_aside_foreign_ops(stub)  # a copy of ours: set aside for good
            with tempfile.TemporaryDirectory(prefix="onnxcampo-check-") as folder:
                (Path(folder) / _CHECK_DATA).touch()
                path = Path(folder) / "model.onnx"
                path.write_bytes(stub.SerializeToString())
                onnx.checker.check_model(str(path))
            return
    foreign = ort_default_domain_nodes(model)
    if not foreign:
        onnx.checker.check_model(model, full_check=full_check)
        return
    # Our own copy of the model is borrowed for the check (no second copy of the weights).
    restore = _set_aside_foreign_ops(model)
    try:
        onnx.checker.check_model(model, full_check=full_check)
    finally:
        restore()


def _set_aside_foreign_ops(model: onnx.ModelProto):
    """Move ORT's default-domain training ops to :data:`_FOREIGN_DOMAIN` (declared); returns what
    puts them back."""
    foreign = ort_default_domain_nodes(model)
    declared = any(entry.domain == _FOREIGN_DOMAIN for entry in model.opset_import) or not foreign
    if not declared:
        model.opset_import.add(domain=_FOREIGN_DOMAIN, version=1)
    domains = [node.domain for node in foreign]
    for node in foreign:
        node.domain = _FOREIGN_DOMAIN

    def restore() -> None:
        for node, domain in zip(foreign, domains):
            node.domain = domain
        if not declared:
            del model.opset_import[len(model.opset_import) - 1]

    return restore


def without_weights(model: onnx.ModelProto, *, location: str,
                    min_bytes: int = WEIGHTLESS_MIN_BYTES) -> tuple[onnx.ModelProto, dict[str, onnx.TensorProto]]:
    """A copy of ``model`` whose large initializers are stubs, and those initializers of
    ``model`` by name (not copies: the caller must not change them while it uses them).

    Held out: a top-level initializer of a type in :data:`ELEMENT_BYTES` with its data in
    ``raw_data`` (no other value field, no segment) and at least ``min_bytes`` by its type and
    dims (:func:`declared_bytes`; the raw data is not read here, as reading it copies it: a caller
    to which its actual size matters compares it). Its stub has its name, type, dims, doc_string
    and metadata, and names ``location`` as the external file that stores it (``data_location``
    EXTERNAL). The rest of the model is copied as it is.
    """
    out = onnx.ModelProto()
    for field, value in model.ListFields():
        if field.name != "graph":
            _copy_field(out, field, value)
    graph = out.graph
    for field, value in model.graph.ListFields():
        if field.name != "initializer":
            _copy_field(graph, field, value)
    held: dict[str, onnx.TensorProto] = {}
    for tensor in model.graph.initializer:
        if not _held_out(tensor, min_bytes):
            graph.initializer.append(tensor)
            continue
        stub = graph.initializer.add()
        stub.name, stub.data_type, stub.doc_string = tensor.name, tensor.data_type, tensor.doc_string
        stub.dims.extend(tensor.dims)
        if hasattr(tensor, "metadata_props"):
            stub.metadata_props.extend(tensor.metadata_props)
        stub.data_location = TensorProto.EXTERNAL
        stub.external_data.add(key="location", value=location)
        held[tensor.name] = tensor
    return out, held


def _held_out(tensor: onnx.TensorProto, min_bytes: int) -> bool:
    return (tensor.data_type in ELEMENT_BYTES and tensor.data_location != TensorProto.EXTERNAL
            and not tensor.external_data and not tensor.HasField("segment") and tensor.HasField("raw_data")
            and not (tensor.float_data or tensor.int32_data or tensor.int64_data or tensor.double_data
                     or tensor.uint64_data or tensor.string_data)
            and declared_bytes(tensor) >= min_bytes)


def declared_bytes(tensor: onnx.TensorProto) -> int:
    """The size of a tensor of a type in :data:`ELEMENT_BYTES` as its type and dims give it."""
    return ELEMENT_BYTES[tensor.data_type] * math.prod(tensor.dims)


def _repeated(field) -> bool:
    return field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED


def _copy_field(target, field, value) -> None:
    if _repeated(field):
        getattr(target, field.name).extend(value)
    elif field.message_type is not None:
        getattr(target, field.name).CopyFrom(value)
    else:
        setattr(target, field.name, value)


def _uses_external_data(graph: onnx.GraphProto) -> bool:
    """Whether a tensor of the graph (subgraphs included) has its data in an external file."""
    tensors = [*graph.initializer, *(sparse.values for sparse in graph.sparse_initializer)]
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                tensors.append(attr.t)
            elif attr.type == onnx.AttributeProto.TENSORS:
                tensors.extend(attr.tensors)
            elif attr.type == onnx.AttributeProto.GRAPH and _uses_external_data(attr.g):
                return True
            elif attr.type == onnx.AttributeProto.GRAPHS and any(_uses_external_data(g) for g in attr.graphs):
                return True
    return any(tensor.data_location == TensorProto.EXTERNAL for tensor in tensors)


def _check_opset(model: onnx.ModelProto, where: str) -> None:
    opset = default_opset(model)
    if opset == 0 and not any(n.domain in ("", "ai.onnx") for n in model.graph.node):
        return  # no ONNX-domain op at all (ai.onnx.ml, preview.training, ...): no opset to judge
    if opset < MIN_OPSET:
        raise UnsupportedModelError(
            f"{where}: opset {opset} is older than {MIN_OPSET}; convert it first "
            f"(onnx.version_converter.convert_version(model, 17))"
        )
    if opset > onnx.defs.onnx_opset_version():
        raise UnsupportedModelError(
            f"{where}: opset {opset} is newer than this onnx ({onnx.__version__}) knows "
            f"({onnx.defs.onnx_opset_version()}); upgrade onnx"
        )


def metadata(model: onnx.ModelProto, key: str, default: str | None = None) -> str | None:
    """The value of metadata property ``key``, or ``default``."""
    return next((p.value for p in model.metadata_props if p.key == key), default)


def set_metadata(model: onnx.ModelProto, key: str, value: str) -> None:
    """Set metadata property ``key`` (replacing its value if present)."""
    for prop in model.metadata_props:
        if prop.key == key:
            prop.value = value
            return
    model.metadata_props.add(key=key, value=value)


def default_opset(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    return 0


def name_nodes(model: onnx.ModelProto) -> int:
    """Give every top-level node a unique name (ORT's profiler and the plan key on names)."""
    seen: set[str] = set()
    renamed = 0
    for index, node in enumerate(model.graph.node):
        if not node.name or node.name in seen:
            base = f"{node.op_type}_{index}"
            name = base
            while name in seen:
                name += "_"
            node.name = name
            renamed += 1
        seen.add(node.name)
    return renamed


def graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The inputs a caller must feed: graph inputs that are not also initializers.

    Old exporters list every weight as a graph input too; those have defaults and are skipped.
    """
    initializers = {t.name for t in model.graph.initializer}
    initializers.update(t.name for t in model.graph.sparse_initializer)
    return [vi for vi in model.graph.input if vi.name not in initializers]


def dynamic_inputs(model: onnx.ModelProto) -> list[str]:
    """The graph inputs (:func:`graph_inputs`, tensors) without a static shape: no shape, or a dim
    that is not a fixed number (0 included: a zero-size dim is a dim)."""
    return [vi.name for vi in graph_inputs(model) if vi.type.HasField("tensor_type") and (
        not vi.type.tensor_type.HasField("shape")
        or not all(d.HasField("dim_value") and d.dim_value >= 0 for d in vi.type.tensor_type.shape.dim))]


def check_output_path(output: str | os.PathLike, input_path: Path | None, *,
                      taken: tuple[str | os.PathLike, ...] = ()) -> Path:
    """``output`` as a path onnxcampo can write, checked before any work; else one
    :class:`OutputPathError` line. Refused: the input model itself (or a file the caller already
    writes, ``taken``: the model and its ``--report``), a folder, a path in a folder that does not
    exist or is not a folder, a folder where no file can be created (permissions, a read-only
    file system: probed by creating and removing a temporary file there, which also holds for
    root), and an existing output that is a folder's or cannot be replaced."""
    out = Path(output)
    if input_path is not None and out.resolve() == Path(input_path).resolve():
        raise OutputPathError(f"{out}: the output path is the input model; choose another path")
    for other in taken:
        if out.resolve() == Path(other).resolve():
            raise OutputPathError(f"{out}: already the path of another output ({other}); choose another path")
    if out.is_dir():
        raise OutputPathError(f"{out}: is a folder; give a file name for the output")
    parent = out.parent
    if not parent.exists():
        raise OutputPathError(f"{out}: folder {parent} does not exist")
    if not parent.is_dir():
        raise OutputPathError(f"{out}: {parent} is not a folder")
    try:
        with tempfile.NamedTemporaryFile(prefix=f".{out.name}.", suffix=".probe", dir=parent):
            pass
    except OSError as exc:
        reason = exc.strerror or exc.__class__.__name__
        raise OutputPathError(f"{out}: cannot write in folder {parent} ({reason.lower()})") from None
    return out


def save_model(model: onnx.ModelProto, output: Path, *, check_loads: bool = True) -> None:
    """Write atomically: a temporary file in the same folder, then a rename.

    Models over protobuf's 2 GB limit get their tensors in a data file next to them named
    ``<output>.<8 hex digits>.data``, a name no other write uses: the data is written whole first,
    the model that points to it is renamed over ``output`` last (one rename publishes both), and
    the data files of the model it replaced (``<output>.data``, ``<output>.*.data``) are removed
    after. A crash at any point leaves the old model or the new one; writers racing for one path
    leave the last one renamed, whole.
    With ``check_loads`` ONNX Runtime first loads the temporary file (and its data;
    :func:`onnxcampo.runtime.check.check_loads`): a model it cannot load raises
    :class:`WrittenModelLoadError` and nothing is written, an existing output stays as it was.
    Callers that write what this onnxruntime need not load may pass ``check_loads=False``.
    """
    output = Path(output)
    tmp, tmp_data = _write_temporary(model, output, check_loads=check_loads)
    try:
        _commit(tmp, tmp_data, output)
    except BaseException:
        _remove(tmp, tmp_data)
        raise


def _write_temporary(model: onnx.ModelProto, output: Path, *, check_loads: bool,
                     over_limit: bool | None = None) -> tuple[Path, Path | None]:
    """:func:`save_model` up to the rename: the temporary file (and its data file, under the name
    it keeps), test-loaded. ``over_limit``: :func:`exceeds_protobuf_limit` of the model, when the
    caller knows it."""
    directory = output.parent
    _sweep_stale(output)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{output.name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    tmp = Path(tmp_name)
    tmp_data = None
    try:
        if not (exceeds_protobuf_limit(model) if over_limit is None else over_limit):
            tmp.write_bytes(model.SerializeToString())
        else:
            tmp_data = _fresh_data_path(output)
            # Converts ``model``'s tensors to external ones in place: it is our own output model.
            onnx.save_model(model, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                            location=tmp_data.name, size_threshold=1024)
        if check_loads:
            _check_loads(tmp, model, output)
    except OSError as exc:
        _remove(tmp, tmp_data)
        if exc.errno in _NO_ROOM:
            raise _write_error(exc, output) from exc
        raise
    except BaseException:
        _remove(tmp, tmp_data)
        raise
    return tmp, tmp_data


_NO_ROOM = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "the disk quota is exceeded",
            errno.EROFS: "the file system is read-only", errno.EFBIG: "the file is larger than the file system allows"}


def _write_error(exc: OSError, output: Path) -> OutputPathError:
    """A write that failed for want of room (or a read-only file system, :data:`_NO_ROOM`): one
    line naming the output; nothing was written and an existing output stays as it was."""
    why = _NO_ROOM[exc.errno]
    return OutputPathError(f"{output}: {why} (writing {Path(exc.filename).name if exc.filename else 'it'}); "
                           "nothing was written, an existing file stays as it was")


STALE_S = 3600.0  # a temporary file of a write to the same output older than this is a killed run's


def _sweep_stale(output: Path) -> None:
    """Remove what killed writes to ``output`` left (their hidden ``.<output>.*.tmp`` files, and
    ``<output>.<hex>.data`` files the model at ``output`` does not name), when older than
    :data:`STALE_S`: a write still running is younger."""
    import time

    cutoff = time.time() - STALE_S
    named = _own_data_files(output)
    pattern = re.compile(re.escape(output.name) + r"\.[0-9a-f]{8}\.data")
    for path in output.parent.glob(f".{glob.escape(output.name)}.*.tmp"):
        with contextlib.suppress(OSError):
            if path.stat().st_mtime < cutoff:
                path.unlink()
    for path in output.parent.glob(f"{glob.escape(output.name)}.*.data"):
        with contextlib.suppress(OSError):
            if pattern.fullmatch(path.name) and path not in named and path.stat().st_mtime < cutoff:
                path.unlink()


def _fresh_data_path(output: Path) -> Path:
    """``<output>.<8 hex digits>.data``, made now (exclusively: no other writer has it)."""
    while True:
        path = output.parent / f"{output.name}.{secrets.token_hex(4)}.data"
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return path
        except FileExistsError:
            continue


def _own_data_files(output: Path) -> set[Path]:
    """The data files of the model at ``output`` that its writes made (``<output>.data``,
    ``<output>.<hex>.data`` in its folder; a data file of another name may be shared and is never
    touched), and a stale ``<output>.data`` whatever points to it."""
    pattern = re.compile(re.escape(output.name) + r"(\.[0-9a-f]{8})?\.data")
    found = set()
    legacy = output.parent / f"{output.name}.data"
    if legacy.exists():
        found.add(legacy)
    candidates = [p for p in output.parent.glob(f"{glob.escape(output.name)}.*.data") if pattern.fullmatch(p.name)]
    if not candidates or not output.is_file():  # (an inline model is not parsed for nothing)
        return found
    try:
        old = onnx.load(str(output), load_external_data=False)
    except Exception:  # noqa: BLE001 - not a model we can read: its data files are not ours to judge
        return found
    for tensor in _all_tensors(old):
        for entry in tensor.external_data:
            if entry.key == "location" and pattern.fullmatch(entry.value):
                found.add(output.parent / entry.value)
    return found


def _commit(tmp: Path, tmp_data: Path | None, output: Path) -> None:
    if tmp_data is not None:
        _apply_umask(tmp_data)  # made 0600: it gets the model file's mode
    _apply_umask(tmp)  # mkstemp creates 0600; a saved model gets the usual permissions
    replaced = _own_data_files(output)
    os.replace(tmp, output)  # publishes the model and the data it names at once
    for path in replaced - {tmp_data}:
        path.unlink(missing_ok=True)


def _remove(tmp: Path, tmp_data: Path | None) -> None:
    tmp.unlink(missing_ok=True)
    if tmp_data is not None:
        tmp_data.unlink(missing_ok=True)


class StagedModel:
    """:func:`save_model` in two steps, for a caller that runs the written model before it keeps
    it (the accuracy check): :meth:`write` writes the temporary file next to ``output`` and
    test-loads it from there, as save_model does, :meth:`commit` renames it over ``output``;
    leaving the ``with`` block without a commit removes it (nothing is written, an existing output
    stays as it was). The model is serialized and test-loaded once, by path.

    A model over 2 GB is test-loaded in memory by :meth:`write` and saved by :meth:`commit`
    (:func:`save_model`: its conversion to external data strips the model's tensors in place,
    which must wait until the caller has run it).

    ``write(model, background=True)`` serializes and test-loads on a thread while the caller
    goes on (the accuracy check computes the fp32 reference meanwhile: the test-load's session is
    made in the child process, so the two overlap); :meth:`wait` (and :attr:`path`,
    :meth:`commit`) finish it and raise what it raised."""

    def __init__(self, output: str | os.PathLike) -> None:
        self.output = Path(output)
        self.model: onnx.ModelProto | None = None  # what write() was given last
        self._check_loads = True
        self._written: tuple[Path, Path | None] | None = None
        self._pending: concurrent.futures.Future | None = None  # a background write

    def __enter__(self) -> StagedModel:
        return self

    def __exit__(self, *exc_info) -> None:
        self.discard()

    @property
    def path(self) -> Path | None:
        """The temporary file :meth:`write` wrote (None before, after :meth:`commit`, and for a
        model over 2 GB): what runs the written model reads, as it will be renamed."""
        self.wait()
        return self._written[0] if self._written is not None else None

    def write(self, model: onnx.ModelProto, *, check_loads: bool = True, background: bool = False) -> None:
        self.discard()
        self.model, self._check_loads = model, check_loads
        if exceeds_protobuf_limit(model):
            if check_loads:
                _check_loads(model, model, self.output)
        elif background:
            pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="onnxcampo-write")
            self._pending = pool.submit(_write_temporary, model, self.output, check_loads=check_loads, over_limit=False)
            pool.shutdown(wait=False)  # the thread ends with the write
        else:
            self._written = _write_temporary(model, self.output, check_loads=check_loads, over_limit=False)

    def wait(self) -> None:
        """Finish a background :meth:`write`; raises what it raised (its files are removed then)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._written = pending.result()

    def commit(self) -> None:
        if self.model is None:
            raise ValueError("StagedModel.commit before write")
        self.wait()
        if self._written is None:
            save_model(self.model, self.output, check_loads=self._check_loads)
            return
        written, self._written = self._written, None
        try:
            _commit(*written, self.output)
        except BaseException:
            _remove(*written)
            raise

    def discard(self) -> None:
        try:
            self.wait()
        except Exception:  # noqa: BLE001 - discarded: the failed write removed its own files
            pass
        if self._written is not None:
            _remove(*self._written)
        self._written, self.model = None, None


def _check_loads(path: Path | onnx.ModelProto, model: onnx.ModelProto, output: Path) -> None:
    from onnxcampo.errors import WrittenModelLoadError
    from onnxcampo.runtime.check import check_loads  # the runtime imports this module

    try:
        check_loads(path, model=model, label=str(output))
    except WrittenModelLoadError as exc:
        raise WrittenModelLoadError(f"{exc}; nothing was written") from exc.__cause__


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """A text file written whole or not at all (temporary file in the same folder, then rename)."""
    _write_atomically(path, text, "w")


def write_bytes_atomically(path: str | os.PathLike, data: bytes) -> None:
    """A binary file written whole or not at all (temporary file in the same folder, then rename)."""
    _write_atomically(path, data, "wb")


def _write_atomically(path: str | os.PathLike, content: str | bytes, mode: str) -> None:
    path = Path(path)
    if not path.parent.is_dir():
        raise OutputPathError(f"{path}: folder {path.parent} does not exist")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as handle:
            handle.write(content)
        _apply_umask(Path(tmp_name))
        os.replace(tmp_name, path)
    except OSError as exc:
        Path(tmp_name).unlink(missing_ok=True)
        if exc.errno in _NO_ROOM:
            raise _write_error(exc, path) from exc
        raise
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def exceeds_protobuf_limit(model: onnx.ModelProto) -> bool:
    """Whether the model cannot be serialized as one protobuf (2 GB). ``ByteSize`` itself
    overflows past 2 GB (it came out small for a 2.4 GB model), so the tensor bytes are summed
    first. ``ByteSize`` encodes the whole model (about a second for 400 MB of weights), so a
    model is first bounded from its parts (:func:`_size_bound`: the weights' data lengths, the
    rest's own sizes) and measured whole only when that bound reaches the limit."""
    data, raw = 0, []
    for tensor in _all_tensors(model):
        raw.append(len(tensor.raw_data))
        data += raw[-1] + 4 * (len(tensor.float_data) + len(tensor.int32_data)) + 8 * len(tensor.int64_data)
        if data >= _PROTOBUF_LIMIT:
            return True
    bound = _size_bound(model, raw)  # _all_tensors yields the initializers first
    if bound is not None and bound < _PROTOBUF_LIMIT:
        return False
    size = model.ByteSize()
    return size < 0 or size >= _PROTOBUF_LIMIT


# An upper bound of the bytes a field entry takes besides its payload: its tag (field numbers
# below 2048: 2 bytes) and a length prefix (below 2 GB: 5 bytes).
_ENTRY = 8
_VARINT = 10  # the most bytes of an encoded varint
# TensorProto's fields, each bounded by _tensor_bound; a field added to ONNX's TensorProto and
# not listed here makes the bound unknown (None).
_TENSOR_FIELDS = frozenset({
    "dims", "data_type", "segment", "float_data", "int32_data", "string_data", "int64_data", "name",
    "raw_data", "double_data", "uint64_data", "doc_string", "external_data", "data_location", "metadata_props",
})


def _size_bound(model: onnx.ModelProto, raw: list[int]) -> int | None:
    """An upper bound of the model's encoded size without encoding its initializers, whose raw
    data lengths are ``raw`` (in order), or None when unknown. The rest of the model (nodes with
    their Constant tensors, value infos, functions, metadata) is small beside the weights and is
    bounded by each part's own ``ByteSize``."""
    if not {field.name for field in TensorProto.DESCRIPTOR.fields} <= _TENSOR_FIELDS:
        return None
    total = 2 * _ENTRY + _fields_bound(model, skip="graph") + _fields_bound(model.graph, skip="initializer")
    for tensor, raw_bytes in zip(model.graph.initializer, raw):
        total += _ENTRY + raw_bytes + _tensor_bound(tensor)
    return total


def _tensor_bound(tensor: onnx.TensorProto) -> int:
    """A bound of the tensor's encoded size less its raw data (``dims`` is not packed: a tag each)."""
    entries = sum(1 for field in _TENSOR_FIELDS if field != "metadata_props" or hasattr(tensor, field))
    total = entries * _ENTRY + (_VARINT + 2) * len(tensor.dims) + _VARINT * (
        2 + len(tensor.int32_data) + len(tensor.int64_data) + len(tensor.uint64_data))
    total += 4 * len(tensor.float_data) + 8 * len(tensor.double_data)
    total += sum(_ENTRY + _text_bytes(item) for item in tensor.string_data)
    total += _text_bytes(tensor.name) + _text_bytes(tensor.doc_string) + tensor.segment.ByteSize()
    entries = [*tensor.external_data, *getattr(tensor, "metadata_props", ())]
    return total + sum(_ENTRY + entry.ByteSize() for entry in entries)


def _fields_bound(message, *, skip: str) -> int:
    """A bound of the encoded size of ``message``'s fields other than ``skip``."""
    total = 0
    for field, value in message.ListFields():
        if field.name == skip:
            continue
        items = value if _repeated(field) else (value,)
        for item in items:
            if field.message_type is not None:
                size = item.ByteSize()
                if size < 0:  # past 2 GB
                    return _PROTOBUF_LIMIT
                total += _ENTRY + size
            elif isinstance(item, (str, bytes)):
                total += _ENTRY + _text_bytes(item)
            else:
                total += _ENTRY + _VARINT
    return total


def _text_bytes(value: str | bytes) -> int:
    return len(value) if isinstance(value, bytes) else len(value.encode("utf-8", "surrogatepass"))


def _apply_umask(path: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _all_tensors(model: onnx.ModelProto):
    yield from model.graph.initializer
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                yield attr.t
