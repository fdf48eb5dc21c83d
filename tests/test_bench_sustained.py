"""benchmarks/bench_sustained.py's reading of nvidia-smi's samples, without a GPU."""
import importlib.util
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))
_spec = importlib.util.spec_from_file_location("bench_sustained", BENCH_DIR / "bench_sustained.py")
bs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bs)


def test_loaded_samples_keep_the_second_half_under_load(tmp_path):
    """Idle samples (the loop's start and end) drop out, then the first half of those under load; lines that are not
    samples (a header, a cut last line) are skipped."""
    lines = ["clocks.sm [MHz], power.draw [W], clocks_throttle_reasons.active",
             "345 MHz, 72.50 W, 0x0000000000000001"]
    lines += [f"{1980 - 10 * i} MHz, {400 + 30 * i:.2f} W, 0x0000000000000000" for i in range(4)]
    lines += [f"{1750 + i} MHz, {690 + i:.2f} W, 0x0000000000000004" for i in range(4)]
    lines += ["1980 MHz, 80.10 W, 0x0000000000000000", "1980 MHz, 8"]
    log = tmp_path / "smi.csv"
    log.write_text("\n".join(lines) + "\n")
    assert bs.loaded_samples(str(log)) == [(1750 + i, 690.0 + i, "0x0000000000000004") for i in range(4)]
