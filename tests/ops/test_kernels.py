"""Each ai.onnxcampo op on the CPU against its numpy reference (reference.py), on fresh random
inputs each run (the seed is in the failure message): mixed fp16/fp32 gradients, empty tensors,
injected inf/NaN, and found_inf as a bool or a float."""

from __future__ import annotations

import secrets

import numpy as np
import pytest
from onnx import TensorProto

import reference as ref
from onnxcampo.errors import CampoError
from onnxcampo.ops import nodes

FLOAT, BOOL = TensorProto.FLOAT, TensorProto.BOOL
SHAPES = [(7, 5), (0,), (33,), (2, 0, 3), (4, 3, 2, 2), (1,)]


class SeededRng:
    """A numpy Generator on a fresh seed that failure messages quote (``seed_text``)."""

    def __init__(self) -> None:
        seed = secrets.randbits(32)
        self._generator = np.random.default_rng(seed)
        self.seed_text = f"random seed {seed}"

    def __getattr__(self, name):
        return getattr(self._generator, name)


@pytest.fixture
def rng():
    return SeededRng()


def gradients(rng, dtypes=None):
    dtypes = dtypes or [rng.choice([np.float16, np.float32]) for _ in SHAPES]
    return [(rng.standard_normal(shape) * 3).astype(dtype) for shape, dtype in zip(SHAPES, dtypes)]


def close(actual, expected, seed, rtol=0.0, atol=0.0):
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol, err_msg=seed)


def unscale(rng, grads, inv_scale, threads=None):
    names = [f"g{i}" for i in range(len(grads))]
    node = nodes.unscale_check_finite("inv_scale", names, found_inf="found_inf", outputs=[f"u{i}" for i in range(len(grads))],
                                      name="unscale")
    feeds = {"inv_scale": np.array(inv_scale, np.float32), **dict(zip(names, grads))}
    outputs = {"found_inf": (BOOL, []), **{f"u{i}": (FLOAT, list(g.shape)) for i, g in enumerate(grads)}}
    out = ref.run_node(node, feeds, outputs, intra_op_threads=threads)
    return out["found_inf"], [out[f"u{i}"] for i in range(len(grads))]


def test_unscale_matches_numpy_on_mixed_dtypes_and_empty_tensors(library, rng):
    grads = gradients(rng, [np.float16, np.float32, np.float16, np.float32, np.float32, np.float16])
    inv_scale = float(rng.uniform(1e-4, 1.0))
    found, unscaled = unscale(rng, grads, inv_scale)
    expected_found, expected = ref.unscale_check_finite(inv_scale, grads)
    assert found.dtype == np.bool_ and found.shape == () and not found
    for actual, wanted, g in zip(unscaled, expected, grads):
        assert actual.dtype == np.float32 and actual.shape == g.shape
        close(actual, wanted, rng.seed_text)  # exact: one product per element


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_unscale_flags_any_nonfinite_gradient(library, rng, bad, dtype):
    grads = gradients(rng)
    candidates = [i for i, g in enumerate(grads) if g.size]
    k = int(rng.choice(candidates))
    grads[k] = grads[k].astype(dtype)
    grads[k].flat[int(rng.integers(grads[k].size))] = bad
    found, unscaled = unscale(rng, grads, 0.5)
    assert found, rng.seed_text
    _, expected = ref.unscale_check_finite(0.5, grads)
    for actual, wanted in zip(unscaled, expected):
        np.testing.assert_array_equal(actual, wanted, err_msg=rng.seed_text)  # inf stays inf, NaN NaN


def test_unscale_fp16_overflow_after_scaling_is_not_a_nonfinite_gradient(library):
    """found_inf looks at the gradients, not at their unscaled values."""
    found, unscaled = unscale(None, [np.array([65504.0], np.float16)], 4.0)
    assert not found and unscaled[0][0] == np.float32(65504.0 * 4)


def sgd_case(rng, momentum: bool):
    grads = gradients(rng)
    weights = [rng.standard_normal(g.shape).astype(np.float32) for g in grads]
    velocities = [rng.standard_normal(g.shape).astype(np.float32) for g in grads] if momentum else None
    return grads, weights, velocities


