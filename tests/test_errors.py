"""Without CuPy, a GPU, PyTorch or JAX, cuflash says what is missing and how to get it, in one line."""
import importlib
import subprocess
import sys

import pytest

from cuflash import runtime


@pytest.fixture
def fresh_device_check(monkeypatch):
    """The process-wide device check forgotten before and after the test."""
    runtime.reset()
    yield
    runtime.reset()


def _cupy_runtime(monkeypatch, get_device_count):
    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", get_device_count)


def test_no_driver_is_one_clear_error(monkeypatch, fresh_device_check):
    def no_driver():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version")
    _cupy_runtime(monkeypatch, no_driver)
    with pytest.raises(RuntimeError, match=r"^cuflash needs an NVIDIA GPU and driver: no CUDA device found "
                                           r"\(cupy: cudaErrorInsufficientDriver") as info:
        runtime.require_gpu()
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no chained CuPy traceback


def test_no_device_is_one_clear_error(monkeypatch, fresh_device_check):
    _cupy_runtime(monkeypatch, lambda: 0)
    with pytest.raises(RuntimeError, match="no CUDA device found"):
        runtime.require_gpu()


def test_precompile_checks_the_device_first(monkeypatch, fresh_device_check):
    import cuflash
    _cupy_runtime(monkeypatch, lambda: 0)
    with pytest.raises(RuntimeError, match="cuflash needs an NVIDIA GPU"):
        cuflash.precompile()


def test_this_machine_without_a_gpu_gets_the_message(fresh_device_check):
    """Where CuPy sees no usable device (CI), the real check gives the message."""
    cupy = pytest.importorskip("cupy")
    try:
        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a GPU is present")
    except Exception:
        pass
    with pytest.raises(RuntimeError, match="cuflash needs an NVIDIA GPU and driver"):
        runtime.require_gpu()


def test_the_device_check_runs_once(monkeypatch, fresh_device_check):
    calls = []
    _cupy_runtime(monkeypatch, lambda: calls.append(1) or 1)
    for _ in range(3):
        runtime.require_gpu()
    assert calls == [1]


def test_input_errors_come_before_the_device_check(monkeypatch, fresh_device_check):
    """Bad arguments are reported as such, GPU or not (the checks need none)."""
    import numpy as np
    import cuflash
    _cupy_runtime(monkeypatch, lambda: 0)
    q = np.zeros((1, 8, 2, 64), np.float16)
    with pytest.raises(TypeError, match="expected a cupy.ndarray"):
        cuflash.attention(q, q, q)
    with pytest.raises(ValueError, match="head dim"):
        cuflash.attention(q, q, np.zeros((1, 8, 2, 32), np.float16))


def test_missing_cupy(monkeypatch, fresh_device_check):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy now raises ModuleNotFoundError
    with pytest.raises(ModuleNotFoundError, match=r"cuflash needs CuPy: pip install 'cuflash\[cuda13\]'"):
        runtime.require_gpu()
    import cuflash
    with pytest.raises(ImportError, match="cuflash needs CuPy"):
        cuflash.precompile()


def test_cuflash_imports_without_cupy():
    """import cuflash (and its pure-Python modules) needs no CuPy: only a call does."""
    code = ("import sys; sys.modules['cupy'] = None\n"
            "import cuflash, cuflash.ops, cuflash.settings, cuflash.reference\n"
            "try:\n    cuflash.precompile()\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("cuflash needs CuPy: pip install 'cuflash[cuda13]'")


@pytest.mark.parametrize("module,framework,message", [
    ("cuflash.torch", "torch", "cuflash.torch needs PyTorch: pip install torch"),
    ("cuflash.jax", "jax", "cuflash.jax needs JAX: pip install jax"),
])
def test_missing_framework(monkeypatch, module, framework, message):
    monkeypatch.setitem(sys.modules, framework, None)
    monkeypatch.delitem(sys.modules, module, raising=False)  # restored after the test if it was imported
    with pytest.raises(ModuleNotFoundError, match=message) as info:
        importlib.import_module(module)
    assert info.value.name == framework  # pytest.importorskip and similar checks still see which module is missing


def test_public_calls_without_cupy_say_so(monkeypatch, fresh_device_check):
    """Valid host arrays get as far as the CuPy check, which names the install command."""
    import numpy as np
    import cuflash
    monkeypatch.setitem(sys.modules, "cupy", None)
    q = np.zeros((1, 8, 2, 64), np.float16)
    lse = np.zeros((1, 2, 8), np.float32)
    for call in (lambda: cuflash.attention(q, q, q), lambda: cuflash.attention_backward(q, q, q, q, q, lse),
                 lambda: cuflash.attention_with_kvcache(q[:, :1], q, q)):
        with pytest.raises(ModuleNotFoundError, match=r"cuflash needs CuPy: pip install 'cuflash\[cuda13\]'"):
            call()
