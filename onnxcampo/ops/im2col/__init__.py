"""``ai.onnxcampo::Im2Col``: a Conv's column matrix, for the weight gradient's Gemm (``docs/ops.md``).
Kernels in ``im2col_cpu.cc`` and ``im2col.cu``, the op in ``im2col_op.cc``, nodes in :mod:`.nodes`.
"""
