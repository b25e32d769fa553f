"""A training step's tensor-list ops: ``UnscaleCheckFinite``, ``CheckFinite``, ``MultiTensorSGD``,
``MultiTensorAdamW`` and ``MultiTensorCast`` (``docs/ops.md``). Nodes in :mod:`.nodes`.
"""
