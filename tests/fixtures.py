"""Fixtures shared by test modules (import the ones a module uses)."""
import contextlib

import pytest

from cuflash import settings as cuflash_settings


@pytest.fixture
def configure():
    """``configure(**changes)``: cuflash.settings overridden for the rest of the test (cached launches are dropped
    when the settings change and again when the test ends)."""
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(cuflash_settings.override(**changes))
