"""TMA tensor-map argument rules (cuflash.tma), checked on the host before the driver sees them."""
import ml_dtypes
import numpy as np
import pytest

from cuflash import tma

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_valid_q_map_passes():
    # q (batch 2, seqlen 1000, heads 16, d 128) bf16 as a 3-D map (d, heads, rows), box (64, 1, 128)
    tma.check_tiled(0x10000, BF16, (128, 16, 2000), (128 * 2, 16 * 128 * 2), (64, 1, 128), 128)


@pytest.mark.parametrize("kwargs,match", [
    (dict(ptr=0x10008), "16-byte aligned"),
    (dict(strides=(200,)), "multiple of 16"),
    (dict(box=(128, 64)), "exceeds the 128-byte swizzle span"),
    (dict(box=(64, 300)), "1..256"),
    (dict(swizzle=16), "swizzle 16"),
    (dict(dtype=np.dtype(np.int8)), "dtype int8"),
    (dict(box=(4, 64), swizzle=0), "multiple of 16"),
])
def test_bad_maps_are_refused_before_the_driver(kwargs, match):
    args = dict(ptr=0x10000, dtype=BF16, dims=(128, 64), strides=(256,), box=(64, 64), swizzle=128)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        tma.check_tiled(**args)


def test_joined_encoder_keeps_the_maps_of_each_pointer_tuple():
    encoded = []

    def encoder(tag):
        return lambda ptr: (encoded.append((tag, ptr)), bytes([tag]) * 4 + ptr.to_bytes(4, "little"))[1]

    joined = tma.joined_encoder((encoder(1), encoder(2)))
    maps = bytes([1] * 4) + (16).to_bytes(4, "little") + bytes([2] * 4) + (32).to_bytes(4, "little")
    assert joined((16, 32)) == maps and joined((16, 32)) == maps and len(encoded) == 2  # the second call: kept
    assert joined((16, 48))[8:] == bytes([2] * 4) + (48).to_bytes(4, "little") and encoded[-2:] == [(1, 16), (2, 48)]


def test_hopper_backward_struct_holds_the_maps_then_the_pointers():
    """BackwardMain's launch writes q, k, v, dout and dq_accum's maps at their offsets, then the 17 pointers of
    BwdParams, and leaves the planned fields as they were."""
    from cuflash.launcher import KernelCall
    from cuflash.ops import backward, backward_sm90
    p = np.zeros((), backward.SM90_PARAMS_DTYPE)
    p["batch"], p["softmax_scale"] = 3, 0.125
    maps = tuple((lambda tag: lambda ptr: bytes([tag]) * 120 + ptr.to_bytes(8, "little"))(tag) for tag in range(5))
    main = backward_sm90.BackwardMain(KernelCall((), p, ()), maps, None)
    main(0, *range(101, 118))  # q, k, v, dout, dk, dv, dq_accum, ..., dropout_state
    s = np.frombuffer(main.kernel_call.params(), backward.SM90_PARAMS_DTYPE)[0]
    names = ("q_map", "k_map", "v_map", "dout_map", "dq_map")
    for tag, (name, ptr) in enumerate(zip(names, (101, 102, 103, 104, 107))):
        assert s[name].tobytes() == bytes([tag]) * 120 + ptr.to_bytes(8, "little")
    assert [int(s[n]) for n in backward.PARAMS_DTYPE.names[:17]] == list(range(101, 118))
    assert s["batch"] == 3 and s["softmax_scale"] == np.float32(0.125)
