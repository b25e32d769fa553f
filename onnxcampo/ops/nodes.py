"""ONNX nodes of the ``ai.onnxcampo`` ops, with their input and output order in one place.

Each op unit (``onnxcampo/ops/<unit>/``) holds its builders in ``<unit>/nodes.py``; this module
gathers them, the place callers import them from. A model that holds them needs
:func:`import_domain`; running it needs the library (:func:`onnxcampo.ops.library_path`).
"""

from __future__ import annotations

from onnxcampo.ops import DOMAIN, OPSET_VERSION
from onnxcampo.ops.avg_matmul.nodes import avg_matmul_integer
from onnxcampo.ops.batch_norm.nodes import batch_norm_grad_sums, batch_norm_stats
from onnxcampo.ops.common.nodes import import_domain
from onnxcampo.ops.conv_grad.nodes import conv_weight_grad
from onnxcampo.ops.conv_nhwc.nodes import conv_nhwc, conv_nhwc_data_grad, conv_nhwc_weight_grad
from onnxcampo.ops.elementwise.nodes import fused_elementwise
from onnxcampo.ops.im2col.nodes import im2col, im2col_shape
from onnxcampo.ops.max_pool.nodes import max_pool_nhwc, max_pool_nhwc_grad
from onnxcampo.ops.multi_tensor.nodes import (
    MULTI_TENSOR_CAST,
    check_finite,
    multi_tensor_adamw,
    multi_tensor_cast,
    multi_tensor_cast_reference_op,
    multi_tensor_sgd,
    unscale_check_finite,
)
from onnxcampo.ops.norm.nodes import layer_norm_grad, softmax_grad
from onnxcampo.ops.reduce.nodes import block_reduce_sum
from onnxcampo.ops.scatter.nodes import scatter_nd_add
from onnxcampo.ops.to_nhwc.nodes import nchw_to_nhwc
from onnxcampo.ops.xent.nodes import softmax_cross_entropy, softmax_cross_entropy_grad

__all__ = [
    "DOMAIN",
    "OPSET_VERSION",
    "MULTI_TENSOR_CAST",
    "avg_matmul_integer",
    "batch_norm_grad_sums",
    "batch_norm_stats",
    "block_reduce_sum",
    "check_finite",
    "conv_nhwc",
    "conv_nhwc_data_grad",
    "conv_nhwc_weight_grad",
    "conv_weight_grad",
    "fused_elementwise",
    "im2col",
    "im2col_shape",
    "import_domain",
    "layer_norm_grad",
    "max_pool_nhwc",
    "max_pool_nhwc_grad",
    "multi_tensor_adamw",
    "multi_tensor_cast",
    "multi_tensor_cast_reference_op",
    "multi_tensor_sgd",
    "nchw_to_nhwc",
    "scatter_nd_add",
    "softmax_cross_entropy",
    "softmax_cross_entropy_grad",
    "softmax_grad",
    "unscale_check_finite",
]
