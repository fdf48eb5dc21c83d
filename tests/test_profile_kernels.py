"""benchmarks/profile_kernels.py's reading of the profiler's trace, without a GPU."""
import importlib.util
import json
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))
_spec = importlib.util.spec_from_file_location("profile_kernels", BENCH_DIR / "profile_kernels.py")
pk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pk)


class _Trace:
    """A profile whose Chrome trace holds two kernels (one launched twice), a memset without a launch shape and a
    host event."""

    def export_chrome_trace(self, path):
        kernel = {"cat": "kernel", "name": "main", "args": {"grid": [132, 1, 1], "block": [384, 1, 1],
                                                             "registers per thread": 168, "shared memory": 216064}}
        events = [kernel, dict(kernel), {"cat": "kernel", "name": "convert", "args": {
            "grid": [1024, 1, 16], "block": [128, 1, 1], "registers per thread": 30, "shared memory": 0}},
            {"cat": "gpu_memset", "name": "Memset (Device)", "args": {}}, {"cat": "cpu_op", "name": "aten::mm"}]
        with open(path, "w") as f:
            json.dump({"traceEvents": events}, f)


def test_launch_shapes_are_read_per_kernel():
    assert pk.launch_shapes(_Trace()) == {
        "main": "grid [132, 1, 1] block [384, 1, 1] 168 registers, 216064 B shared",
        "convert": "grid [1024, 1, 16] block [128, 1, 1] 30 registers, 0 B shared"}
