"""One-off check that a model over protobuf's 2 GB limit loads, optimizes and saves (its
tensors go to ``<output>.data``) and still runs. Too big for CI; run by hand:

    python scripts/check_large_model.py /tmp/large
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnxcampo
from onnxcampo.runtime import make_session, run


def main(folder: str) -> int:
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    hidden, layers = 8192, 9  # 9 x 8192 x 8192 x 4 bytes = 2.4 GB
    inits, nodes, current = [], [], "x"
    for i in range(layers):
        inits.append(numpy_helper.from_array((rng.standard_normal((hidden, hidden), dtype=np.float32) * 0.01), f"w{i}"))
        nodes.append(helper.make_node("MatMul", [current, f"w{i}"], [f"h{i}"], name=f"mm{i}"))
        current = f"h{i}"
    graph = helper.make_graph(nodes, "large", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4096, hidden])],
                              [helper.make_tensor_value_info(current, TensorProto.FLOAT, [4096, hidden])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    source = root / "large.onnx"
    onnx.save_model(model, str(source), save_as_external_data=True, location="large.onnx.data")
    del model, inits, graph
    x = rng.standard_normal((4096, hidden), dtype=np.float32)
    # campo converts the weights to fp16 (1.2 GB, written inline); fp32 keeps 2.4 GB, which
    # must go to <output>.data.
    for policy in ("campo", "fp32"):
        start = time.perf_counter()
        result = onnxcampo.optimize(source, policy=policy, accuracy="off")
        out = root / f"large.{policy}.onnx"
        result.save(out)
        data = root / f"{out.name}.data"
        print(f"{policy}: optimized and saved in {time.perf_counter() - start:.1f} s: "
              f"{result.report['nodes_fp16']} fp16 nodes, {result.report['casts_inserted']} Casts; "
              f"{out.name} {out.stat().st_size / 1e9:.2f} GB"
              + (f" + {data.name} {data.stat().st_size / 1e9:.2f} GB" if data.exists() else ""), flush=True)
        del result
        onnx.checker.check_model(str(out))
        y = run(make_session(out), {"x": x})[current]
        print(f"  runs on ORT CPU: {y.shape}, finite: {bool(np.isfinite(y).all())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/large"))
