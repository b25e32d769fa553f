"""Synthetic measurement rows (the harness's JSON-lines format) from known cost formulas."""

from __future__ import annotations

import numpy as np

from onnxcampo.costdb.features import op_features

DEVICE = {"device": "Test GPU", "compute_capability": "9.0", "ort_version": "1.31.1",
          "cuda_version": "13.0"}
DIMS = (64, 96, 128, 200, 256, 333, 512, 768, 1001, 1024, 1536, 2047, 2048, 3072, 4096)

def _row(case, op_type, ins, outs, precision, time_us, *, date="2026-11-30", **extra):
    return {"case": case, "op_type": op_type, "domain": "", "attrs": {}, "input_shapes": ins,
            "output_shapes": outs, "float_inputs": [True] * len(ins), "precision": precision,
            "tf32": True, "padded": False, "time_us": time_us, "wall_us": time_us + 27.0,
            "baseline_us": 27.0, "p10_us": time_us * 0.98, "p90_us": time_us * 1.02, "runs": 30,
            **DEVICE, "date": date, **extra}

def pair_rows(op_type, ins, outs, t32, t16, **extra):
    case = f"{op_type}|in={','.join('x'.join(map(str, s)) for s in ins)}|attrs="
    return [_row(case, op_type, ins, outs, "fp32", t32, **extra),
            _row(case, op_type, ins, outs, "fp16", t16, **extra)]

def matmul_samples(n_cases=160, *, seed=0, noise=0.01, t32=None, t16=None, t16_tc=None, spread=0.15):
    """MatMul cases over a random (M, K, N) grid.

    Defaults: ``t32 = (5 + 1e-8 * flops) * u`` with a per-case factor ``u`` in
    ``[1 - spread, 1 + spread]`` (tile effects the features do not see; it is what makes sigma
    identifiable), ``t16 = 2 + 3e-9 * flops + 0.2 * t32`` unaligned,
    ``t16_tc = 1 + 1e-9 * flops + 0.25 * t32`` aligned; each time times (1 + noise * N(0, 1)).
    """
    rng = np.random.default_rng(seed)
    t32 = t32 or (lambda f: 5 + 1e-8 * f)
    t16 = t16 or (lambda f, t: 2 + 3e-9 * f + 0.2 * t)
    t16_tc = t16_tc or (lambda f, t: 1 + 1e-9 * f + 0.25 * t)
    rows, seen = [], set()
    while len(seen) < n_cases:
        m, k, n = (int(rng.choice(DIMS)) for _ in range(3))
        if (m, k, n) in seen:
            continue
        seen.add((m, k, n))
        ins, outs = [[m, k], [k, n]], [[m, n]]
        feats = op_features("MatMul", ins, outs)
        u = 1 + spread * rng.uniform(-1, 1)
        time32 = t32(feats.flops) * u
        fn = t16_tc if feats.tensor_core_aligned else t16
        time16 = fn(feats.flops, time32)
        rows += pair_rows("MatMul", ins, outs, time32 * (1 + noise * rng.standard_normal()),
                          time16 * (1 + noise * rng.standard_normal()))
    return rows

def elementwise_samples(op_type="Add", n_cases=40, *, seed=1, noise=0.01, spread=0.15):
    """Two-input elementwise op whose times depend on ``elements`` only:
    ``t32 = (3 + 4e-6 * elements) * u``, ``t16 = 1 + 1e-6 * elements + 0.3 * t32``."""
    rng = np.random.default_rng(seed)
    rows = []
    sizes = np.unique(np.round(np.logspace(3, 7.5, n_cases * 3)).astype(int))
    for size in rng.choice(sizes, n_cases, replace=False):
        shape = [int(size)]
        ins, outs = [shape, shape], [shape]
        elements = 3 * int(size)
        t32 = (3 + 4e-6 * elements) * (1 + spread * rng.uniform(-1, 1))
        t16 = 1 + 1e-6 * elements + 0.3 * t32
        rows += pair_rows(op_type, ins, outs, t32 * (1 + noise * rng.standard_normal()),
                          t16 * (1 + noise * rng.standard_normal()))
    return rows

def cast_samples(c_i=4.5, r16=2e-6, r32=2.4e-6, *, seed=2, noise=0.01, count=30):
    rng = np.random.default_rng(seed)
    rows = []
    for n in np.unique(np.round(np.logspace(3, 8, count)).astype(int)):
        for direction, r in (("to_fp16", r16), ("to_fp32", r32)):
            t = (c_i + r * n) * (1 + noise * rng.standard_normal())
            rows.append(_row(f"Cast|n={n}|{direction}", "Cast", [[int(n)]], [[int(n)]], direction, t,
                             elements=int(n)))
    return rows

def pad_samples(c_i=10.0, r=1.5e-6, *, seed=3, count=12):
    rng = np.random.default_rng(seed)
    rows = []
    for i, n in enumerate(np.unique(np.round(np.logspace(4, 8, count)).astype(int))):
        op = "Pad" if i % 2 else "Slice"
        t = (c_i + r * n) * (1 + 0.01 * rng.standard_normal())
        rows.append(_row(f"{op}|n={n}", op, [[int(n)]], [[int(n)]], "fp16", t, elements=int(n)))
    return rows

def full_samples(**kw):
    return matmul_samples(**kw) + elementwise_samples() + cast_samples() + pad_samples()
