"""CPU tests of e4m3 quantization (cuflash.quantize_e4m3, cuda_src/quantize.cu): the kernels' float -> e4m3 rounding
(cuda_src/e4m3_encode.cuh, built for the host with tests/e4m3_encode.cpp; skipped without a C++ compiler) against
cuflash.reference's (ml_dtypes) on every fp16 and bf16 value and on random floats, the checks' errors before any
launch, and the parameter struct's layout."""
import subprocess

import numpy as np
import pytest

import cuflash
from cuflash import checks, reference as ref
from cuflash.ops import quantize
from tests.fixtures import ROOT, host_program


@pytest.fixture(scope="module")
def encode(tmp_path_factory):
    build, exe = host_program(tmp_path_factory, "e4m3_encode.cpp", "c++17")
    assert build.returncode == 0, build.stderr

    def run(x):
        x = np.ascontiguousarray(x, dtype=np.float32)
        out = subprocess.run([str(exe)], input=x.tobytes(), capture_output=True, check=True).stdout
        return np.frombuffer(out, np.uint8)

    return run


def reference_bits(x):
    with np.errstate(invalid="ignore"):
        return ref._to_e4m3(np.asarray(x, np.float64)).view(np.uint8)


def test_e4m3_encode_rounds_every_half_value_as_the_reference(encode):
    fp16 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    bf16 = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    for x in (fp16, bf16):
        got, want = encode(x), reference_bits(x)
        nan = np.isnan(x)
        mismatch = np.flatnonzero((got != want) & ~nan)
        assert mismatch.size == 0, (x[mismatch[:8]], got[mismatch[:8]], want[mismatch[:8]])
        assert np.all(got[nan] & 0x7F == 0x7F)  # NaN stays NaN


def test_e4m3_encode_rounds_ties_saturates_and_keeps_signs(encode):
    steps = 2.0 ** np.arange(-9, 9)
    ties = np.concatenate([steps * 1.0625, steps * 1.1875, 2.0 ** -10 * np.array([1, 3, 5, 7])])  # midpoints
    x = np.concatenate([ties, -ties, [448, 449, 463.9, 464, 464.1, 480, 1e30, np.inf, 0.0, 2.0 ** -6, 2.0 ** -9]])
    x = np.concatenate([x, -x]).astype(np.float32)
    assert np.array_equal(encode(x), reference_bits(x))
    assert encode(np.float32([-0.0]))[0] == 0x80
    assert np.array_equal(encode(np.float32([1e9, -np.inf])), [0x7E, 0xFE])


def test_e4m3_encode_rounds_random_floats_as_the_reference(encode):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(200_000) * 10.0 ** rng.uniform(-5, 3, 200_000)).astype(np.float32)
    assert np.array_equal(encode(x), reference_bits(x))


def test_params_struct_matches_the_kernel():
    dtype = quantize.PARAMS_DTYPE
    assert [dtype.fields[n][1] for n in ("x", "x8", "amax", "descale", "x_batch_stride", "seqlen", "pow2",
                                         "given")] == [0, 8, 16, 24, 32, 56, 76, 80]
    assert dtype.itemsize == 88
    text = (ROOT / "cuda_src" / "quantize.cu").read_text()
    assert "int seqlen, nheads, headdim, heads_per_group, group_batch_stride, pow2;\n    int given;" in text


def test_specializations_cover_both_dtypes_and_kernels():
    specs = quantize.all_specs("sm_80")
    assert {(s.kernel, s.dtype) for s in specs} == {(k, d) for k in ("e4m3_amax", "e4m3_quantize")
                                                   for d in ("fp16", "bf16")}
    assert all(s.template.startswith(f"cuflash::{s.kernel}<cuflash::") for s in specs)


def x(b=2, s=33, h=4, d=64, dtype=np.float16):
    return np.zeros((b, s, h, d), dtype)


def test_check_accepts_and_sizes():
    assert checks.check_quantize_e4m3(x(), per="head", nheads_k=2) == (2, 33, 4, 64, 2, "head")
    assert checks.check_quantize_e4m3(x(d=256)) == (2, 33, 4, 256, 4, "tensor")
    given = np.ones((2, 2), np.float32)
    assert checks.check_quantize_e4m3(x(), descale=given) == (2, 33, 4, 64, 2, "head")
    assert checks.check_quantize_e4m3(x(), per="head", descale=np.ones((1,), np.float32))[4:] == (4, "tensor")