def run_sgd(grads, weights, velocities, lr, flag, mu, threads=None, inv_scale=None):
    n = len(grads)
    w, g, v = [f"w{i}" for i in range(n)], [f"g{i}" for i in range(n)], [f"v{i}" for i in range(n)]
    node = nodes.multi_tensor_sgd("lr", "found_inf", w, g, v if velocities else (), outputs=[x + "'" for x in w],
                                  velocity_outputs=[x + "'" for x in v] if velocities else (), momentum=mu, name="sgd",
                                  inv_scale="inv_scale" if inv_scale is not None else None)
    feeds = {"lr": np.array(lr, np.float32), "found_inf": flag, **dict(zip(w, weights)), **dict(zip(g, grads))}
    if inv_scale is not None:
        feeds["inv_scale"] = np.array(inv_scale, np.float32)
    outputs = {x + "'": (FLOAT, list(a.shape)) for x, a in zip(w, weights)}
    if velocities:
        feeds.update(zip(v, velocities))
        outputs.update({x + "'": (FLOAT, list(a.shape)) for x, a in zip(v, velocities)})
    out = ref.run_node(node, feeds, outputs, intra_op_threads=threads)
    return [out[x + "'"] for x in w], [out[x + "'"] for x in v] if velocities else []


@pytest.mark.parametrize("momentum", [False, True])
def test_sgd_matches_numpy(library, rng, momentum):
    grads, weights, velocities = sgd_case(rng, momentum)
    lr, mu = float(rng.uniform(1e-3, 0.5)), float(rng.uniform(0.5, 0.99))
    new_w, new_v = run_sgd(grads, weights, velocities, lr, np.array(False), mu)
    want_w, want_v = ref.sgd(lr, False, weights, grads, velocities, mu)
    for actual, wanted in zip(new_w + new_v, want_w + want_v):
        close(actual, wanted, rng.seed_text)  # exact: the kernel rounds like the numpy reference


def adamw_case(rng):
    grads = gradients(rng)
    weights = [rng.standard_normal(g.shape).astype(np.float32) for g in grads]
    m = [(rng.standard_normal(g.shape) * 0.1).astype(np.float32) for g in grads]
    v = [rng.uniform(0, 0.1, g.shape).astype(np.float32) for g in grads]
    return grads, weights, m, v


def run_adamw(grads, weights, m, v, lr, step, flag, hyper, threads=None, inv_scale=None):
    n = len(grads)
    names = {key: [f"{key}{i}" for i in range(n)] for key in ("w", "g", "m", "v")}
    node = nodes.multi_tensor_adamw(
        "lr", "step", "found_inf", names["w"], names["g"], names["m"], names["v"], step_output="step'",
        outputs=[x + "'" for x in names["w"]], m_outputs=[x + "'" for x in names["m"]],
        v_outputs=[x + "'" for x in names["v"]], name="adamw",
        inv_scale="inv_scale" if inv_scale is not None else None, **hyper)
    feeds = {"lr": np.array(lr, np.float32), "step": np.array(step, np.float32), "found_inf": flag}
    if inv_scale is not None:
        feeds["inv_scale"] = np.array(inv_scale, np.float32)
    outputs = {"step'": (FLOAT, [])}
    for key, values in (("w", weights), ("g", grads), ("m", m), ("v", v)):
        feeds.update(zip(names[key], values))
        if key != "g":
            outputs.update({x + "'": (FLOAT, list(a.shape)) for x, a in zip(names[key], values)})
    out = ref.run_node(node, feeds, outputs, intra_op_threads=threads)
    return out["step'"], *([out[x + "'"] for x in names[key]] for key in ("w", "m", "v"))


def test_adamw_matches_numpy(library, rng):
    grads, weights, m, v = adamw_case(rng)
    hyper = dict(betas=(float(rng.uniform(0.8, 0.95)), float(rng.uniform(0.99, 0.9999))), eps=1e-8,
                 weight_decay=float(rng.uniform(0, 0.1)))
    lr, step = float(rng.uniform(1e-4, 1e-2)), float(rng.integers(0, 1000))
    step_out, new_w, new_m, new_v = run_adamw(grads, weights, m, v, lr, step, np.array(False), hyper)
    want = ref.adamw(lr, step, False, weights, grads, m, v, hyper["betas"][0], hyper["betas"][1], hyper["eps"],
                     hyper["weight_decay"])
    assert step_out == step + 1
    for actual, wanted in zip(new_m + new_v, want[2] + want[3]):
        close(actual, wanted, rng.seed_text)
    for actual, wanted in zip(new_w, want[1]):
        close(actual, wanted, rng.seed_text, rtol=1e-6, atol=1e-7)  # b^t: powf of two libraries


