"""Reading and writing models: load and check, metadata, atomic writes (external data past 2 GB).

A model is read once (:func:`read_model`): checked by ``onnx.checker`` (ONNX Runtime's
default-domain training ops checked as foreign ones), its external data loaded, its opset
checked; every failure is one :class:`~onnxcampo.errors.ModelLoadError` line. A model is written
whole or not at all (:func:`save_model`): a temporary file in the same folder, test-loaded by ONNX
Runtime, then renamed.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile
from pathlib import Path

import onnx
import onnx.defs
from google.protobuf.message import DecodeError

from onnxcampo import oplists
from onnxcampo.errors import ModelLoadError, OutputPathError, UnsupportedModelError

log = logging.getLogger(__name__)

MIN_OPSET = 11
_PROTOBUF_LIMIT = (1 << 31) - (1 << 20)
_FOREIGN_DOMAIN = "onnxcampo.ort_training"  # where check_model puts ORT's default-domain training ops


def read_model(source: str | os.PathLike | onnx.ModelProto) -> tuple[onnx.ModelProto, Path | None]:
    """The model and the file it came from, checked by ``onnx.checker``; every failure is a
    :class:`ModelLoadError` or :class:`UnsupportedModelError` with a one-line message.

    A file is checked by path *before* Python loads it, so the checker's copy of the model is
    gone before ours exists (peak memory stays near twice the model size).
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
        invalid = _checker_error(str(path))
        try:
            model = onnx.load(str(path), load_external_data=False)
        except (DecodeError, ValueError, RuntimeError, OSError) as exc:
            raise ModelLoadError(f"{path}: not an ONNX model, or the file is truncated ({exc.__class__.__name__})") from None
        if model.ir_version == 0 or not model.HasField("graph"):
            raise ModelLoadError(f"{path}: not an ONNX model (no IR version or graph)")
        if invalid and ort_default_domain_nodes(model) and not exceeds_protobuf_limit(model):
            invalid = _checker_error(model)  # again, with ORT's default-domain training ops set aside
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
        repeated = field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED
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
    ``read_model`` checks such a model again in memory when the path check fails."""
    if isinstance(model, str):
        onnx.checker.check_model(model, full_check=full_check)
        return
    foreign = ort_default_domain_nodes(model)
    if not foreign:
        onnx.checker.check_model(model, full_check=full_check)
        return
    # Our own copy of the model is borrowed for the check (no second copy of the weights).
    declared = any(entry.domain == _FOREIGN_DOMAIN for entry in model.opset_import)
    if not declared:
        model.opset_import.add(domain=_FOREIGN_DOMAIN, version=1)
    domains = [node.domain for node in foreign]
    for node in foreign:
        node.domain = _FOREIGN_DOMAIN
    try:
        onnx.checker.check_model(model, full_check=full_check)
    finally:
        for node, domain in zip(foreign, domains):
            node.domain = domain
        if not declared:
            del model.opset_import[len(model.opset_import) - 1]


def _check_opset(model: onnx.ModelProto, where: str) -> None:
    opset = default_opset(model)
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

    Models over protobuf's 2 GB limit get their tensors in ``<output>.data`` next to them.
    With ``check_loads`` ONNX Runtime first loads the temporary file (and its data, under their
    temporary names; :func:`onnxcampo.runtime.check.check_loads`): a model it cannot load raises
    :class:`WrittenModelLoadError` and nothing is written, an existing output stays as it was.
    Callers that write what this onnxruntime need not load may pass ``check_loads=False``.
    """
    output = Path(output)
    directory = output.parent
    fd, tmp_name = tempfile.mkstemp(prefix=f".{output.name}.", suffix=".tmp", dir=directory)
    os.close(fd)
    tmp = Path(tmp_name)
    tmp_data = None
    try:
        if not exceeds_protobuf_limit(model):
            tmp.write_bytes(model.SerializeToString())
            if check_loads:
                _check_loads(tmp, model, output)
        else:
            data_name = f"{output.name}.data"
            tmp_data = directory / f".{data_name}.tmp"
            if tmp_data.exists():
                tmp_data.unlink()
            # Converts ``model``'s tensors to external ones in place: it is our own output model.
            onnx.save_model(
                model, str(tmp), save_as_external_data=True, all_tensors_to_one_file=True,
                location=tmp_data.name, size_threshold=1024,
            )
            if check_loads:  # before the data replaces an existing <output>.data
                _check_loads(tmp, model, output)
            # The model names its data file: rewrite the location to the final name.
            saved = onnx.load(str(tmp), load_external_data=False)
            for tensor in _all_tensors(saved):
                for entry in tensor.external_data:
                    if entry.key == "location":
                        entry.value = data_name
            tmp.write_bytes(saved.SerializeToString())
            _apply_umask(tmp_data)  # onnx writes it 0600: it gets the model file's mode
            os.replace(tmp_data, directory / data_name)
        _apply_umask(tmp)  # mkstemp creates 0600; a saved model gets the usual permissions
        os.replace(tmp, output)
    except BaseException:
        tmp.unlink(missing_ok=True)
        if tmp_data is not None:
            tmp_data.unlink(missing_ok=True)
        raise


def _check_loads(path: Path, model: onnx.ModelProto, output: Path) -> None:
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
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def exceeds_protobuf_limit(model: onnx.ModelProto) -> bool:
    """Whether the model cannot be serialized as one protobuf (2 GB). ``ByteSize`` itself
    overflows past 2 GB (it came out small for a 2.4 GB model), so the tensor bytes are summed
    first."""
    data = 0
    for tensor in _all_tensors(model):
        data += len(tensor.raw_data) + 4 * (len(tensor.float_data) + len(tensor.int32_data)) + 8 * len(tensor.int64_data)
        if data >= _PROTOBUF_LIMIT:
            return True
    size = model.ByteSize()
    return size < 0 or size >= _PROTOBUF_LIMIT


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
