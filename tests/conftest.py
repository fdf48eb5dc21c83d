"""GPU tests (marked `gpu`) skip themselves cleanly when no CUDA device is usable; tests marked `slow` (CPU tests of
several seconds each: processes per rank, large XLA graphs) run only under CUFLASH_SLOW_TESTS=1, which `.ci/run` sets.
The summary says which tests skipped for want of a GPU, of an optional package or of that setting."""
import functools
import os
import re

import pytest

NO_GPU = "needs a CUDA GPU"
SLOW = "slow: runs under CUFLASH_SLOW_TESTS=1 (.ci/run sets it)"
RUN_SLOW = os.environ.get("CUFLASH_SLOW_TESTS", "") not in ("", "0")
# missing module -> the extra that installs it
EXTRAS = {"torch": "torch", "jax": "jax", "jaxlib": "jax", "transformers": "transformers"}


@functools.lru_cache(maxsize=None)
def gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


@pytest.hookimpl(trylast=True)  # after -k / -m have deselected
def pytest_collection_modifyitems(config, items):
    # A module with work to start ahead of its tests (`start_early`: test_compile.py's compiles, in other processes)
    # gets it started now, and its tests run last, so that the work overlaps every other test; its `stop_early` drops
    # what is left when the test run ends.
    early = [item for item in items if hasattr(getattr(item, "module", None), "start_early")]
    if early and not config.option.collectonly:
        later = set(map(id, early))
        items[:] = [item for item in items if id(item) not in later] + early
        for module in dict.fromkeys(item.module for item in early):
            module.start_early([item for item in early if item.module is module])
    skip_gpu = None if gpu_available() else pytest.mark.skip(reason=NO_GPU)
    skip_slow = None if RUN_SLOW else pytest.mark.skip(reason=SLOW)
    for item in items:
        if skip_gpu and "gpu" in item.keywords:
            item.add_marker(skip_gpu)
        elif skip_slow and "slow" in item.keywords:
            item.add_marker(skip_slow)


def pytest_sessionfinish(session):  # (pytest's hook: the end of the test run)
    for module in {getattr(item, "module", None) for item in session.items}:
        if hasattr(module, "stop_early"):
            module.stop_early()


def pytest_terminal_summary(terminalreporter):
    """One line per missing optional package (with what installs it), one for the GPU tests and one for the slow
    tests, when they skip."""
    missing, no_gpu, slow = {}, 0, 0
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
        elif reason.endswith(SLOW):
            slow += 1
    write = functools.partial(terminalreporter.write_line, yellow=True)
    for name, (tests, modules) in sorted(missing.items()):
        what = [f"{len(modules)} test module{'s' * (len(modules) > 1)} ({', '.join(sorted(modules))})"] * bool(modules)
        what += [f"{tests} test{'s' * (tests > 1)}"] if tests else []
        install = f"pip install -e '.[{EXTRAS[name]}]'" if name in EXTRAS else f"pip install {name}"
        write(f"{' and '.join(what)} skipped: {name} is not installed ({install})")
    if no_gpu:
        write(f"{no_gpu} GPU tests skipped: no CUDA GPU")
    if slow:
        write(f"{slow} slow tests skipped: CUFLASH_SLOW_TESTS=1 runs them, as .ci/run does")