@pytest.mark.parametrize("flag", [np.array(True), np.array(1.0, np.float32), np.array(np.nan, np.float32)])
def test_found_inf_leaves_every_output_equal_to_its_input(library, rng, flag):
    grads, weights, velocities = sgd_case(rng, momentum=True)
    grads[2][0] = np.inf  # what a skipped step typically sees
    new_w, new_v = run_sgd(grads, weights, velocities, 0.1, flag, 0.9)
    for actual, wanted in zip(new_w + new_v, weights + velocities):
        np.testing.assert_array_equal(actual, wanted)
    grads, weights, m, v = adamw_case(rng)
    step_out, new_w, new_m, new_v = run_adamw(grads, weights, m, v, 0.01, 41.0, flag,
                                              dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01))
    assert step_out == 41.0
    for actual, wanted in zip(new_w + new_m + new_v, weights + m + v):
        np.testing.assert_array_equal(actual, wanted)


def test_float_found_inf_zero_updates(library, rng):
    grads, weights, _ = sgd_case(rng, momentum=False)
    new_w, _ = run_sgd(grads, weights, None, 0.1, np.array(0.0, np.float32), 0.0)
    want_w, _ = ref.sgd(0.1, False, weights, grads)
    for actual, wanted in zip(new_w, want_w):
        close(actual, wanted, rng.seed_text)


def check_finite(grads, threads=None):
    names = [f"g{i}" for i in range(len(grads))]
    node = nodes.check_finite(names, found_inf="found_inf", name="check")
    out = ref.run_node(node, dict(zip(names, grads)), {"found_inf": (BOOL, [])}, intra_op_threads=threads)
    return bool(out["found_inf"])


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan, None])
def test_check_finite_is_unscale_check_finites_flag(library, rng, bad):
    grads = gradients(rng)
    if bad is not None:
        grads[int(rng.integers(0, 2)) * 4][0, 0] = bad  # (7, 5) or (4, 3, 2, 2): fp16 or fp32
    assert check_finite(grads) == (bad is not None) == bool(unscale(rng, grads, 0.5)[0]), rng.seed_text


@pytest.mark.parametrize("momentum", [False, True])
def test_sgd_that_unscales_equals_sgd_after_unscale_check_finite(library, rng, momentum):
    """unscale=1 (the gradients scaled, inv_scale an input) gives what UnscaleCheckFinite's u
    then the plain update give, bit for bit: the same float32 product, never written."""
    grads, weights, velocities = sgd_case(rng, momentum)
    inv_scale, lr, mu = float(rng.uniform(1e-4, 1.0)), float(rng.uniform(1e-3, 0.5)), 0.9
    _, unscaled = unscale(rng, grads, inv_scale)
    want = run_sgd(unscaled, weights, velocities, lr, np.array(False), mu)
    got = run_sgd(grads, weights, velocities, lr, np.array(False), mu, inv_scale=inv_scale)
    for actual, wanted in zip(got[0] + got[1], want[0] + want[1]):
        assert_bits_equal(actual, wanted, rng.seed_text)
    skipped = run_sgd(grads, weights, velocities, lr, np.array(True), mu, inv_scale=inv_scale)
    for actual, wanted in zip(skipped[0] + skipped[1], weights + (velocities or [])):
        np.testing.assert_array_equal(actual, wanted)


def test_adamw_that_unscales_equals_adamw_after_unscale_check_finite(library, rng):
    grads, weights, m, v = adamw_case(rng)
    hyper = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    inv_scale = float(rng.uniform(1e-4, 1.0))
    _, unscaled = unscale(rng, grads, inv_scale)
    want = run_adamw(unscaled, weights, m, v, 1e-3, 7.0, np.array(False), hyper)
    got = run_adamw(grads, weights, m, v, 1e-3, 7.0, np.array(False), hyper, inv_scale=inv_scale)
    assert got[0] == want[0] == 8.0
    for actual, wanted in zip(got[1] + got[2] + got[3], want[1] + want[2] + want[3]):
        assert_bits_equal(actual, wanted, rng.seed_text)


def test_an_update_that_unscales_without_inv_scale_fails_with_its_signature(library):
    node = nodes.multi_tensor_sgd("lr", "found_inf", ["w"], ["g"], outputs=["w'"], name="sgd", inv_scale="s")
    del node.input[2]  # (lr, found_inf, w, g): w taken for inv_scale, one tensor left
    feeds = {"lr": np.array(0.1, np.float32), "found_inf": np.array(False), "w": np.ones(3, np.float32),
             "g": np.ones(3, np.float32)}
    with pytest.raises(CampoError, match=r"inv_scale must be a float32 scalar|expected inputs \(lr, found_inf, inv_scale"):
        ref.run_node(node, feeds, {"w'": (FLOAT, [3])})


