"""TMA tensor maps (CUtensorMap) built on the host through the driver's ``cuTensorMapEncodeTiled`` (ctypes on
``libcuda.so.1``; no extra dependency), for the Hopper kernels (``cuda_src/sm90.cuh``).

A map embeds the global pointer, so it is cached per (pointer, dtype, dims, strides, box, swizzle): a decode or
training loop that reuses its buffers pays the encode once. The argument rules are checked here first (they are
pure Python and testable without a GPU), so a bad layout gives a ValueError that names the problem instead of
the driver's CUDA_ERROR_INVALID_VALUE.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

__all__ = ["encode_tiled", "check_tiled", "encoder", "map_layout", "layout_encoder", "joined_encoder", "MAP_BYTES"]

MAP_BYTES = 128
# CUtensorMapDataType (cuda.h, CUDA 12-13); uint8 carries e4m3
_DATA_TYPES = {"uint8": 0, "float16": 6, "bfloat16": 9, "float32": 7, "int32": 3}
_ITEMSIZE = {"uint8": 1, "float16": 2, "bfloat16": 2, "float32": 4, "int32": 4}
_SWIZZLES = {0: 0, 32: 1, 64: 2, 128: 3}                      # CUtensorMapSwizzle: none, 32B, 64B, 128B
_L2_PROMOTION_128B = 2
_INTERLEAVE_NONE = 0
_OOB_FILL_ZERO = 0


def check_tiled(ptr: int, dtype, dims: tuple, strides: tuple, box: tuple, swizzle: int) -> None:
    """The driver's rules for a tiled map, as ValueErrors. `dims` and `box` list the innermost dimension first;
    `strides` are the byte strides of dims[1:]."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in _DATA_TYPES:
        raise ValueError(f"TMA: dtype {name} is not one of {sorted(_DATA_TYPES)}")
    itemsize = _ITEMSIZE[name]
    if not 1 <= len(dims) <= 5 or len(box) != len(dims) or len(strides) != len(dims) - 1:
        raise ValueError(f"TMA: rank {len(dims)} with box {box} and strides {strides} do not fit together")
    if ptr % 16:
        raise ValueError(f"TMA: global address {ptr:#x} is not 16-byte aligned")
    for i, s in enumerate(strides):
        if s % 16 or s <= 0:
            raise ValueError(f"TMA: stride of dimension {i + 1} is {s} bytes; must be a positive multiple of 16")
    for i, (n, b) in enumerate(zip(dims, box)):
        if not 1 <= b <= 256 or n < 1:
            raise ValueError(f"TMA: box {b} of dimension {i} must be in 1..256 (dimension size {n})")
    if swizzle not in _SWIZZLES:
        raise ValueError(f"TMA: swizzle {swizzle} is not one of {sorted(_SWIZZLES)}")
    inner_bytes = box[0] * itemsize
    if inner_bytes % 16:
        raise ValueError(f"TMA: inner box of {inner_bytes} bytes is not a multiple of 16")
    if swizzle and inner_bytes > swizzle:
        raise ValueError(f"TMA: inner box of {inner_bytes} bytes exceeds the {swizzle}-byte swizzle span")


def encode_tiled(ptr: int, dtype, dims: tuple, strides: tuple, box: tuple, swizzle: int = 128) -> bytes:
    """The 128 bytes of a CUtensorMap for a tiled copy (zero fill out of bounds, 128-byte L2 promotion)."""
    key = (int(ptr), np.dtype(dtype).name, tuple(map(int, dims)), tuple(map(int, strides)), tuple(map(int, box)),
           int(swizzle))
    return _encode(*key)


def encoder(dtype, dims: tuple, strides: tuple, box: tuple, swizzle: int = 128):
    """``ptr -> encode_tiled(ptr, dtype, dims, strides, box, swizzle)`` with everything but the pointer normalized
    once: what a launch path calls per call (a cache lookup for a pointer seen before)."""
    key = (np.dtype(dtype).name, tuple(map(int, dims)), tuple(map(int, strides)), tuple(map(int, box)), int(swizzle))
    return lambda ptr: _encode(ptr, *key)


def map_layout(x, rows_box: int) -> tuple:
    """(dtype, dims, byte strides, box) of the tensor map of a layout (array or TensorSpec) with any 16-byte-aligned
    strides: padded (batch, seqlen, heads, d) as 4-D (d, heads, seqlen, batch), box (64, 1, rows_box, 1); packed
    (total, heads, d) as 3-D (d, heads, total), box (64, 1, rows_box). One 64-column panel of rows_box rows. An
    axis of extent 1 is only ever read at index 0; its stride is replaced by the contiguous one, which TMA's rules
    always accept."""
    from .checks import elem_strides
    dtype = np.dtype(x.dtype)
    shape, strides = tuple(x.shape), [n * dtype.itemsize for n in elem_strides(x)]
    contiguous = [int(np.prod(shape[i + 1:], dtype=np.int64)) * dtype.itemsize for i in range(len(shape))]
    strides = [s if n > 1 else c for n, s, c in zip(shape, strides, contiguous)]
    dims = tuple(reversed(shape))                     # innermost first: d, heads, rows[, batch]
    box = (64, 1, rows_box) + (1,) * (len(shape) - 3)
    return dtype, dims, tuple(reversed(strides[:-1])), box


def layout_encoder(x, rows_box: int):
    """ptr -> the tensor map (128-byte swizzle) of map_layout(x, rows_box) at that address."""
    return encoder(*map_layout(x, rows_box), swizzle=128)


JOINED_KEPT = 256  # pointer tuples a joined_encoder keeps (a training loop's buffers come back from its allocator)


def joined_encoder(encoders: tuple):
    """``ptrs -> encoders[0](ptrs[0]) + encoders[1](ptrs[1]) + ...``: the maps of a kernel with several, joined, kept
    per tuple of pointers (one dict lookup per call for pointers seen before). A map depends on nothing but its
    pointer and the encoder's layout, so a kept one never goes stale; the dict is emptied when full."""
    kept: dict = {}

    def encode(ptrs: tuple) -> bytes:
        maps = kept.get(ptrs)
        if maps is None:
            maps = b"".join(encode_one(ptr) for encode_one, ptr in zip(encoders, ptrs, strict=True))
            if len(kept) >= JOINED_KEPT:
                kept.clear()
            kept[ptrs] = maps
        return maps
    return encode


@functools.lru_cache(maxsize=4096)
def _encode(ptr, dtype_name, dims, strides, box, swizzle) -> bytes:
    check_tiled(ptr, dtype_name, dims, strides, box, swizzle)
    rank = len(dims)
    buf = ctypes.create_string_buffer(MAP_BYTES + 64)
    out = (ctypes.addressof(buf) + 63) & ~63  # CUtensorMap is 64-byte aligned
    status = _driver().cuTensorMapEncodeTiled(
        ctypes.c_void_p(out), _DATA_TYPES[dtype_name], rank, ctypes.c_void_p(ptr),
        (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * max(rank - 1, 1))(*strides),
        (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)),
        _INTERLEAVE_NONE, _SWIZZLES[swizzle], _L2_PROMOTION_128B, _OOB_FILL_ZERO)
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {status} (dtype {dtype_name}, dims {dims}, "
                           f"strides {strides}, box {box}, swizzle {swizzle})")
    return ctypes.string_at(out, MAP_BYTES)


@functools.lru_cache(maxsize=None)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    fn = lib.cuTensorMapEncodeTiled
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                   ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                   ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return lib
