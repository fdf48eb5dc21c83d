"""Run-time compilation of ``cuda_src/`` with NVRTC.

Kernels are templates; a specialization (e.g. a :class:`~cuflash.ops.forward.FwdSpec`) is instantiated through
NVRTC's name expressions, compiled for the device's own architecture (``sm_90a`` on Hopper), and
memoized per device. CuPy's on-disk cache keys on the source text and the options, not on headers
reached through ``-I``, so the options carry a hash of every file in ``cuda_src/``: editing a header
can never serve a stale kernel.
"""
from __future__ import annotations

import functools
import hashlib
import re
import sys
from pathlib import Path
from typing import NamedTuple, Optional


def _find_source_dir() -> Path:
    installed = Path(__file__).resolve().parent / "cuda_src"  # wheel: shipped inside the package
    if installed.is_dir():
        return installed
    return Path(__file__).resolve().parent.parent / "cuda_src"  # source checkout


SOURCE_DIR = _find_source_dir()


@functools.lru_cache(maxsize=None)
def source_hash() -> str:
    h = hashlib.sha256()
    for path in sorted(SOURCE_DIR.rglob("*.cu*")):  # subfolders too
        h.update(path.relative_to(SOURCE_DIR).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def nvrtc_options(arch: str) -> tuple:
    return (
        f"-arch={arch}",
        "-std=c++17",
        "--use_fast_math",
        f"-I{SOURCE_DIR}",
        f"-DCUFLASH_SOURCE_HASH=0x{source_hash()}",  # keys CuPy's disk cache on all of cuda_src/
    )


def kernel_source(spec) -> str:
    return f'#include "{spec.source}"\n'


@functools.lru_cache(maxsize=None)
def _nvrtc():
    from cupy_backends.cuda.libs import nvrtc
    return nvrtc


def compile_cubin(spec, arch: str) -> tuple[bytes, str]:
    """Compiles one specialization for `arch` with NVRTC alone (no GPU needed).

    Returns the cubin and the compiler log, which holds ptxas's resource report (registers,
    stack frame, spill stores/loads).
    """
    nvrtc = _nvrtc()
    prog = nvrtc.createProgram(kernel_source(spec), spec.name + ".cu", [], [])
    try:
        nvrtc.addNameExpression(prog, spec.template)
        try:
            nvrtc.compileProgram(prog, list(nvrtc_options(arch)) + ["--ptxas-options=-v"])
        except Exception as err:  # NVRTCError: the log says why
            raise RuntimeError(f"NVRTC failed to compile {spec.name} for {arch}:\n"
                               f"{nvrtc.getProgramLog(prog)}") from err
        return nvrtc.getCUBIN(prog), nvrtc.getProgramLog(prog)
    finally:
        nvrtc.destroyProgram(prog)


@functools.lru_cache(maxsize=None)
def device_arch(device_id: int) -> str:
    import cupy
    from .plan import arch_of
    return arch_of(cupy.cuda.Device(device_id).compute_capability)


@functools.lru_cache(maxsize=None)
def sm_count(device_id: int) -> int:
    """Multiprocessors of a device (asked once: ``Device.attributes`` queries every attribute)."""
    import cupy
    return cupy.cuda.runtime.deviceGetAttribute(cupy.cuda.runtime.cudaDevAttrMultiProcessorCount, device_id)


class MemorySystem(NamedTuple):
    l2_bytes: int
    bandwidth: float  # bytes per second of device memory at its peak clock (double data rate)


@functools.lru_cache(maxsize=None)
def memory_system(device_id: int) -> Optional[MemorySystem]:
    """A device's L2 size and memory bandwidth, or None where the runtime does not say them."""
    import cupy
    rt = cupy.cuda.runtime
    try:
        l2 = rt.deviceGetAttribute(rt.cudaDevAttrL2CacheSize, device_id)
        khz = rt.deviceGetAttribute(rt.cudaDevAttrMemoryClockRate, device_id)
        bits = rt.deviceGetAttribute(rt.cudaDevAttrGlobalMemoryBusWidth, device_id)
    except Exception:  # no such device, or an attribute this runtime no longer has
        return None
    if l2 <= 0 or khz <= 0 or bits <= 0:
        return None
    return MemorySystem(l2, 2.0 * khz * 1e3 * bits / 8)


_kernels: dict = {}
_smem: dict = {}


def get_kernel(spec, device_id: int):
    """The compiled kernel of `spec` on device `device_id` (compiled once per device and process).

    A spec whose kernel states its own shared-memory size (`spec.smem_symbol`: the name expression of a
    ``__device__ const unsigned`` beside the kernel) has that size read from the compiled module; see
    :func:`smem_bytes`."""
    key = (spec, device_id)
    kernel = _kernels.get(key)
    if kernel is None:
        import cupy
        symbol = getattr(spec, "smem_symbol", None)
        with cupy.cuda.Device(device_id):
            module = cupy.RawModule(code=kernel_source(spec), options=nvrtc_options(device_arch(device_id)),
                                    name_expressions=[spec.template] + ([symbol] if symbol else []))
            kernel = module.get_function(spec.template)
            if symbol:
                size = module.get_global(module.module.mapping[symbol])
                smem = int(cupy.ndarray((), dtype=cupy.uint32, memptr=size).get())
            else:
                smem = spec.smem_bytes
            if smem > 48 * 1024:
                kernel.max_dynamic_shared_size_bytes = smem
        _smem[key] = smem
        _kernels[key] = kernel
    return kernel


def smem_bytes(spec, device_id: int) -> int:
    """The dynamic shared memory (bytes) a launch of `spec`'s kernel on `device_id` requests: what the compiled
    module states for specs with an `smem_symbol`, else `spec.smem_bytes`."""
    get_kernel(spec, device_id)
    return _smem[(spec, device_id)]


def _precompile_worker(args):
    specs, device_id = args
    for spec in specs:
        get_kernel(spec, device_id)  # fills CuPy's disk cache, which the parent then reads
    return len(specs)


def precompile(specs=None, device_id: int | None = None, workers: int = 1, progress: bool = True) -> list[str]:
    """Compiles kernels ahead of time, so that first calls do not wait for NVRTC.

    Parameters
    ----------
    specs : iterable of specs, optional
        Defaults to every kernel the planner can choose on this device (forward and backward).
    device_id : int, optional
        Defaults to the current CuPy device.
    workers : int
        Compile in this many processes first (each fills CuPy's on-disk kernel cache); the kernels
        are then loaded here from that cache.
    progress : bool
        Print one line per kernel to stderr.

    Returns
    -------
    list of str
        The names of the compiled kernels.
    """
    from .ops import all_specs
    from .runtime import import_cupy, require_gpu
    require_gpu()
    cupy = import_cupy()
    if device_id is None:
        device_id = cupy.cuda.Device().id
    specs = list(specs) if specs is not None else all_specs(device_arch(device_id))
    if workers > 1 and len(specs) > 1:
        import multiprocessing
        chunks = [(specs[i::workers], device_id) for i in range(min(workers, len(specs)))]
        if progress:
            print(f"[cuflash] compiling {len(specs)} kernels in {len(chunks)} processes", file=sys.stderr, flush=True)
        # spawn (a forked CUDA context is unusable); an executor, not a Pool: a worker that dies on start (e.g.
        # a __main__ that spawn cannot re-import, like a script on stdin) raises BrokenProcessPool at once
        # instead of being respawned forever
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(len(chunks), mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_precompile_worker, chunks))
    names = []
    for i, spec in enumerate(specs, 1):
        if progress and workers <= 1:
            print(f"[cuflash] compiling {i}/{len(specs)} {spec.name}", file=sys.stderr, flush=True)
        get_kernel(spec, device_id)
        names.append(spec.name)
    return names


_SPILL_RE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS_RE = re.compile(r"Used (\d+) registers")


def resource_report(log: str) -> dict:
    """Registers and spill bytes from a ptxas `-v` log (the first kernel in it)."""
    spill = _SPILL_RE.search(log)
    regs = _REGS_RE.search(log)
    if spill is None or regs is None:
        raise ValueError("no ptxas resource report in the log")
    return {"registers": int(regs.group(1)), "spill_stores": int(spill.group(1)),
            "spill_loads": int(spill.group(2))}
