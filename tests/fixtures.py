"""Fixtures and helpers shared by test modules (import the ones a module uses)."""
import contextlib
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from cuflash import settings as cuflash_settings

ROOT = Path(__file__).resolve().parents[1]


def host_program(tmp_path_factory, source: str, std: str, flags=()) -> tuple:
    """tests/`source` (C++ that includes cuda_src/ headers on the host) built with the host's compiler as
    ``(the build's CompletedProcess, the executable's path)``; the test skips where there is no g++ or clang++."""
    compiler = shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no host C++ compiler (g++ or clang++)")
    exe = tmp_path_factory.mktemp(Path(source).stem) / Path(source).stem
    build = subprocess.run([compiler, f"-std={std}", "-O1", *flags, f"-I{ROOT / 'cuda_src'}",
                            str(ROOT / "tests" / source), "-o", str(exe)], capture_output=True, text=True)
    return build, exe


@pytest.fixture
def configure():
    """``configure(**changes)``: cuflash.settings overridden for the rest of the test (cached launches are dropped
    when the settings change and again when the test ends)."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(cuflash_settings.override(**changes))


@pytest.fixture
def no_gpu_kernels(configure, monkeypatch):
    """build's device queries and kernel loading replaced: the launch objects are built, never launched. The device
    is an sm_90a one; the Hopper forward is off unless a test switches it on (the portable kernel's launches)."""
    from cuflash import build
    configure(sm90=False)
    monkeypatch.setattr(build, "get_kernel", lambda spec, device_id: SimpleNamespace(kernel=SimpleNamespace(ptr=7)))
    monkeypatch.setattr(build, "device_arch", lambda device_id: "sm_90a")
    monkeypatch.setattr(build, "sm_count", lambda device_id: 132)
    monkeypatch.setattr(build, "memory_system", lambda device_id: None)  # the planner's L2 rules off
    monkeypatch.setattr(build, "smem_bytes", lambda spec, device_id: 100 * 1024)  # read from the module on a GPU
