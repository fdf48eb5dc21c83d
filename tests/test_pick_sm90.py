"""scripts/pick_sm90_variants.py on synthetic bench_sm90 JSON: long cells pick the head dim's variant, short cells
the per-causal suggestions, failed checks disqualify."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "pick_sm90_variants.py"


def _rows(variant, base, short_causal_boost=1.0, check_ok=True):
    return [dict(d=d, variant=variant, causal=c, seqlen=s, check_ok=check_ok,
                 tflops_sm90=base * (short_causal_boost if c and s <= 2048 else 1.0))
            for d in (64, 128) for c in (False, True) for s in (512, 1024, 4096, 16384)]


def _pick(tmp_path, tables):
    paths = []
    for name, rows in tables.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(rows))
        paths.append(str(path))
    return subprocess.run([sys.executable, str(SCRIPT), *paths], capture_output=True, text=True, check=True)


def test_long_cells_pick_the_variant_short_cells_the_suggestion(tmp_path):
    result = _pick(tmp_path, {"a": _rows("a", 100, short_causal_boost=1.2), "b": _rows("b", 110)})
    assert result.stdout.strip() == "64:b,128:b"
    assert "{(64, False): 'b', (64, True): 'a', (128, False): 'b', (128, True): 'a'}" in result.stderr


def test_a_failed_check_disqualifies(tmp_path):
    result = _pick(tmp_path, {"a": _rows("a", 100), "b": _rows("b", 110, check_ok=False)})
    assert result.stdout.strip() == "64:a,128:a"
