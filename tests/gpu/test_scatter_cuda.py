"""``ai.onnxcampo::ScatterNDAdd`` on CUDA against numpy, and timed against ONNX Runtime's
``ScatterND(reduction="add")`` on the embedding gradients of BERT-base and GPT-2
(tests/gpu/conftest.py: skipped without a GPU; the cases and the bound: tests/cases/scatter.py).

1. Every case (float32 and float16, duplicate and negative indices, index tuples of 0..3 entries,
   slice lengths that take the vector and the scalar paths, empty tensors, indices out of range,
   which CUDA clamps as ORT's CUDA kernel does) within the bound of a sum in any order. ORT's
   ScatterND runs the same cases as the baseline: its figures are recorded, not asserted.
2. A captured ScatterNDAdd replayed three times: each replay gives the reference (the copy of data
   into the output is part of the graph, so sums do not pile up across replays).
3. Timed side by side, plain and replayed: ORT's ScatterND and ScatterNDAdd on each benchmark,
   their outputs checked against numpy (ORT's recorded only).
"""

from __future__ import annotations

import numpy as np
import pytest

from cases import scatter as cases

CASES = {name: (data, indices, updates) for name, data, indices, updates in cases.cases()}


@pytest.mark.parametrize("variant", cases.VARIANTS)
@pytest.mark.parametrize("name", list(CASES))
def test_every_case_within_the_bound_of_a_sum_in_any_order(device, results, name, variant):
    data, indices, updates = CASES[name]
    if variant == "ScatterND" and not device.cuda:
        pytest.skip("ORT's CPU ScatterND refuses float16 and races on duplicates with several threads")
    tuples = cases.effective_indices(data.shape, indices, device.name)
    session = device.session(cases.scatter_model(variant, data.dtype, (data.ndim, indices.ndim, updates.ndim)))
    feeds = {"data": data, "indices": indices, "updates": updates}
    if tuples is None:  # the CPU kernel refuses an index out of range
        with pytest.raises(Exception, match="out of range|invalid indice"):
            session.run(None, feeds)
        return
    try:
        out = session.run(None, feeds)[0]
    except Exception as exc:  # noqa: BLE001 - ORT's op is the baseline: it may lack a kernel
        if variant == "ScatterND":
            results.record(error=str(exc).strip().splitlines()[-1][:300])
            return
        raise
    report = cases.compare(out, data, tuples, updates)
    if variant == "ScatterND":  # the baseline: a wrong result of ORT's is recorded, not failed
        results.record(**report)
        return
    assert report["ok"], report


@pytest.mark.slow
def test_a_replayed_scatter_gives_the_reference_each_time(device):
    bench = cases.benchmarks()[0]
    feeds = {key: bench[key] for key in ("data", "indices", "updates")}
    tuples = cases.effective_indices(bench["data"].shape, bench["indices"], device.name)
    expected = cases.reference(bench["data"], tuples, bench["updates"])
    runner = device.bound(cases.scatter_model("ScatterNDAdd", np.float32, (2, 2, 2)), feeds, cuda_graph=True)
    for run in range(4):  # the capture, then replays
        runner()
        report = cases.compare(runner.outputs()["output"], bench["data"], tuples, bench["updates"], expected)
        assert report["ok"], (run, report)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(3), ids=["bert", "gpt2", "same-index"])
def test_scatter_nd_add_timed_against_ort_scatter_nd(device, results, index):
    bench = cases.benchmarks()[index]
    feeds = {key: bench[key] for key in ("data", "indices", "updates")}
    tuples = cases.effective_indices(bench["data"].shape, bench["indices"], device.name)
    expected = cases.reference(bench["data"], tuples, bench["updates"])
    runners = {}
    for variant in cases.VARIANTS:
        model = cases.scatter_model(variant, np.float32, (2, 2, 2))
        threads = {"intra_op_threads": 1} if variant == "ScatterND" and not device.cuda else {}  # ORT's CPU race
        runners[f"{variant}/plain"] = device.bound(model, feeds, **threads)
        if device.cuda:
            runners[f"{variant}/graph"] = device.bound(model, feeds, cuda_graph=True)
    figures = device.time(runners)
    outputs = {key: cases.compare(runner.outputs()["output"], bench["data"], tuples, bench["updates"], expected)
               for key, runner in runners.items()}
    results.record(name=bench["name"], data=list(bench["data"].shape), indices=list(bench["indices"].shape),
                   distinct_rows=bench["distinct_rows"], max_duplicates=bench["max_duplicates"], timing=figures,
                   outputs=outputs)
    assert all(report["ok"] for key, report in outputs.items() if key.startswith("ScatterNDAdd/")), outputs
