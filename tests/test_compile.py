"""Every kernel specialization the planner can choose compiles with NVRTC, with no local-memory spills.

Needs NVRTC (pip's nvidia-cuda-nvrtc through CuPy), no GPU. Compiles run in parallel, once per
session; each specialization is then its own test case, named after the kernel.
"""
import os
from concurrent.futures import ProcessPoolExecutor

import pytest

from cuflash import build, hopper, plan

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="needs CuPy's NVRTC bindings")

CASES = [(arch, spec) for arch in plan.ARCHS for spec in plan.all_specs(arch)]


def _compile(case):
    arch, spec = case
    try:
        _, log = build.compile_cubin(spec, arch)
        return build.resource_report(log), log
    except Exception as err:  # reported by the test of this case
        return None, str(err)


@pytest.fixture(scope="session")
def reports():
    workers = int(os.environ.get("CUFLASH_COMPILE_WORKERS", os.cpu_count() or 1))
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return dict(zip(CASES, pool.map(_compile, CASES)))


def test_specializations_exist():
    for arch in plan.ARCHS:
        assert plan.all_forward_specs(arch), f"the planner offers no forward kernel for {arch}"
        assert plan.all_backward_specs(arch), f"the planner offers no backward kernel for {arch}"


@pytest.mark.parametrize("case", CASES, ids=[f"{arch}-{spec.name}" for arch, spec in CASES])
def test_compiles_without_spills(reports, case):
    report, log = reports[case]
    assert report is not None, log
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0, (
        f"{case[1].name} on {case[0]} spills: {report}\n{log}")


def test_spill_detection_works():
    log = ("ptxas info    : Used 255 registers\n"
           "ptxas .  8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads")
    assert build.resource_report(log) == {"registers": 255, "spill_stores": 12, "spill_loads": 16}


@pytest.mark.parametrize("kernel", ["sm90_gemm_selftest", "sm90_pv_selftest"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_hopper_selftest_compiles_with_async_wgmma(dtype, kernel):
    """The Hopper primitives (sm90.cuh) assemble for sm_90a without spills, and ptxas keeps wgmma asynchronous:
    its C75xx notes (C7515 serialized, C7517 a wait_group injected because accumulators were touched in flight)
    would say otherwise. Checked against a variant that reads an accumulator before the commit: C7517."""
    import re
    from tests.sm90_selftest import SelftestSpec
    _, log = build.compile_cubin(SelftestSpec(dtype, kernel), "sm_90a")
    report = build.resource_report(log)
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0, log
    assert not re.search(r"\(C75\d\d\).*wgmma|wgmma.*serializ", log), log


@pytest.mark.parametrize("spec", hopper.all_backward_specs(), ids=lambda s: s.name)
def test_hopper_backward_compiles_with_async_wgmma(spec):
    """The Hopper backward (bwd_sm90.cu): no spills, no wgmma serialization or injected fences."""
    import re
    assert spec.smem_bytes <= 227 * 1024
    _, log = build.compile_cubin(spec, "sm_90a")
    report = build.resource_report(log)
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0, log
    assert not re.findall(r"\((C75\d\d)\)", log), log


@pytest.mark.parametrize("variant", hopper.VARIANTS)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("band", [False, True])
@pytest.mark.parametrize("score_mod", [False, True])
def test_hopper_forward_compiles_with_async_wgmma(d, band, variant, score_mod):
    import re
    for dtype in ("fp16", "bf16"):
        spec = hopper.variant_spec(variant, dtype, d, band, score_mod)
        assert spec.smem_bytes <= 227 * 1024
        _, log = build.compile_cubin(spec, "sm_90a")
        report = build.resource_report(log)
        assert report["spill_stores"] == 0 and report["spill_loads"] == 0, log
        assert not re.search(r"\(C75\d\d\).*wgmma|wgmma.*serializ", log), log
        # ptxas notes that it injected warpgroup fences (C7519): the lockstep version has them (its P V fragments are
        # packed between fence and wgmma); the warp-specialized one must have none.
        notes = set(re.findall(r"\((C75\d\d)\)", log))
        assert notes <= (set() if spec.warp_specialized else {"C7519"}), log


@pytest.mark.parametrize("variant", ["ws3_n128_p_split", "ws3_n128_p"])
def test_hopper_split_kernel_writes_o_from_registers(variant):
    """The split variant has no TMA store of O (its merge uses the staging tile: fwd_sm90.cu split_tile), whatever
    p.o_tma says; its unsplit sibling has them (the control)."""
    spec = hopper.variant_spec(variant, "bf16", 64, False, False)
    nvrtc = build._nvrtc()
    prog = nvrtc.createProgram(build.kernel_source(spec), spec.name + ".cu", [], [])
    try:
        nvrtc.addNameExpression(prog, spec.template)
        nvrtc.compileProgram(prog, list(build.nvrtc_options("sm_90a")))
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    assert ("global.shared::cta.bulk_group" in ptx) == (not spec.split), variant


def test_hopper_forward_shared_memory_is_the_kernels():
    """FwdSm90Spec.smem_bytes (what the launcher allocates) is FwdSm90::SMEM_BYTES (what the kernel lays out) for every
    Hopper forward specialization, so that no ring slot, staging tile, second Q tile or barrier lies past the
    allocation: one NVRTC program of static_asserts, compiled for sm_90a."""
    from cuflash.plan import DTYPES
    specs = hopper.all_specs()
    flag = lambda f: "true" if f else "false"  # noqa: E731
    asserts = [
        f"static_assert(cuflash::FwdSm90<{dict(DTYPES.values())[s.dtype]}, {s.headdim}, {s.block_n}, {flag(s.band)}, "
        f"{s.stages}, {s.consumers}, {flag(s.warp_specialized)}, {flag(s.score_mod)}, {flag(s.pingpong)}, "
        f"{flag(s.persistent)}, {flag(s.split)}>::SMEM_BYTES == {s.smem_bytes}, \"{s.name}\");" for s in specs]
    source = f'#include "{specs[0].source}"\n' + "\n".join(asserts) + "\n"
    nvrtc = build._nvrtc()
    prog = nvrtc.createProgram(source, "fwd_sm90_smem.cu", [], [])
    try:
        try:
            nvrtc.compileProgram(prog, list(build.nvrtc_options("sm_90a")))
        except Exception as err:
            raise AssertionError(nvrtc.getProgramLog(prog)) from err
    finally:
        nvrtc.destroyProgram(prog)
    assert len(asserts) == len(set(specs)) > 100
