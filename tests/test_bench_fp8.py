"""benchmarks/bench_fp8.py's JSON run (what benchmarks/report.py --fp8 reads), without a GPU."""
import importlib.util
import json
import math
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))
_spec = importlib.util.spec_from_file_location("bench_fp8", BENCH_DIR / "bench_fp8.py")
bf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bf)
_report_spec = importlib.util.spec_from_file_location("report", BENCH_DIR / "report.py")
report = importlib.util.module_from_spec(_report_spec)
_report_spec.loader.exec_module(report)


def test_json_run_reads_back_as_the_fp8_table(tmp_path, monkeypatch):
    """The device, date and versions from bench_attention's run_meta, the ceiling, a row per cell with nan (a peer
    that did not run, or --fp8-only's ceiling) as null; report.py's table reads it."""
    meta = dict(device="Test GPU", timestamp="2026-01-02T03:04:05+00:00", torch_version="2.13.0",
                cudnn_version=91900, cupy_version="14.2.0")
    monkeypatch.setattr(bf.ba, "run_meta", lambda: meta)
    rows = [dict(d=128, causal=False, seqlen=4096, batch=4, nheads=16, tflops_cuflash_fp8=900.0,
                 tflops_cudnn_fp8=math.nan, err=math.nan, tflops_cuflash_bf16=600.0, tflops_cudnn_bf16=560.0)]
    path = tmp_path / "out" / "fp8.json"
    bf.write_json(str(path), rows, 1250.0)
    run = json.loads(path.read_text())
    assert run["gpu"] == "Test GPU" and run["date"] == meta["timestamp"] and run["scaled_mm_tflops"] == 1250.0
    assert run["versions"] == dict(torch="2.13.0", cudnn=91900, cupy="14.2.0")
    assert run["rows"][0]["tflops_cudnn_fp8"] is None and run["rows"][0]["err"] is None
    assert "| 128 | no | 4096 | 900.0 | 0.72 | n/a | 600.0 | 560.0 | n/a | 1.61 |" in report.fp8_text(run)
    bf.write_json(str(path), rows, math.nan)
    assert json.loads(path.read_text())["scaled_mm_tflops"] is None
