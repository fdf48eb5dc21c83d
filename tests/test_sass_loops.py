"""scripts/sass_loops.py: the loops it finds in a disassembly (nvdisasm's labels and cuobjdump's offsets) and their
opcode counts; with ptxas, nvdisasm and NVRTC at hand, one kernel end to end."""
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "sass_loops", Path(__file__).resolve().parent.parent / "scripts" / "sass_loops.py")
sass_loops = sys.modules[_SPEC.name] = importlib.util.module_from_spec(_SPEC)  # registered: it holds a dataclass
_SPEC.loader.exec_module(sass_loops)

NVDISASM = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   IMAD.WIDE.U32 R2, R3, 0x4, RZ ;
.L_x_0:
        /*0020*/                   LOP3.LUT R4, R2, R3, RZ, 0x96, !PT ;
        /*0030*/              @!P0 BRA `(.L_x_0) ;
        /*0040*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;
        /*0050*/              @P1  BRA `(.L_x_1) ;
        /*0060*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*0070*/                   EXIT ;
"""

CUOBJDUMP = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;                       /* 0x000000 */
        /*0010*/                   FMNMX.FTZ R3, R4, R5, !PT ;                  /* 0x000000 */
        /*0020*/                   MUFU.EX2 R6, R6 ;                            /* 0x000000 */
        /*0030*/              @!UP0 BRA 0x10 ;                                  /* 0x000000 */
        /*0040*/                   EXIT ;                                       /* 0x000000 */
"""


def test_loops_from_labels_nested_and_forward_branches_left_out():
    found = sass_loops.loops(NVDISASM)
    assert [(loop.start, loop.end, loop.length) for loop in found] == [(0x10, 0x50, 5), (0x20, 0x30, 2)]
    assert found[0].ops == {"IMAD": 1, "LOP3": 1, "BRA": 2, "HGMMA": 1}  # opcodes without modifiers
    assert found[1].ops == {"LOP3": 1, "BRA": 1}


def test_loops_from_offsets():
    (loop,) = sass_loops.loops(CUOBJDUMP)
    assert (loop.start, loop.end) == (0x10, 0x30) and loop.ops == {"FMNMX": 1, "MUFU": 1, "BRA": 1}
    assert [op for _, op, _ in sass_loops.instructions(CUOBJDUMP)] == ["MOV", "FMNMX", "MUFU", "BRA", "EXIT"]


def test_highest_register_leaves_out_rz_and_uniform_registers():
    assert sass_loops.highest_register(NVDISASM) == 24
    assert sass_loops.highest_register(CUOBJDUMP) == 6
    two = "        /*0000*/  MOV R7, UR12 ;\n        /*0010*/  IADD3 R2, RZ, R7, RZ ;"
    assert sass_loops.highest_register(two) == 7
    assert sass_loops.highest_register("        /*0000*/  EXIT ;") == -1


def test_a_name_that_matches_several_kernels_is_refused():
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="the specs import CuPy")
    with pytest.raises(SystemExit, match="names 2 kernels"):
        sass_loops.find_spec("_d128_drop", "sm_90a")  # the bf16 and the fp16 kernel


@pytest.mark.skipif(shutil.which("ptxas") is None, reason="needs ptxas (the CUDA toolkit)")
def test_one_kernel_end_to_end(capsys):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="needs CuPy's NVRTC bindings")
    try:
        sass_loops.tool("nvdisasm")
    except SystemExit:
        pytest.skip("needs nvdisasm (pip install nvidia-cuda-nvdisasm)")
    assert sass_loops.main(["bwd_convert_dq_bf16", "--min", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("bwd_convert_dq_bf16 (sm_90a") and "spill stores" in out and "loop 0x" in out
    assert "highest register: R" in out
