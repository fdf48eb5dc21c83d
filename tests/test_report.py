"""benchmarks/report.py on a tiny synthetic run: the tables land between their markers (and again in place on a
second run), the compact README tables give ranges and bold ratios below 1, the saved run reads back, the plots
are written."""
import importlib.util
import json
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "report", Path(__file__).resolve().parent.parent / "benchmarks" / "report.py")
report = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(report)


def _row(op, d, causal, seqlen, cf, flash, cudnn, det=None):
    row = dict(device="Test GPU", timestamp="2026-01-02T03:04:05+00:00", placements=3, op=op, dtype="bf16", d=d,
               causal=causal, seqlen=seqlen, batch=16384 // seqlen, nheads=2048 // d,
               tflops_cuflash=cf, tflops_flash=flash, tflops_cudnn=cudnn,
               ratio_flash=cf / flash, ratio_cudnn=cf / cudnn)
    if det is not None:
        row.update(tflops_cuflash_det=det, ratio_det_atomic=cf / det)
    return row


@pytest.fixture
def run_files(tmp_path):
    bench = [_row("fwd", 64, False, 512, 400.0, 260.0, 390.0), _row("fwd", 64, False, 1024, 450.0, 280.0, 460.0),
             _row("bwd", 64, True, 512, 160.0, 140.0, 170.0, det=150.0),
             _row("bwd", 64, True, 1024, 240.0, 180.0, 230.0, det=220.0),
             dict(op="varlen", part="mixed", dtype="bf16", d=64, causal=False, tokens=1000, tflops_varlen=300.0,
                  tflops_padded=110.0, tflops_flash=100.0, tflops_cudnn=150.0, ratio_flash=3.0, ratio_cudnn=2.0,
                  tflops_varlen_bwd=90.0, tflops_padded_bwd=30.0),
             dict(op="fwd", dtype="bf16", d=128, causal=False, seqlen=512, error_cell="boom")]
    decode = dict(h=32, hk=8, d=128, dtype="bf16", rows=[
        dict(batch=1, len=1024, kv_mb=4.0, cuflash_us=10.0, cuflash_tbs=0.42, paged_us=11.0, flash_us=15.0,
             cudnn_us=9.0),
        dict(batch=1, len=8192, kv_mb=32.0, cuflash_us=20.0, cuflash_tbs=1.68, flash_us=30.0, cudnn_us=22.0)])
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    (tmp_path / "decode.json").write_text(json.dumps(decode))
    names = ("run", "forward", "backward", "varlen", "decode")
    doc = "# Doc\n\n" + "".join(f"<!-- bench:{n} -->\nold {n}\n<!-- /bench:{n} -->\n\ntext after {n}\n\n"
                                for n in names)
    (tmp_path / "docs.md").write_text(doc)
    (tmp_path / "README.md").write_text("intro\n<!-- bench:forward -->\n<!-- /bench:forward -->\nend\n")
    return tmp_path


