"""scripts/ncu_stalls.py on a small export of the form `ncu -i R --page source --csv --print-source sass` writes."""
import importlib.util
import io
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "ncu_stalls", Path(__file__).resolve().parent.parent / "scripts" / "ncu_stalls.py")
ncu_stalls = sys.modules[_SPEC.name] = importlib.util.module_from_spec(_SPEC)  # registered: it holds a dataclass
_SPEC.loader.exec_module(ncu_stalls)

EXPORT = '''"Kernel Name","void k(int)",
"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)","stall_barrier","stall_long_sb","stall_barrier (Not Issued)"
"0x10","      BAR.SYNC.DEFER_BLOCKING 0x0","4","4","0","4","0"
"0x20","@P0   BRA.U.ANY 0x40","10","9","10","0","9"
"0x30","      HGMMA.64x64x16.F32 R24, gdesc[UR8], RZ, !UPT","6","5","0","0","0"
"0x40","      EXIT","0","0","0","0","0"
'''


def test_read_keeps_issued_reasons_and_opcodes():
    ins = ncu_stalls.read(io.StringIO(EXPORT))
    assert [i.samples for i in ins] == [4, 10, 6, 0]
    assert ins[1].reasons == {"barrier": 10} and ins[0].reasons == {"long_sb": 4}
    assert [i.opcode for i in ins] == ["BAR", "BRA", "HGMMA", "EXIT"]


def test_report_totals_and_unexplained_samples():
    text = ncu_stalls.report(ncu_stalls.read(io.StringIO(EXPORT)), top=2, context=1)
    assert text.startswith("20 samples over 4 instructions")
    assert "barrier" in text and " 50.0%" in text  # 10 of 20 at the barrier
    assert "(no column)" in text and "6  30.0%" in text  # the HGMMA's samples have no reason column
    top = text.split("top instructions")[1].splitlines()[1]
    assert "BRA.U.ANY" in top and "barrier=10" in top


def test_not_an_export_is_refused():
    with pytest.raises(ValueError, match="SourceCounters"):
        ncu_stalls.read(io.StringIO('"a","b"\n"1","2"\n'))
