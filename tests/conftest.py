"""GPU tests (marked `gpu`) skip themselves cleanly when no CUDA device is usable, and the summary says which
tests skipped for want of a GPU or of an optional package."""
import functools
import re

import pytest

NO_GPU = "needs a CUDA GPU"
# missing module -> the extra that installs it
EXTRAS = {"torch": "torch", "jax": "jax", "jaxlib": "jax", "transformers": "transformers"}
_SELECTED = pytest.StashKey[list]()


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected
def pytest_collection_modifyitems(config, items):
    config.stash[_SELECTED] = list(items)
    if gpu_available():
        return
    skip = pytest.mark.skip(reason=NO_GPU)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def selected_tests(request) -> list:
    """The tests that run (after -k / -m deselected some), for fixtures that prepare work for exactly those."""
    return request.config.stash.get(_SELECTED, [])


def pytest_terminal_summary(terminalreporter):
    """One line per missing optional package (with what installs it) and one for the GPU tests, when they skip."""
    missing, no_gpu = {}, 0
    for report in terminalreporter.stats.get("skipped", []):
        if not isinstance(report.longrepr, tuple):
            continue
        reason = report.longrepr[2]
        module = re.search(r"No module named '([\w.]+)'", reason)
        if module:
            name = module.group(1).split(".")[0]
            skipped = missing.setdefault(name, [0, set()])
            if report.when == "collect":  # a module that imports the package: its tests were never collected
                skipped[1].add(report.nodeid or report.longrepr[0])
            else:
                skipped[0] += 1
        elif reason.endswith(NO_GPU):
            no_gpu += 1
    write = functools.partial(terminalreporter.write_line, yellow=True)
    for name, (tests, modules) in sorted(missing.items()):
        what = [f"{len(modules)} test module{'s' * (len(modules) > 1)} ({', '.join(sorted(modules))})"] * bool(modules)
        what += [f"{tests} test{'s' * (tests > 1)}"] if tests else []
        install = f"pip install -e '.[{EXTRAS[name]}]'" if name in EXTRAS else f"pip install {name}"
        write(f"{' and '.join(what)} skipped: {name} is not installed ({install})")
    if no_gpu:
        write(f"{no_gpu} GPU tests skipped: no CUDA GPU")
