"""benchmarks/bench_score_mods.py's peer without a GPU: FlexAttention (eager, on the CPU) with the benchmark's
score_mod and causal block mask computes the attention cuflash.reference does with the same softcap and ALiBi
slopes, so the benchmark's ratios compare the same work."""
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
flex_attention = pytest.importorskip("torch.nn.attention.flex_attention").flex_attention

from cuflash import reference  # noqa: E402

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_score_mods.py"
sys.path.insert(0, str(BENCH.parent))
_spec = importlib.util.spec_from_file_location("bench_score_mods", BENCH)
bsm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bsm)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mod", ["softcap", "alibi", "both"])
def test_flex_peer_matches_the_reference(mod, causal):
    b, s, h, d = 2, 256, 4, 32
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((b, s, h, d)) * 2 for _ in range(3))  # scores well past a cap of 3
    softcap = 3.0 if mod in ("softcap", "both") else 0.0
    slopes = np.array(bsm.alibi_slopes(h), np.float32) if mod in ("alibi", "both") else None
    want = reference.attention(q, k, v, causal=causal, softcap=softcap, alibi_slopes=slopes)
    qt, kt, vt = (torch.from_numpy(x).transpose(1, 2) for x in (q, k, v))  # (b, h, s, d) views, float64
    mod = bsm.flex_score_mod(softcap, torch.from_numpy(slopes).double() if slopes is not None else None)
    run = bsm.flex_call(flex_attention, qt, kt, vt, causal, mod)
    got = run().transpose(1, 2).numpy()
    assert np.abs(got - want).max() < 1e-9
    assert np.abs(got - reference.attention(q, k, v, causal=causal)).max() > 1e-2  # the mods matter here


def test_alibi_slopes_are_geometric():
    assert bsm.alibi_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]
