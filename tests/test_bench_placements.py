"""benchmarks/bench_attention.py's placements without a GPU: a fake op.run_cell gives each placement's row, the pad
and free_memory are recorded instead of run. Each implementation's time is its median over the placements, the
ratios are those of the medians, a placement where an implementation failed (or the spot check did) decides the
merged row, and --placements 1 is one plain run_cell."""
import importlib.util
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_attention.py"
_spec = importlib.util.spec_from_file_location("bench_attention", BENCH)
ba = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_attention", ba)  # dataclasses look the module up by name
_spec.loader.exec_module(ba)

FLOPS = 1e12  # so TFLOP/s = 1000 / ms
CELL = dict(d=64, causal=False, seqlen=512, batch=32, nheads=32)


def _row(op, ms, **extra):
    """A row as forward_cell / backward_cell make it: per impl ms, TFLOP/s and error (None ms: failed), ratios."""
    row = dict(op=op, dtype="bf16", **CELL, flops=FLOPS)
    for impl, t in ms.items():
        row.update({f"ms_{impl}": t, f"tflops_{impl}": 1000 / t if t else None,
                    f"error_{impl}": None if t else f"{impl} failed"})
    row.update(extra)
    return ba.derive_ratios(row)


class _Pad:
    def __init__(self, events, nbytes):
        self.events, self.nbytes = events, nbytes
        events.append(("pad", nbytes))

    def __del__(self):
        self.events.append(("pad freed", self.nbytes))


def _placed(monkeypatch, op_name, rows, placements, alive=True):
    """placed_cell on a fake op whose run_cell returns rows one by one; (merged row, events)."""
    events, given = [], iter(rows)
    monkeypatch.setattr(ba, "allocate_pad", lambda nbytes: _Pad(events, nbytes))
    monkeypatch.setattr(ba, "free_memory", lambda: events.append(("free",)))
    monkeypatch.setattr(ba, "context_alive", lambda: alive)

    def run_cell(cell, args):
        events.append(("run",))
        return next(given)
    op = ba.Op(title="Fake", unit="TFLOP/s", grid=lambda args: [CELL], run_cell=run_cell,
               impls=ba.OPS[op_name].impls)
    args = ba.parse_args(["--op", op_name, "--placements", str(placements)])
    return ba.placed_cell(op, dict(CELL), args), events


def test_median_per_impl_and_ratios_of_the_medians(monkeypatch):
    rows = [_row("fwd", dict(cuflash=1.0, flash=2.0, cudnn=1.2), max_abs_diff=0.002, check_ok=True),
            _row("fwd", dict(cuflash=1.3, flash=2.2, cudnn=1.0), max_abs_diff=0.004, check_ok=True),
            _row("fwd", dict(cuflash=1.1, flash=2.1, cudnn=1.25), max_abs_diff=0.003, check_ok=True)]
    merged, events = _placed(monkeypatch, "fwd", rows, 3)
    assert (merged["ms_cuflash"], merged["ms_flash"], merged["ms_cudnn"]) == (1.1, 2.1, 1.2)
    assert merged["tflops_cuflash"] == pytest.approx(1000 / 1.1)
    assert merged["tflops_cudnn"] == pytest.approx(1000 / 1.2)
    assert merged["tflops_cuflash_placements"] == pytest.approx([1000.0, 1000 / 1.3, 1000 / 1.1])
    # the ratio of the medians (1.2 / 1.1), not the median of the ratios (1.25 / 1.1)
    assert merged["ratio_cudnn"] == pytest.approx(1.2 / 1.1)
    assert merged["ratio_flash"] == pytest.approx(2.1 / 1.1)
    assert "ms_efficient" not in merged and "tflops_efficient_placements" not in merged  # not run
    assert merged["max_abs_diff"] == 0.004 and merged["check_ok"] is True
    assert rows[0]["ms_cuflash"] == 1.0  # the placements' rows are left as they were
    # no pad before the first placement; each later one behind its own pad, alive while it runs
    sizes = [ba.pad_bytes(CELL, i) for i in (1, 2)]
    assert events == [("run",), ("free",), ("pad", sizes[0]), ("run",), ("pad freed", sizes[0]),
                      ("free",), ("pad", sizes[1]), ("run",), ("pad freed", sizes[1])]


def test_pad_sizes_are_reproducible_and_move():
    sizes = [ba.pad_bytes(dict(CELL), i) for i in range(1, 6)]
    assert sizes == [ba.pad_bytes(dict(reversed(CELL.items())), i) for i in range(1, 6)]
    assert len(set(sizes)) == 5 and all(0 <= n < 64 << 20 for n in sizes)
    assert ba.pad_bytes(dict(CELL, seqlen=1024), 1) != sizes[0]


