"""scripts/pick_short_variants.py on synthetic bench_attention JSON: each short cell takes the fastest variant
beyond the margin, and the picks come back as a CUFLASH_SM90_SHORT_VARIANTS value whose bounds give every cell its
pick (checked through cuflash.settings' parser and cuflash.ops.forward's lookup)."""
import json
import subprocess
import sys
from pathlib import Path

from cuflash import settings
from cuflash.ops import forward

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "pick_short_variants.py"
CELLS = [(d, c, s) for d in (64, 128) for c in (False, True) for s in (512, 1024, 2048, 4096)]


def _run(tmp_path, runs):
    """runs: {label: (CUFLASH_SM90_SHORT_VARIANTS text, {cell: TFLOP/s})} -> the script's last line."""
    args = []
    for label, (text, speed) in runs.items():
        path = tmp_path / f"{label}.json"
        path.write_text(json.dumps([dict(op="fwd", d=d, causal=c, seqlen=s, tflops_cuflash=speed(d, c, s))
                                    for d, c, s in CELLS]))
        args.append(f"{label}={text}:{path}")
    out = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()[-1]


def test_each_cell_takes_its_fastest_variant_and_the_bounds_keep_it(tmp_path):
    default = "64:ws3_n128,128:pingpong_n128,64c:ws3_n128,128c:pingpong_n128"  # the long variants everywhere
    line = _run(tmp_path, {
        "base": (default, lambda d, c, s: 100.0),
        "x": ("128:x,128c:x", lambda d, c, s: 120.0 if s <= 1024 else 90.0),  # wins 512 and 1k
        "y": ("128:y", lambda d, c, s: 130.0 if s == 2048 else 80.0),         # wins 2k non-causal
        "z": ("64c:z", lambda d, c, s: 101.0),                                # within the margin: not taken
    })
    table = forward.short_table(settings.Settings.from_env({"CUFLASH_SM90_SHORT_VARIANTS": line}).sm90_short_variants)
    picks = {cell: forward.short_variant(table, *cell) for cell in CELLS if cell[2] <= forward.SM90_SHORT_SEQLEN}
    assert picks == {(128, False, 512): "x", (128, False, 1024): "x", (128, False, 2048): "y",
                     (128, True, 512): "x", (128, True, 1024): "x", (128, True, 2048): None,
                     (128, False, 4096): None, (128, True, 4096): None,
                     **{(64, c, s): None for c in (False, True) for s in (512, 1024, 2048, 4096)}}
    assert line == "128@1024:x,128@2048:y,128c@1024:x"
