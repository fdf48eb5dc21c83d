"""Launching compiled kernels by pointer, for the hot path of repeated calls.

Every cuflash kernel takes one parameter struct by value whose leading fields are the data pointers
(cuda_src/params.cuh; the layouts are cuflash.plan's *_PARAMS_DTYPE). For one call signature -- shapes,
strides, dtypes, device and options -- everything after the pointers is fixed, so a :class:`KernelCall` keeps
the struct filled in, and a call writes only the pointers and hands the struct to the driver
(``cuLaunchKernel``): no NumPy structured scalar per call, no CuPy argument marshalling, no views of the
caller's tensors. The framework wrappers call it with raw pointers and the framework's stream handle.
"""
from __future__ import annotations

import ctypes
import struct
import threading

import numpy as np


class KernelCall:
    """One or more kernels launched in order with one parameter struct.

    Parameters
    ----------
    launches : sequence of (kernel, grid, block, shared_mem_bytes)
        ``kernel`` a ``cupy.RawKernel`` loaded on the current device (``cuflash.build.get_kernel``); grid and
        block tuples of up to three ints.
    params : numpy structured scalar or 0-d array
        The struct with every non-pointer field set.
    pointers : tuple of str
        The names of the struct's leading pointer fields, in order: the arguments of a call (checked against
        the struct's layout here, so a call cannot put a pointer in the wrong field). Empty for a struct that
        :meth:`launch_head` fills instead.
    """

    __slots__ = ("pointers", "launches", "_buffer", "_argv", "_pack", "_lock", "_kernels")

    def __init__(self, launches, params, pointers: tuple):
        params = np.asarray(params)
        names = params.dtype.names
        if names[:len(pointers)] != tuple(pointers) or any(
                params.dtype.fields[n][0] != np.uint64 for n in pointers):
            raise ValueError(f"pointer fields {pointers} are not the leading uint64 fields of {names}")
        if pointers and params.dtype.fields[pointers[0]][1] != 0:
            raise ValueError("the struct must start with its pointers")
        self.pointers = tuple(pointers)
        raw = params.tobytes()
        self._buffer = ctypes.create_string_buffer(raw, len(raw))
        self._argv = (ctypes.c_void_p * 1)(ctypes.addressof(self._buffer))  # void* args[] = {&struct}
        self._pack = struct.Struct(f"{len(pointers)}Q").pack_into
        self._lock = threading.Lock()
        self._kernels = [k for k, *_ in launches]  # keeps the modules loaded
        if launches:
            _load_driver()
        argv = ctypes.addressof(self._argv)
        self.launches = tuple((k.kernel.ptr, *_dim3(grid), *_dim3(block), int(smem), argv)
                              for k, grid, block, smem in launches)

    def __call__(self, stream: int, *pointers: int) -> None:
        """Launch on ``stream`` (a ``cudaStream_t`` handle; 0 is the legacy default stream) with these data
        pointers (0 for an absent array), in the order of ``self.pointers``. The device the kernels were
        loaded on must be current."""
        with self._lock:  # the struct is shared: one call writes and launches at a time (the driver copies it)
            self._pack(self._buffer, 0, *pointers)
            for func, gx, gy, gz, bx, by, bz, smem, argv in self.launches:
                _launch_kernel(func, gx, gy, gz, bx, by, bz, smem, stream, argv, 0)

    def launch_head(self, stream: int, head: bytes) -> None:
        """Launch with the struct's first ``len(head)`` bytes replaced by ``head`` (for structs that do not start
        with plain pointers, e.g. TMA descriptors, which embed them)."""
        with self._lock:
            ctypes.memmove(self._buffer, head, len(head))
            for func, gx, gy, gz, bx, by, bz, smem, argv in self.launches:
                _launch_kernel(func, gx, gy, gz, bx, by, bz, smem, stream, argv, 0)

    def params(self, *pointers: int) -> bytes:
        """The struct a call with these pointers would pass (for tests)."""
        with self._lock:
            self._pack(self._buffer, 0, *pointers)
            return self._buffer.raw


_launch_kernel = None  # cuLaunchKernel through CuPy's binding, bound on first use (cuflash imports without CuPy)


def _load_driver() -> None:
    global _launch_kernel
    if _launch_kernel is None:
        from cupy_backends.cuda.api import driver
        _launch_kernel = driver.launchKernel


def _dim3(dims) -> tuple:
    dims = tuple(int(n) for n in (dims if isinstance(dims, tuple) else (dims,)))
    return dims + (1,) * (3 - len(dims))