def test_tables_between_markers(run_files):
    t = run_files
    args = ["--bench", str(t / "bench.json"), "--decode", str(t / "decode.json"), "--commit", "abc1234",
            "--docs", str(t / "docs.md"), "--readme", str(t / "README.md"), "--save", str(t / "results.json")]
    assert report.main(args) == 0
    doc = (t / "docs.md").read_text()
    assert "old " not in doc and all(f"text after {n}" in doc for n in ("run", "forward", "decode"))
    assert "Run: Test GPU, bf16, 2026-01-02, commit abc1234" in doc
    assert "| 64 | no | 512 | 400.0 | 260.0 | 390.0 | 1.538 | 1.026 |" in doc
    assert "| 64 | no | 1024 | 450.0 | 280.0 | 460.0 | 1.607 | **0.978** |" in doc
    assert "| 64 | yes | 512 | 160.0 | 150.0 | 140.0 | 170.0 | 1.143 | **0.941** | 1.067 |" in doc
    assert "| 64 | no | 1000 | 300.0 | 110.0 | 100.0 | 150.0 | 3.00 | 2.00 | 90.0 | 30.0 |" in doc
    assert "| 1 | 8k | 32 | 20.0 | 1.68 | n/a | 30.0 | 22.0 | 1.500 | 1.100 |" in doc
    assert "| 1 | 1k | 4 | 10.0 | 0.42 | 11.0 | 15.0 | 9.0 | 1.500 | **0.900** |" in doc
    assert "boom" not in doc  # a cell that failed to run has no row
    readme = (t / "README.md").read_text()
    assert readme.startswith("intro\n<!-- bench:forward -->\n| d | causal |") and readme.endswith("end\n")
    assert "| 64 | no | 400.0-450.0 | 260.0-280.0 | 390.0-460.0 | 1.538-1.607 | **0.978-1.026** |" in readme

    # the saved run gives the same tables; a second rewrite replaces the first in place
    assert report.main(["--results", str(t / "results.json"), "--docs", str(t / "docs.md")]) == 0
    assert (t / "docs.md").read_text() == doc


def test_missing_marker_and_missing_file(run_files, capsys):
    t = run_files
    (t / "other.md").write_text("no markers here\n")
    assert report.main(["--bench", str(t / "bench.json"), "--decode", str(t / "absent.json"),
                        "--docs", str(t / "other.md")]) == 0
    err = capsys.readouterr().err
    assert "absent.json not found" in err and "<!-- bench:forward -->" in err
    assert (t / "other.md").read_text() == "no markers here\n"


def test_plots(run_files):
    pytest.importorskip("matplotlib")
    t = run_files
    assert report.main(["--bench", str(t / "bench.json"), "--decode", str(t / "decode.json"),
                        "--plots", str(t / "plots")]) == 0
    for name in ("forward", "backward", "decode"):
        assert (t / "plots" / f"{name}.png").stat().st_size > 1000


def test_runs_of_their_own_are_named():
    """A backward or decode table measured in another run than the forward: the run line and the plots' titles name
    that run's date and commit."""
    meta = dict(device="H200", dtype="bf16", date="2026-01-01", commit="aaa1111", bwd_date="2026-01-02",
                bwd_commit="bbb2222", decode_date="2026-01-03", decode_commit="ccc3333")
    assert report.plot_title(meta) == "H200, bf16, 2026-01-01, commit aaa1111"
    assert report.plot_title(meta, "bwd") == "H200, bf16, 2026-01-02, commit bbb2222"
    assert report.plot_title(meta, "decode") == "H200, bf16, 2026-01-03, commit ccc3333"
    text = report.run_text(dict(meta=meta, bench=[]))
    assert "Backward: 2026-01-02, commit bbb2222." in text and "Decode: 2026-01-03, commit ccc3333." in text


def _overhead_run():
    def row(group, call, shape, cf, peer, peer_name="SDPA cudnn", **extra):
        return dict(group=group, call=call, shape=shape, dims=f"dims of {shape}", peer=peer_name, cuflash_us=cf,
                    peer_us=peer, ratio=cf / peer if peer else None, **extra)
    rows = [row("torch", "forward", "small", 18.0, 20.0, cuflash_gpu_us=6.0, cuflash_gpu_exact=True,
                peer_gpu_us=7.5, peer_gpu_exact=False, cupy_us=14.0),
            row("torch", "kvcache", "b1 8k", 30.0, 24.0, cuflash_gpu_us=21.0, cuflash_gpu_exact=True,
                peer_gpu_us=22.0, peer_gpu_exact=True, cupy_us=21.5),
            row("torch", "kvcache, append", "b1 8k", 25.0, None, peer_name="SDPA none",
                peer_error="cudnn: RuntimeError: No available kernel"),
            row("jax", "jit forward", "small", 40.0, 50.0, peer_name="jax.nn cudnn")]
    return dict(gpu="Test GPU", date="2026-01-02T03:04:05+00:00", dtype="bfloat16",
                versions=dict(torch="2.13.0", cudnn=91900, cupy="14.2.0", jax="0.10.2"), rows=rows)


