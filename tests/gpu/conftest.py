"""Fixtures of the GPU suite: every allocation poisoned with NaN, kernels compiled before hypothesis runs.

Both are package-scoped: set up once, at the first test of tests/gpu/, and kept until its last one; the package's
tests run together, so that is every GPU test.
"""
import os

import pytest


@pytest.fixture(scope="package", autouse=True)
def poisoned_allocator():
    """Every CuPy allocation starts as 0xFF bytes (NaN in fp16, bf16 and fp32), so an output element the
    kernel forgets to write fails the comparison instead of passing on leftover zeros."""
    from tests.conftest import gpu_available
    if not gpu_available():
        yield None
        return
    import cupy
    pool = cupy.cuda.MemoryPool()

    def malloc(size):
        mem = pool.malloc(size)
        if size:
            cupy.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cupy.cuda.get_current_stream().ptr)
        return mem

    cupy.cuda.set_allocator(malloc)
    yield malloc
    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)


@pytest.fixture(scope="package")
def compiled():
    """Compiles every forward kernel once, in parallel, so JIT time never trips a hypothesis deadline.
    CUFLASH_TEST_COMPILE_WORKERS sets the processes (each holds a CUDA context: test processes running at once, as
    scripts/device_env.sh's run_gpu_tests_parallel starts them after compiling ahead, take 1)."""
    import cuflash
    workers = int(os.environ.get("CUFLASH_TEST_COMPILE_WORKERS", min(16, os.cpu_count() or 1)))
    return cuflash.precompile(workers=workers)
