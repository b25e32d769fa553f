"""``ai.onnxcampo::LayerNormGrad`` and ``SoftmaxGrad``: their numpy references are
:mod:`.layer_norm` and :mod:`.softmax`, their nodes :mod:`.nodes`.
"""