def test_overhead_table(run_files):
    t = run_files
    (t / "overhead.json").write_text(json.dumps(_overhead_run()))
    doc = (t / "docs.md").read_text().replace("text after decode", "<!-- bench:overhead -->\nold overhead\n"
                                                                   "<!-- /bench:overhead -->\n\nend")
    (t / "docs.md").write_text(doc)
    # an overhead run alone writes its own table and leaves the other tables and their run line alone
    assert report.main(["--overhead", str(t / "overhead.json"), "--commit", "def5678",
                        "--docs", str(t / "docs.md")]) == 0
    doc = (t / "docs.md").read_text()
    assert "old run" in doc and "old forward" in doc and "old overhead" not in doc
    assert "<!-- /bench:overhead -->\n\nend" in doc
    assert ("Run: Test GPU, bfloat16, 2026-01-02, commit def5678 (torch 2.13.0, cuDNN 9.19.0, CuPy 14.2.0, "
            "JAX 0.10.2).") in doc
    assert "| torch forward | small | SDPA cudnn | 18.0 | 20.0 | 0.90x | 6.0 | ≤7.5 | 14.0 |" in doc
    assert "≤: an upper bound" in doc
    assert "| torch kvcache | b1 8k | SDPA cudnn | 30.0 | 24.0 | **1.25x** | 21.0 | 22.0 | 21.5 |" in doc
    assert "| torch kvcache, append | b1 8k | SDPA none | 25.0 | n/a | n/a | n/a | n/a | n/a |" in doc
    assert "| jax jit forward | small | jax.nn cudnn | 40.0 | 50.0 | 0.80x | n/a | n/a | n/a |" in doc
    assert "Shapes: small: dims of small; b1 8k: dims of b1 8k." in doc
    assert "torch kvcache, append, b1 8k: cudnn: RuntimeError: No available kernel" in doc
    assert ("Every torch entry point at most 1.0x its SDPA peer's wall time: **no** (1 of 3 rows; highest: kvcache, "
            "b1 8k, 1.25x).") in doc

    # saved with the other tables: --overhead with --results keeps their run (and commit), and reads back the same
    assert report.main(["--bench", str(t / "bench.json"), "--decode", str(t / "decode.json"), "--commit", "abc1234",
                        "--save", str(t / "results.json")]) == 0
    assert report.main(["--results", str(t / "results.json"), "--overhead", str(t / "overhead.json"), "--commit",
                        "def5678", "--save", str(t / "results.json"), "--docs", str(t / "docs.md")]) == 0
    saved = json.loads((t / "results.json").read_text())
    assert saved["meta"]["commit"] == "abc1234" and saved["overhead"]["commit"] == "def5678"
    doc = (t / "docs.md").read_text()
    assert "Run: Test GPU, bf16, 2026-01-02, commit abc1234" in doc and "commit def5678 (torch 2.13.0" in doc
    assert report.main(["--results", str(t / "results.json"), "--docs", str(t / "docs.md")]) == 0
    assert (t / "docs.md").read_text() == doc


def test_varlen_table_has_an_fp8_column_when_measured():
    row = dict(op="varlen", part="mixed", d=128, causal=True, tokens=2000, tflops_varlen=400.0, tflops_padded=200.0,
               tflops_flash=150.0, tflops_cudnn=250.0, ratio_flash=2.667, ratio_cudnn=1.6)
    assert "fp8" not in report.varlen_table([row])
    text = report.varlen_table([dict(row, tflops_varlen_fp8=600.0)])
    assert "| d | causal | tokens | varlen | varlen fp8 | padded cuflash |" in text
    assert "| 128 | yes | 2000 | 400.0 | 600.0 | 200.0 | 150.0 | 250.0 | 2.67 | 1.60 |" in text


