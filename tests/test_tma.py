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