def test_a_failed_placement_decides_the_backward_row(monkeypatch):
    ms = [dict(cuflash=2.0, cuflash_det=3.0, flash=4.0, cudnn=2.4),
          dict(cuflash=2.2, cuflash_det=None, flash=4.4, cudnn=2.0),
          dict(cuflash=1.8, cuflash_det=2.7, flash=4.2, cudnn=2.2)]
    rows = [_row("bwd", ms[0], max_abs_diff=0.01, max_rel_err=0.004, max_rel_l2_err=0.003, check_ok=True,
                 det_repeat_identical=True),
            _row("bwd", ms[1], max_abs_diff=0.5, max_rel_err=0.09, max_rel_l2_err=0.002, check_ok=False,
                 check_msg="cuflash dq vs SDPA flash: too far"),
            _row("bwd", ms[2], max_abs_diff=0.02, max_rel_err=0.005, max_rel_l2_err=float("nan"), check_ok=True,
                 det_repeat_identical=False)]
    merged, _ = _placed(monkeypatch, "bwd", rows, 3)
    assert merged["ms_cuflash_det"] is None and merged["tflops_cuflash_det"] is None
    assert merged["error_cuflash_det"] == "cuflash_det failed"
    assert "tflops_cuflash_det_placements" not in merged and merged["ratio_det_atomic"] is None
    assert merged["ms_cuflash"] == 2.0 and merged["ms_cudnn"] == 2.2 and merged["ms_flash"] == 4.2
    assert merged["ratio_cudnn"] == pytest.approx(2.2 / 2.0) and merged["ratio_flash"] == pytest.approx(2.1)
    assert merged["check_ok"] is False and merged["check_msg"] == "cuflash dq vs SDPA flash: too far"
    assert merged["max_abs_diff"] == 0.5 and merged["max_rel_err"] == 0.09
    assert math.isnan(merged["max_rel_l2_err"])  # nan wins
    assert merged["det_repeat_identical"] is False


def test_det_over_atomic_from_the_medians(monkeypatch):
    rows = [_row("bwd", dict(cuflash=2.0, cuflash_det=2.6)), _row("bwd", dict(cuflash=1.0, cuflash_det=3.0)),
            _row("bwd", dict(cuflash=3.0, cuflash_det=2.8))]
    merged, _ = _placed(monkeypatch, "bwd", rows, 3)
    assert merged["ratio_det_atomic"] == pytest.approx(2.8 / 2.0)
    assert merged["ratio_flash"] is None and merged["ratio_cudnn"] is None  # the peers did not run


def test_one_placement_is_one_plain_run(monkeypatch):
    row = _row("bwd", dict(cuflash=2.0, cuflash_det=3.0, flash=4.0), max_abs_diff=0.01, check_ok=True)
    before = dict(row)
    merged, events = _placed(monkeypatch, "bwd", [row], 1)
    assert merged is row and merged == before and events == [("run",)]
    assert ba.derive_ratios(dict(row)) == before and before["ratio_det_atomic"] == 1.5


def test_a_broken_context_stops_the_placements(monkeypatch):
    rows = [_row("fwd", dict(cuflash=None, cudnn=1.0)), _row("fwd", dict(cuflash=1.0, cudnn=1.0))]
    merged, events = _placed(monkeypatch, "fwd", rows, 3, alive=False)
    assert events == [("run",)] and merged["error_cuflash"] == "cuflash failed"


def test_worst_of_lets_nan_win_and_skips_none():
    assert ba.worst_of([1.0, None, 3.0, 2.0]) == 3.0
    assert math.isnan(ba.worst_of([math.inf, float("nan"), 1.0]))
    assert ba.worst_of([None]) is None


def test_run_op_says_what_a_time_is(monkeypatch, capsys):
    rows = [_row("fwd", dict(cuflash=t, cudnn=1.0), check_ok=True) for t in (1.0, 0.8, 0.9)]
    given = iter(rows)
    monkeypatch.setitem(ba.OPS, "fwd", ba.Op(title="Forward", unit="TFLOP/s", grid=lambda args: [dict(CELL)],
                                            run_cell=lambda cell, args: next(given), columns=ba.OPS["fwd"].columns))
    monkeypatch.setattr(ba, "allocate_pad", lambda nbytes: None)
    monkeypatch.setattr(ba, "free_memory", lambda: None)
    monkeypatch.setattr(ba, "context_alive", lambda: True)
    args = ba.parse_args(["--impls", "cuflash,cudnn"])
    assert args.placements == 3
    out_rows, broken, planned = ba.run_op("fwd", args)
    ba.print_table(ba.OPS["fwd"], out_rows, args)
    note = "times: medians over 3 placements (fresh tensors behind a pad of random size)"
    assert capsys.readouterr().out.count(note) == 2
    assert (broken, planned, len(out_rows), out_rows[0]["ms_cuflash"]) == (False, 1, 1, 0.9)
    assert out_rows[0]["ratio_cudnn"] == pytest.approx(1 / 0.9)


def test_placements_must_be_positive():
    assert ba.parse_args(["--placements", "1"]).placements == 1
    with pytest.raises(SystemExit):
        ba.parse_args(["--placements", "0"])


def test_the_deterministic_plan_of_each_cell_is_printed(capsys):
    """print_table's last line on the deterministic mode: how many cells added dQ in turn and by the fixed point, and
    the cells whose dQ went to slices, and how many."""
    rows = [_row("bwd", {"cuflash": 1.0, "cuflash_det": 1.1}, det_plan="fixed"),
            dict(_row("bwd", {"cuflash": 1.0, "cuflash_det": 1.2}, det_plan="slices x2"), seqlen=1024, causal=True),
            dict(_row("bwd", {"cuflash": 1.0, "cuflash_det": 1.0}, det_plan="ordered"), seqlen=2048)]
    ba.print_table(ba.OPS["bwd"], rows, ba.parse_args(["--op", "bwd"]))
    out = capsys.readouterr().out
    assert ("deterministic mode over 3 cells: ordered in 1, the fixed point in 1; slices in 64/causal/1024 x2"
            in out)
    ba.print_table(ba.OPS["bwd"], [dict(rows[1], det_plan=None)], ba.parse_args(["--op", "bwd"]))
    assert "deterministic mode" not in capsys.readouterr().out  # a package that plans otherwise: no line
