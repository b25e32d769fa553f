"""``ai.onnxcampo::AvgMatMulInteger`` and ``ExactMatMulInteger``: uint8 matmuls, CPU only
(``docs/avg-matmul.md``). Nodes in :mod:`.nodes`.
"""
