"""Launching compiled kernels by pointer, for the hot path of repeated calls.

Every cuflash kernel takes one parameter struct by value whose leading fields are the data pointers
(cuda_src/params.cuh; the layouts are the ops modules' *PARAMS_DTYPE). For one call signature -- shapes,
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
    launches : sequence of (kernel, grid, block, shared_mem_bytes[, overlap])
        ``kernel`` a ``cupy.RawKernel`` loaded on the current device (``cuflash.build.get_kernel``); grid and
        block tuples of up to three ints. ``overlap`` True launches the kernel as a programmatic dependent of the
        one before it (``cuLaunchKernelEx``, Hopper's PDL): it may start while that one finishes, and must execute
        ``griddepcontrol.wait`` before it touches that kernel's results (``pdl_wait`` in types.cuh).
    params : numpy structured scalar or 0-d array
        The struct with every non-pointer field set.
    pointers : tuple of str
        The names of the struct's leading pointer fields, in order: the arguments of a call (checked against
        the struct's layout here, so a call cannot put a pointer in the wrong field). Empty for a struct that
        :meth:`launch_head` fills instead.
    """

    __slots__ = ("pointers", "launches", "_buffer", "_bytes", "_argv", "_pack", "_lock", "_kernels")

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
        self._bytes = memoryview(self._buffer).cast("B")  # slice assignment copies without a ctypes call
        self._argv = (ctypes.c_void_p * 1)(ctypes.addressof(self._buffer))  # void* args[] = {&struct}
        self._pack = struct.Struct(f"{len(pointers)}Q").pack_into
        self._lock = threading.Lock()
        self._kernels = [k for k, *_ in launches]  # keeps the modules loaded
        if launches:
            _load_driver()
        argv = ctypes.addressof(self._argv)
        self.launches = tuple(_Launch(x[0].kernel.ptr, _dim3(x[1]), _dim3(x[2]), int(x[3]), argv,
                                      len(x) > 4 and bool(x[4])) for x in launches)

    def __call__(self, stream: int, *pointers: int) -> None:
        """Launch on ``stream`` (a ``cudaStream_t`` handle; 0 is the legacy default stream) with these data
        pointers (0 for an absent array), in the order of ``self.pointers``. The device the kernels were
        loaded on must be current."""
        with self._lock:  # the struct is shared: one call writes and launches at a time (the driver copies it)
            self._pack(self._buffer, 0, *pointers)
            for launch in self.launches:
                launch(stream)

    def call_with_tail(self, stream: int, offset: int, tail: bytes, *pointers: int) -> None:
        """``self(stream, *pointers)`` with the struct's bytes from ``offset`` on replaced by ``tail`` first (the TMA
        decode kernel's tensor maps, which embed the caches' addresses, after its pointers and sizes)."""
        with self._lock:
            self._pack(self._buffer, 0, *pointers)
            self._bytes[offset:offset + len(tail)] = tail
            for launch in self.launches:
                launch(stream)

    def launch_head(self, stream: int, head: bytes) -> None:
        """Launch with the struct's first ``len(head)`` bytes replaced by ``head`` (for structs that do not start
        with plain pointers, e.g. TMA descriptors, which embed them)."""
        with self._lock:
            self._bytes[:len(head)] = head
            for launch in self.launches:
                launch(stream)

    def params(self, *pointers: int) -> bytes:
        """The struct a call with these pointers would pass (for tests)."""
        with self._lock:
            self._pack(self._buffer, 0, *pointers)
            return self._buffer.raw


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _Launch:
    """One kernel of a KernelCall: a plain cuLaunchKernel, or (overlap) cuLaunchKernelEx with programmatic stream
    serialization allowed, its config built once."""

    __slots__ = ("func", "grid", "block", "smem", "argv", "overlap", "_head", "_config", "_attr")

    def __init__(self, func: int, grid: tuple, block: tuple, smem: int, argv: int, overlap: bool):
        self.func, self.grid, self.block, self.smem, self.argv, self.overlap = func, grid, block, smem, argv, overlap
        self._head = (func, *grid, *block, smem)  # cuLaunchKernel's arguments before the stream
        if overlap:
            self._attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
            self._config = _LaunchConfig((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), smem, None,
                                         ctypes.pointer(self._attr), 1)

    def __call__(self, stream: int) -> None:
        if not self.overlap:
            _launch_kernel(*self._head, stream, self.argv, 0)
            return
        self._config.stream = stream
        status = _launch_kernel_ex(ctypes.byref(self._config), ctypes.c_void_p(self.func),
                                   ctypes.c_void_p(self.argv), None)
        if status != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed: CUresult {status}")

    def __iter__(self):  # (func, gx, gy, gz, bx, by, bz, smem, argv): the plain launch's arguments
        return iter((self.func, *self.grid, *self.block, self.smem, self.argv))

    def __getitem__(self, index):
        return tuple(self)[index]


_launch_kernel = None  # cuLaunchKernel through CuPy's binding, bound on first use (cuflash imports without CuPy)
_launch_kernel_ex = None  # cuLaunchKernelEx through ctypes on libcuda (CuPy binds no launch with attributes)


def _load_driver() -> None:
    global _launch_kernel, _launch_kernel_ex
    if _launch_kernel is None:
        from cupy_backends.cuda.api import driver
        _launch_kernel = driver.launchKernel
    if _launch_kernel_ex is None:
        try:
            fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        except (OSError, AttributeError):  # no driver here (CPU-only tests): a launch would fail anyway
            return
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        _launch_kernel_ex = fn


def _dim3(dims) -> tuple:
    dims = tuple(int(n) for n in (dims if isinstance(dims, tuple) else (dims,)))
    return dims + (1,) * (3 - len(dims))
