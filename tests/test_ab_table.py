"""scripts/ab_table.py on logs shaped as scripts/gpu_ab.sh writes them: per cell each set's mean over its rounds and
the spread, each set's median ratio to set 0, the column picked by the table's header, another tag's logs left out."""
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "ab_table.py"
HEADER = "   d causal seqlen batch heads   cuflash cuflash_det cf/flash cf/cudnn det/atom"


def _log(path, switches, rows):
    lines = [f"### {switches}: python3 benchmarks/bench_attention.py --op bwd", "### Backward (bwd): cells", HEADER]
    lines += [f"  {d}  {c}  {s}  4  32  {a}  {b}  n/a  n/a  1.1" for d, c, s, a, b in rows]
    path.write_text("\n".join(lines) + "\n")


def test_means_spreads_and_columns(tmp_path):
    _log(tmp_path / "ab_bwd_0_1.txt", "X=0", [(64, False, 1024, 100.0, 90.0), (128, True, 4096, 200.0, 150.0)])
    _log(tmp_path / "ab_bwd_0_2.txt", "X=0", [(64, False, 1024, 110.0, 92.0)])
    _log(tmp_path / "ab_bwd_1_1.txt", "X=1 Y=a,b", [(64, False, 1024, 120.0, 80.0)])
    _log(tmp_path / "ab_0_1.txt", "Z=9", [(64, False, 1024, 1.0, 1.0)])  # another A/B in the same directory
    run = lambda *a: subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), *a],  # noqa: E731
                                    capture_output=True, text=True, check=True).stdout.splitlines()
    out = run("--tag", "_bwd")
    assert out[:2] == ["set 0: X=0", "set 1: X=1 Y=a,b"]
    assert out[3].split() == ["64", "False", "1024", "105.0(", "10.0)", "120.0(", "0.0)"]
    assert out[4].split() == ["128", "True", "4096", "200.0(", "0.0)", "-"]
    assert out[5] == "set 1 / set 0: median 1.143 over 1 cell (1.143-1.143)"  # the cells both sets measured
    assert run("--tag", "_bwd", "--column", "cuflash_det")[3].split()[3:5] == ["91.0(", "2.0)"]
    assert run()[:1] == ["set 0: Z=9"] and len(run()) == 3
