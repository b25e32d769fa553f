"""``ai.onnxcampo::ConvWeightGrad``: a Conv's weight gradient (cuDNN's backward filter on CUDA, a
direct loop on the CPU; ``docs/ops.md``). Nodes in :mod:`.nodes`.
"""