def test_mismatched_lists_fail_with_the_expected_signature(library):
    """Three tensors after (lr, found_inf) fit neither (w, g) nor (w, g, v) for one output."""
    node = nodes.multi_tensor_sgd("lr", "found_inf", ["w"], ["g"], outputs=["w'"], name="sgd")
    node.input.append("extra")
    feeds = {"lr": np.array(0.1, np.float32), "found_inf": np.array(False), "w": np.ones(3, np.float32),
             "g": np.ones(3, np.float32), "extra": np.ones(3, np.float32)}
    with pytest.raises(CampoError, match=r"expected inputs \(lr, found_inf, w_1..w_n, g_1..g_n"):
        ref.run_node(node, feeds, {"w'": (FLOAT, [3])})


def test_gradient_shape_must_match_its_weight(library):
    node = nodes.multi_tensor_sgd("lr", "found_inf", ["w"], ["g"], outputs=["w'"], name="sgd")
    feeds = {"lr": np.array(0.1, np.float32), "found_inf": np.array(False), "w": np.ones(3, np.float32),
             "g": np.ones(4, np.float32)}
    with pytest.raises(CampoError, match="differ in shape"):
        ref.run_node(node, feeds, {"w'": (FLOAT, [3])})


# Larger than the CPU kernels' 64K-element chunks together (~350K elements, 6 chunks): tensors
# that span chunk boundaries, small ones inside a chunk, empty ones, mixed gradient types.
LARGE_SHAPES = [(300, 517), (3,), (0,), (70001,), (129, 1000), (5,)]


def large_gradients(rng):
    dtypes = [np.float16, np.float32, np.float16, np.float32, np.float16, np.float32]
    return [(rng.standard_normal(shape) * 3).astype(dtype) for shape, dtype in zip(LARGE_SHAPES, dtypes)]


def assert_bits_equal(a, b, seed):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, seed
    np.testing.assert_array_equal(a.view(np.uint32 if a.dtype == np.float32 else np.uint8),
                                  b.view(np.uint32 if b.dtype == np.float32 else np.uint8), err_msg=seed)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [2, 4])
def test_outputs_do_not_depend_on_the_intra_op_thread_count(library, rng, threads):
    """The kernels split the elements of all tensors into chunks run on ORT's intra-op pool;
    with 1 and with several threads every output is the same bit for bit, and equals the
    numpy reference (so no chunk is left unwritten in both)."""
    grads = large_gradients(rng)
    grads[4].flat[100_000] = np.nan  # in the fourth chunk of six: found by a chunk other than the first
    grads[3].flat[-1] = np.inf
    clean = large_gradients(rng)
    for case in (grads, clean):
        results = [unscale(rng, case, 0.25, threads=n) for n in (1, threads)]
        for found, unscaled in results:
            expected_found, expected = ref.unscale_check_finite(0.25, case)
            assert bool(found) == bool(expected_found), rng.seed_text
            for actual, wanted in zip(unscaled, expected):
                assert_bits_equal(actual, wanted, rng.seed_text)
        assert_bits_equal(results[0][0], results[1][0], rng.seed_text)

    weights = [rng.standard_normal(g.shape).astype(np.float32) for g in clean]
    velocities = [rng.standard_normal(g.shape).astype(np.float32) for g in clean]
    for vel, flag in ((None, np.array(False)), (velocities, np.array(False)), (velocities, np.array(True))):
        one, many = (run_sgd(clean, weights, vel, 0.05, flag, 0.9, threads=n) for n in (1, threads))
        want_w, want_v = ref.sgd(0.05, bool(flag), weights, clean, vel, 0.9)
        for a, b, wanted in zip(one[0] + one[1], many[0] + many[1], want_w + want_v):
            assert_bits_equal(a, b, rng.seed_text)
            assert_bits_equal(a, wanted, rng.seed_text)

    m = [(rng.standard_normal(g.shape) * 0.1).astype(np.float32) for g in clean]
    v = [rng.uniform(0, 0.1, g.shape).astype(np.float32) for g in clean]
    hyper = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for flag in (np.array(False), np.array(1.0, np.float32)):
        one, many = (run_adamw(clean, weights, m, v, 1e-3, 9.0, flag, hyper, threads=n) for n in (1, threads))
        assert_bits_equal(one[0], many[0], rng.seed_text)
        for a, b in zip(one[1] + one[2] + one[3], many[1] + many[2] + many[3]):
            assert_bits_equal(a, b, rng.seed_text)
        want = ref.adamw(1e-3, 9.0, bool(flag), weights, clean, m, v)
        for a, wanted in zip(one[2] + one[3], want[2] + want[3]):
            assert_bits_equal(a, wanted, rng.seed_text)
        for a, wanted in zip(one[1], want[1]):
            close(a, wanted, rng.seed_text, rtol=1e-6, atol=1e-7)  # b^t: powf of two libraries
