"""``ai.onnxcampo::ScatterNDAdd``: ONNX ScatterND with ``reduction="add"`` (``docs/ops.md``).
Nodes in :mod:`.nodes`.
"""
