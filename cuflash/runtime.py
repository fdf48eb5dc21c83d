"""What a call needs from the machine: CuPy, a CUDA device, the current device and stream.

Without CuPy, or without an NVIDIA GPU and driver, the first call raises one clear error (ImportError or
RuntimeError) instead of a ModuleNotFoundError or CuPy's ``cudaErrorInsufficientDriver`` from deep inside a
launch. The check runs once per process; later calls pay one global lookup.
"""
from __future__ import annotations

import contextlib

import numpy as np

from . import checks

CUPY_MISSING = "cuflash needs CuPy: pip install 'cuflash[cuda13]' (or 'cuflash[cuda12]' for a CUDA 12 driver)"
NO_GPU = "cuflash needs an NVIDIA GPU and driver: no CUDA device found"

_gpu_ready = False


def import_cupy():
    """The cupy module, or ModuleNotFoundError (an ImportError) saying how to install it."""
    try:
        import cupy
    except ImportError as err:
        raise ModuleNotFoundError(f"{CUPY_MISSING} ({err})", name=err.name) from err
    return cupy


def require_gpu() -> None:
    """Raises ImportError without CuPy, RuntimeError without a usable CUDA device; checked once per process."""
    global _gpu_ready
    if _gpu_ready:
        return
    cupy = import_cupy()
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as err:  # CUDARuntimeError: no driver, a driver too old for this CUDA, no device
        raise RuntimeError(f"{NO_GPU} (cupy: {err})") from None
    if count < 1:
        raise RuntimeError(f"{NO_GPU} (cupy sees 0 devices)")
    _gpu_ready = True


def reset() -> None:
    """Forget the result of :func:`require_gpu` (tests)."""
    global _gpu_ready
    _gpu_ready = False


def ptr(x) -> int:
    """An array's data pointer; 0 for None."""
    return 0 if x is None else x.data.ptr


def call_key(arrays: tuple, options: tuple) -> tuple:
    """The key under which a CuPy API call's checks and plan are kept: each array's type, shape, byte strides, dtype
    and device (None where absent), and the options' :func:`~cuflash.checks.signature` (values with their types), so
    two calls with equal keys pass or fail the checks alike and plan alike. AttributeError for an argument that is
    not a CuPy array, TypeError for an option without a signature (hashing the key: for an unhashable one)."""
    return (tuple(None if x is None else (type(x), x.shape, x.strides, x.dtype, x.data.device_id) for x in arrays),
            checks.signature(options))


KEPT_CALLS = 4096  # entries a cache of checked or planned calls holds; a full one is emptied


def kept(cache: dict, arrays: tuple, options: tuple) -> tuple:
    """``(key, kept)``: the :func:`call_key` of a call's arrays and options, and what ``cache`` keeps under it (None
    where nothing); both None for a call without a key (an argument that is not a CuPy array, an unhashable option),
    whose checks then say what is wrong."""
    try:
        key = call_key(arrays, options)
        return key, cache.get(key)
    except (AttributeError, TypeError):
        return None, None


def keep(cache: dict, key, value):
    """Keep ``value`` in ``cache`` under ``key`` (unless it is None: a call without a key) and return it."""
    if key is not None:
        if len(cache) >= KEPT_CALLS:
            cache.clear()
        cache[key] = value
    return value


def device(device_id: int):
    """Switch to `device_id` unless it is current already (a context switch costs microseconds per call)."""
    import cupy
    if cupy.cuda.runtime.getDevice() == device_id:
        return contextlib.nullcontext()
    return cupy.cuda.Device(device_id)


class _StreamPointer:
    """A raw cudaStream_t as an object of the CUDA stream protocol, which `cupy.cuda.Stream.from_external` takes."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self):
        return (0, self.ptr)


_external_streams = {}  # (cudaStream_t, device) -> its cupy Stream


def external_stream(ptr: int):
    """A cupy Stream on the raw cudaStream_t `ptr` (torch's or XLA's), made once per pointer and device."""
    import cupy
    key = (ptr, cupy.cuda.runtime.getDevice())
    stream = _external_streams.get(key)
    if stream is None:
        if len(_external_streams) >= 256:  # streams a process keeps making and freeing: forget the old ones
            _external_streams.clear()
        make = getattr(cupy.cuda.Stream, "from_external", None)  # ExternalStream is deprecated where it exists
        stream = _external_streams[key] = make(_StreamPointer(ptr)) if make else cupy.cuda.ExternalStream(ptr)
    return stream


def on(stream):
    """A context making `stream` (a cupy Stream, a raw cudaStream_t or None: the current one) current."""
    if stream is None:
        return contextlib.nullcontext()
    return external_stream(stream) if isinstance(stream, int) else stream


def require_cupy_arrays(**arrays) -> None:
    """Each of `arrays` a cupy.ndarray or None."""
    cupy = import_cupy()
    for name, x in arrays.items():
        if x is not None and not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name}: expected a cupy.ndarray, got {type(x).__module__}.{type(x).__name__} "
                            "(torch and JAX arrays convert without a copy: cupy.from_dlpack(x))")


def require_device_arrays(**arrays) -> None:
    """CuPy arrays whose 16-byte chunks along the last axis are aligned (cp.async copies 16 bytes)."""
    require_cupy_arrays(**arrays)
    for name, x in arrays.items():
        if x is None:
            continue
        if x.dtype in (np.float32, np.int32):  # ALiBi slopes, lse, cu_seqlens: read one element at a time
            continue
        bad = [axis for axis, (n, s) in enumerate(zip(x.shape[:-1], x.strides[:-1])) if n > 1 and s % 16]
        if x.data.ptr % 16 or bad:
            where = f"stride of axis {bad[0]} is {x.strides[bad[0]] // x.itemsize} elements" if bad else \
                f"data pointer {x.data.ptr:#x}"
            raise ValueError(f"{name}: must be 16-byte aligned (pointer and strides multiples of 8 elements); "
                             f"{where}")


def require_device_index_arrays(**arrays) -> None:
    """Index arrays (cache_seqlens, cache_batch_idx, block_table) that are CuPy arrays."""
    cupy = import_cupy()
    for name, x in arrays.items():
        if x is not None and not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name}: expected a cupy.ndarray of int32, got "
                            f"{type(x).__module__}.{type(x).__name__}")