@pytest.mark.parametrize("array, options, error, match", [
    (x(dtype=np.float32), {}, TypeError, "x: dtype float32 is not supported; expected float16 or bfloat16"),
    (x(d=72), {}, ValueError, r"x: head dim \(axis 3\) is 72; e4m3 arrays take multiples of 16"),
    (x(d=272), {}, ValueError, r"x: head dim \(axis 3\) is 272; must be between 1 and 256"),
    (x()[0], {}, ValueError, r"x: expected 4 dimension\(s\)"),
    (x(s=0), {}, ValueError, r"x: seqlen \(axis 1\) must be at least 1"),
    (x(), dict(per="row"), ValueError, "per: expected 'tensor' or 'head', got 'row'"),
    (x(), dict(nheads_k=3), ValueError, r"nheads_k: expected a positive int dividing x's nheads \(axis 2\) = 4"),
    (x(), dict(nheads_k=2.0), ValueError, "nheads_k: expected a positive int"),
    (x(), dict(pow2=1), TypeError, "pow2: expected a bool, got int 1"),
    (x(), dict(descale=np.ones((2, 2))), TypeError, "descale: dtype float64 is not supported; expected float32"),
    (x(), dict(descale=np.ones((2, 3), np.float32)), ValueError, r"nheads_k: expected a positive int dividing"),
    (x(), dict(descale=np.ones((3, 2), np.float32)), ValueError,
     r"descale: expected shape \(\) or \(1,\) \(per tensor\) or \(batch, nheads_k\) with batch = 2, got \(3, 2\)"),
    (x(), dict(descale=np.ones((2, 4), np.float32)[:, ::2]), ValueError, "descale: must be contiguous"),
    (x(), dict(descale=np.ones((2, 2), np.float32), nheads_k=4), ValueError,
     r"nheads_k: 4 differs from descale's 2 heads \(axis 1\)"),
    (x(), dict(descale=np.ones((), np.float32), pow2=True), ValueError, "pow2: must be False with a given descale"),
])
def test_check_rejects(array, options, error, match):
    with pytest.raises(error, match=match):
        checks.check_quantize_e4m3(array, **options)


def test_reference_quantizes_with_a_given_descale():
    host = np.random.default_rng(3).standard_normal((2, 9, 4, 32)) * 5
    x8, found = ref.quantize_e4m3(host, "head", nheads_k=2)
    again, given = ref.quantize_e4m3(host, descale=found)
    assert np.array_equal(again.view(np.uint8), x8.view(np.uint8)) and given is not None and given.shape == (2, 2)
    small, _ = ref.quantize_e4m3(host, descale=np.float32(1e-3))  # past 448 descale: saturated
    assert np.abs(small.astype(np.float64)).max() == 448.0


def test_host_arrays_are_refused_before_any_launch():
    pytest.importorskip("cupy")
    with pytest.raises(TypeError, match="x: expected a cupy.ndarray, got numpy.ndarray"):
        cuflash.quantize_e4m3(x())


def test_call_plans_groups_descale_shape_and_launches(monkeypatch):
    from types import SimpleNamespace
    from cuflash import build, launcher
    monkeypatch.setattr(build, "get_kernel", lambda spec, device_id: SimpleNamespace(kernel=SimpleNamespace(ptr=7)))
    monkeypatch.setattr(launcher, "_load_driver", lambda: None)
    strides = (8448, 256, 64, 1)
    head = quantize.QuantizeCall((2, 33, 4, 64, 2, "head"), strides, np.float16, False, 0)
    assert (head.groups, head.descale_shape, len(head.launch.launches)) == (4, (2, 2), 2)
    given = quantize.QuantizeCall((2, 33, 4, 64, 4, "tensor"), strides, np.float16, False, 0, given=True)
    assert (given.groups, given.descale_shape, len(given.launch.launches)) == (1, (), 1)
