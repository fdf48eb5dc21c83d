"""Fixtures shared by test modules (import the ones a module uses)."""
import contextlib
from types import SimpleNamespace

import pytest

from cuflash import settings as cuflash_settings


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
    monkeypatch.setattr(build, "smem_bytes", lambda spec, device_id: 100 * 1024)  # read from the module on a GPU
