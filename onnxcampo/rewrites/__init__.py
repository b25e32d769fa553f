"""The model-file rewrites: each module changes the graph of a model file, apart from the
precision plan (which only the Cast insertion and padding passes apply).

- :mod:`.transformer`: ONNX Runtime's transformer fusions (attention, SkipLayerNormalization,
  BiasGelu) before planning (``--fuse``), with :mod:`.attention_mask` (a BERT Attention's padding
  mask as an additive bias) and :mod:`.attention` (the attention ORT leaves unfused as one
  MultiHeadAttention);
- :mod:`.elementwise`: chains of elementwise nodes as one ``FusedElementwise`` kernel
  (``--fuse-elementwise``);
- :mod:`.reductions`, :mod:`.norm`, :mod:`.loss`: block reductions, layer-norm and softmax
  gradients, softmax cross-entropy and its gradient as one kernel each (``--fuse-reductions``);
- :mod:`.layout`: convolutions and pooling channels-last (``--channels-last``);
- :mod:`.int8_avg`: MatMulInteger with tree-averaging accumulation (experimental).

Each rewrite that runs on the written model is priced before it is applied: the plan compares
the predicted time with and without it (:mod:`onnxcampo.estimate`) where its kernels are here.
"""