def _fp8_run():
    def row(d, causal, seqlen, fp8, cudnn_fp8, bf16, cudnn_bf16):
        return dict(d=d, causal=causal, seqlen=seqlen, batch=16384 // seqlen, nheads=2048 // d,
                    tflops_cuflash_fp8=fp8, tflops_cudnn_fp8=cudnn_fp8, err=0.01, tflops_cuflash_bf16=bf16,
                    tflops_cudnn_bf16=cudnn_bf16)
    rows = [row(128, False, 4096, 900.0, 1000.0, 600.0, 560.0), row(64, True, 1024, 300.0, None, 340.0, 300.0),
            row(128, False, 1024, 700.0, 700.0, 590.0, 580.0)]
    return dict(gpu="Test GPU", date="2026-01-02T03:04:05+00:00", dtype="e4m3",
                versions=dict(torch="2.13.0", cudnn=91900, cupy="14.2.0"), scaled_mm_tflops=1250.0, rows=rows)


def test_fp8_table_saved_and_read_back(run_files):
    """bench_fp8.py's run, a run of its own: its table (with its own run line and the GEMM ceiling) between the fp8
    markers, cells sorted by head dim, mask and seqlen, bold ratios below 1, n/a for a peer that did not run; saved
    beside the other runs and read back the same."""
    t = run_files
    (t / "fp8.json").write_text(json.dumps(_fp8_run()))
    doc = (t / "docs.md").read_text().replace("text after decode", "<!-- bench:fp8 -->\nold fp8\n<!-- /bench:fp8 -->\n")
    (t / "docs.md").write_text(doc)
    assert report.main(["--fp8", str(t / "fp8.json"), "--commit", "def5678", "--docs", str(t / "docs.md")]) == 0
    doc = (t / "docs.md").read_text()
    assert "old run" in doc and "old forward" in doc and "old fp8" not in doc
    assert ("Run: Test GPU, e4m3, 2026-01-02, commit def5678 (torch 2.13.0, cuDNN 9.19.0, CuPy 14.2.0); "
            "`torch._scaled_mm` e4m3 8192^3 at 1250.0 TFLOP/s.") in doc
    lines = [line for line in doc.splitlines() if line.startswith("| 64") or line.startswith("| 128")]
    assert lines == ["| 64 | yes | 1024 | 300.0 | 0.24 | n/a | 340.0 | 300.0 | n/a | 1.00 |",
                     "| 128 | no | 1024 | 700.0 | 0.56 | 700.0 | 590.0 | 580.0 | 1.00 | 1.21 |",
                     "| 128 | no | 4096 | 900.0 | 0.72 | 1000.0 | 600.0 | 560.0 | **0.90** | 1.61 |"]

    assert report.main(["--bench", str(t / "bench.json"), "--commit", "abc1234", "--save",
                        str(t / "results.json")]) == 0
    assert report.main(["--results", str(t / "results.json"), "--fp8", str(t / "fp8.json"), "--commit", "def5678",
                        "--save", str(t / "results.json")]) == 0
    saved = json.loads((t / "results.json").read_text())
    assert saved["meta"]["commit"] == "abc1234" and saved["fp8"]["commit"] == "def5678"
    assert report.main(["--results", str(t / "results.json"), "--docs", str(t / "docs.md")]) == 0
    assert [line for line in (t / "docs.md").read_text().splitlines() if line.startswith("| 128")] == lines[1:]


def test_fp8_plot(run_files):
    """An FP8 run alone plots fp8.png and nothing else."""
    pytest.importorskip("matplotlib")
    t = run_files
    (t / "fp8.json").write_text(json.dumps(_fp8_run()))
    assert report.main(["--fp8", str(t / "fp8.json"), "--plots", str(t / "plots")]) == 0
    assert (t / "plots" / "fp8.png").stat().st_size > 1000
    assert not (t / "plots" / "forward.png").exists()
