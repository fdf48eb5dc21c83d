"""benchmarks/bench_flex.py's peer without a GPU: FlexAttention (eager, on the CPU) with the benchmark's score_mod,
block mask and GQA computes the attention cuflash.reference does with the same softcap, ALiBi slopes, window and
K/V heads, so the benchmark's ratios compare the same work; and its FLOP count is the mask's pairs."""
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
flex_attention = pytest.importorskip("torch.nn.attention.flex_attention").flex_attention

from cuflash import reference  # noqa: E402

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_flex.py"
sys.path.insert(0, str(BENCH.parent))
_spec = importlib.util.spec_from_file_location("bench_flex", BENCH)
bf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bf)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("mod,causal,window,group", [
    ("softcap", False, (-1, -1), 1), ("alibi", True, (-1, -1), 1), ("both", False, (-1, -1), 1),
    ("both", True, (-1, -1), 1), ("none", False, (40, 17), 1), ("none", True, (40, -1), 2),
    ("softcap", True, (100, 0), 4), ("alibi", False, (-1, 30), 2)])
def test_flex_peer_matches_the_reference(mod, causal, window, group):
    b, s, h, d = 2, 256, 4, 32
    rng = np.random.default_rng(7)
    q = rng.standard_normal((b, s, h, d)) * 2  # scores well past a cap of 3
    k, v = (rng.standard_normal((b, s, h // group, d)) * 2 for _ in range(2))
    softcap = 3.0 if mod in ("softcap", "both") else 0.0
    slopes = np.array(bf.alibi_slopes(h), np.float32) if mod in ("alibi", "both") else None
    opts = dict(causal=causal, window_size=bf.cell_window(window, causal))
    want = reference.attention(q, k, v, softcap=softcap, alibi_slopes=slopes, **opts)
    qt, kt, vt = (torch.from_numpy(x).transpose(1, 2) for x in (q, k, v))  # (b, h, s, d) views, float64
    score_mod = bf.flex_score_mod(softcap, torch.from_numpy(slopes).double() if slopes is not None else None)
    run = bf.flex_call(flex_attention, qt, kt, vt, bf.flex_mask_mod(causal, window), score_mod)
    got = run().transpose(1, 2).numpy()
    assert np.abs(got - want).max() < 1e-9
    if mod != "none":  # the mods matter here
        assert np.abs(got - reference.attention(q, k, v, **opts)).max() > 1e-2
    if window != (-1, -1):  # and so does the window
        assert np.abs(got - reference.attention(q, k, v, causal=causal, softcap=softcap,
                                                alibi_slopes=slopes)).max() > 1e-2


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(-1, -1), (0, 0), (5, 2), (-1, 3), (7, -1), (300, 300)])
def test_visible_pairs_counts_the_mask(causal, window):
    s = 64
    i, j = np.meshgrid(np.arange(s), np.arange(s), indexing="ij")
    left, right = bf.cell_window(window, causal)
    keep = np.ones((s, s), bool)
    if causal:
        keep &= j <= i
    if left >= 0:
        keep &= i - j <= left
    if right >= 0:
        keep &= j - i <= right
    want = s * s / 2 if causal and left < 0 else keep.sum()  # bench_attention.py's causal half
    assert bf.visible_pairs(s, causal, window) == want


def test_alibi_slopes_are_geometric():
    assert bf.alibi_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]


def test_arguments():
    args = bf.parse_args(["--window", "4095,0", "--group", "4", "--dims", "64,128"])
    assert args.window == (4095, 0) and args.group == 4
    with pytest.raises(SystemExit):
        bf.parse_args(["--group", "3"])  # 32 and 16 heads
    with pytest.raises(SystemExit):
        bf.parse_args(["--window", "5"])
    with pytest.raises(SystemExit):
        bf.parse_args(["--window", "-2,0"])
