"""The kernels compile with NVRTC for their architectures, without local-memory spills.

Needs NVRTC (pip's nvidia-cuda-nvrtc through CuPy), no GPU. Every compile of this module runs in one pool of
processes (CUFLASH_COMPILE_WORKERS, default: the CPUs this process may use), started as soon as pytest has collected
(`start_early`, called by conftest.py), so that the compiles run beside the other modules' tests; this module's tests
run last, each compile its own test case, named after the kernel.

Two sweeps:

- ``CUFLASH_COMPILE_ALL=1`` (what ``.ci/run`` sets): every specialization the planner can choose, in one dtype of
  the two by turns (``one_dtype``: fp16 and bf16 differ only in their conversions), for sm_80 and sm_90a (portable
  forward, backward and decode with their helper kernels: each architecture the other dtype of a specialization), the
  Hopper forward (each variant of ``forward_sm90.VARIANTS`` at each head dim, band and score mod), every Hopper
  backward, the FP8 forward and its V^T pass, the Hopper self-tests: about 570 compiles.
- By default, a representative subset of about 80 compiles, so that README's test command stays near three
  minutes on two cores. The specializations are grouped, and each group compiles one member, the k-th group its
  k-th member in the planner's order, so that both dtypes, the band and the score mod each appear across the groups:
  the portable kernels by kernel family, source and head dim over both architectures (each helper kernel its own
  group; the k-th group for the k-th architecture by turns), the Hopper backward and the FP8 forward by everything
  but their dtype, band, score mod and the FP8 form, and the Hopper forward by its variant's structure (each at one
  of its head dims, by turns). Every .cu file, kernel family, head dim, Hopper backward configuration and Hopper
  forward variant structure compiles at least once; a spill that only one architecture, tile, dtype, band, score
  mod or (Hopper forward) head dim shows needs the full sweep, which CI runs.

The checks that read PTX (the split kernel's O store) or compile a static_assert program (the Hopper forward's
shared-memory layout) run in both sweeps.
"""
import dataclasses
import itertools
import os
import re
from concurrent.futures import ProcessPoolExecutor

import pytest

from cuflash import build, ops, plan
from cuflash.ops import backward, backward_sm90, forward, forward_fp8, forward_sm90
from tests.sm90_selftest import KERNELS as SELFTEST_KERNELS, SelftestSpec

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="needs CuPy's NVRTC bindings")

# What this module uses of cuflash, gathered here: a move inside cuflash changes only these lines.
ARCHS = plan.ARCHS                                 # the architectures the planner compiles for
portable_specs = ops.all_specs                     # arch -> portable forward, backward, decode and helper kernels
forward_specs = forward.all_specs                  # arch -> the portable forward kernels
backward_specs = backward.all_specs                # arch -> the portable backward kernels
hopper_forward_specs = forward_sm90.all_specs      # every Hopper forward: variant x head dim x dtype x options
hopper_variants = forward_sm90.VARIANTS            # the Hopper forward's variants
hopper_variant_spec = forward_sm90.variant_spec    # (variant, dtype, head dim, band, score mod) -> its spec
hopper_backward_specs = backward_sm90.all_specs    # every Hopper backward
fp8_specs = forward_fp8.all_specs                  # the FP8 forward (each head dim, band, form, V^T source), its pass
compile_cubin = build.compile_cubin                # (spec, arch) -> (cubin, log with ptxas's resource report)
resource_report = build.resource_report            # log -> registers, spill stores, spill loads
nvrtc = build._nvrtc                               # CuPy's NVRTC bindings
nvrtc_options = build.nvrtc_options                # arch -> the options cuflash compiles with
kernel_source = build.kernel_source                # spec -> the source NVRTC compiles
C_TYPES = dict(plan.DTYPES.values())               # "fp16" / "bf16" -> the C++ element type

HOPPER = "sm_90a"
COMPILE_ALL = os.environ.get("CUFLASH_COMPILE_ALL", "") not in ("", "0")
VARYING = ("dtype", "band", "score_mod", "pipelined")  # the fields the subset does not spread over


def one_dtype(specs: list, turn: int = 0) -> list:
    """Of the specializations that differ only in their dtype, one: fp16 and bf16 by turns over the groups, the k-th
    group its (k + turn)-th member (they differ only in their conversions, which take about the same instructions
    and registers in both; a kernel at the edge of spilling can still spill in one dtype alone, so a change that
    shifts the groups' turns may bring such a twin into the sweep). Specs without a dtype (the FP8 forward) are their
    own group."""
    groups = {}
    for spec in specs:
        typed = any(f.name == "dtype" for f in dataclasses.fields(spec)) if dataclasses.is_dataclass(spec) else False
        groups.setdefault(dataclasses.replace(spec, dtype="") if typed else spec, []).append(spec)
    return [members[(k + turn) % len(members)] for k, members in enumerate(groups.values())]


def representative(specs: list, turn: int = 0, varying: tuple = VARYING) -> list:
    """One specialization per group of specs alike but for their `varying` fields (the k-th group its (k + turn)-th
    member, cyclically); under CUFLASH_COMPILE_ALL=1 every specialization in one dtype of the two (`one_dtype`)."""
    if COMPILE_ALL:
        return one_dtype(specs, turn)
    groups = {}
    for spec in specs:
        key = (type(spec),) + tuple((f.name, getattr(spec, f.name)) for f in dataclasses.fields(spec)
                                    if f.name not in varying)
        groups.setdefault(key, []).append(spec)
    return [members[(k + turn) % len(members)] for k, members in enumerate(groups.values())]


@dataclasses.dataclass(frozen=True)
class Program:
    """A source compiled for its PTX or its diagnostics alone (no kernel instantiated by name)."""

    name: str
    text: str
    template: str | None = None


@dataclasses.dataclass(frozen=True)
class Job:
    """One NVRTC compile: `spec` (a kernel specialization, or a Program) for `arch`; `output` is "log" (the cubin's
    compiler log, with ptxas's resource report) or "ptx"."""

    arch: str
    spec: object
    output: str = "log"


def _ptx(program: Program, arch: str) -> str:
    lib = nvrtc()
    prog = lib.createProgram(program.text, program.name + ".cu", [], [])
    try:
        if program.template is not None:
            lib.addNameExpression(prog, program.template)
        try:
            lib.compileProgram(prog, list(nvrtc_options(arch)))
        except Exception as err:  # NVRTCError: the log says why
            raise RuntimeError(f"NVRTC failed to compile {program.name} for {arch}:\n"
                               f"{lib.getProgramLog(prog)}") from err
        ptx = lib.getPTX(prog)
    finally:
        lib.destroyProgram(prog)
    return ptx.decode() if isinstance(ptx, bytes) else ptx


def _compile(job: Job) -> tuple:
    """(True, the log or the PTX) or (False, why the compile failed); runs in a worker process."""
    try:
        if job.output == "ptx":
            spec = job.spec
            program = spec if isinstance(spec, Program) else Program(spec.name, kernel_source(spec), spec.template)
            return True, _ptx(program, job.arch)
        return True, compile_cubin(job.spec, job.arch)[1]
    except Exception as err:  # reported by the test of this job
        return False, f"{type(err).__name__}: {err}"


def _shared_memory_program() -> Program:
    """One kernel that reads the shared-memory size each Hopper kernel states (fwd_sm90.cu, bwd_sm90.cu) for every
    specialization, by the name expression the launcher reads it with (`spec.smem_symbol`): each one instantiates,
    and with it each specialization's layout and its static_assert against the 227 KB budget."""
    specs = hopper_forward_specs() + hopper_backward_specs()
    sources = "".join(f'#include "{source}"\n' for source in dict.fromkeys(s.source for s in specs))
    reads = [f"    out[{i}] = {s.smem_symbol.lstrip('&')};  // {s.name}" for i, s in enumerate(specs)]
    text = sources + "extern \"C\" __global__ void sm90_smem_sizes(unsigned* out) {\n" + "\n".join(reads) + "\n}\n"
    return Program("sm90_smem", text)


def portable_jobs() -> list:
    """The portable kernels' jobs. They compile for both architectures from one source. The full sweep: each
    architecture takes the other dtype of a group (turn), so that every portable specialization compiles in both
    dtypes, one per architecture. By default: the specializations of both architectures grouped by kernel family,
    source and head dim (each helper kernel its own group), the k-th group compiling its k-th member for
    ARCHS[k % 2], so that every family, source and head dim compiles once, on one architecture or the other."""
    if COMPILE_ALL:
        return [Job(arch, spec) for turn, arch in enumerate(ARCHS)
                for spec in representative(portable_specs(arch), turn)]
    groups = {}
    for arch in ARCHS:
        for spec in portable_specs(arch):
            helper = not hasattr(spec, "headdim")
            key = (type(spec), spec.source, dataclasses.replace(spec, dtype="") if helper else spec.headdim)
            groups.setdefault(key, []).append(Job(arch, spec))
    jobs = []
    for k, members in enumerate(groups.values()):
        on_arch = [job for job in members if job.arch == ARCHS[k % len(ARCHS)]] or members
        jobs.append(on_arch[k % len(on_arch)])
    return jobs


PORTABLE = portable_jobs()
SELFTESTS = [Job(HOPPER, spec) for spec in representative([SelftestSpec(dtype, kernel) for kernel in SELFTEST_KERNELS
                                                           for dtype in ("bf16", "fp16")])]
HOPPER_BACKWARD = [Job(HOPPER, spec) for spec in representative(hopper_backward_specs())]
HOPPER_FORWARD = [Job(HOPPER, spec) for spec in representative(hopper_forward_specs(), varying=VARYING + ("headdim",))]
FP8 = [Job(HOPPER, spec) for spec in representative(fp8_specs())]
SPLIT_PTX = [Job(HOPPER, hopper_variant_spec(variant, "bf16", 64, False, False), "ptx")
             for variant in ("ws3_n128_p_split", "ws3_n128_p")]
SHARED_MEMORY = Job(HOPPER, _shared_memory_program(), "ptx")


def cases(jobs: list, arch: bool = False) -> list:
    """pytest parameters of `jobs`, each named after its kernel (and its architecture where the test has two)."""
    return [pytest.param(job, id=f"{job.arch}-{job.spec.name}" if arch else job.spec.name) for job in jobs]


_STARTED = {}  # Job -> the Future of its _compile (start_early)
_POOLS = []


def start_early(items: list) -> None:
    """Called by conftest.py once pytest has collected (this module's tests then run last): the compiles of the
    selected tests start in a pool of processes (CUFLASH_COMPILE_WORKERS, default: the CPUs this process may use), so
    that they run beside the other tests."""
    jobs = list(dict.fromkeys(item.callspec.params["job"] for item in items
                              if "job" in getattr(getattr(item, "callspec", None), "params", {})))
    if not jobs:
        return
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = int(os.environ.get("CUFLASH_COMPILE_WORKERS", cpus))
    pool = ProcessPoolExecutor(max_workers=max(1, min(workers, len(jobs))))
    _STARTED.update((job, pool.submit(_compile, job)) for job in jobs)
    _POOLS.append(pool)


def stop_early() -> None:
    """Called by conftest.py when the test run ends: compiles not yet started are dropped (a run stopped early, by -x
    or an interrupt, does not wait for them)."""
    while _POOLS:
        _POOLS.pop().shutdown(wait=False, cancel_futures=True)


@pytest.fixture(scope="module")
def compiled():
    """Job -> _compile's result, for the jobs start_early started."""
    return {job: future.result() for job, future in _STARTED.items()}


def compiled_log(compiled: dict, job: Job) -> str:
    ok, out = compiled[job] if job in compiled else _compile(job)
    assert ok, out
    return out


def assert_no_spills(job: Job, log: str) -> None:
    report = resource_report(log)
    assert report["spill_stores"] == 0 and report["spill_loads"] == 0, (
        f"{job.spec.name} on {job.arch} spills: {report}\n{log}")


def test_specializations_exist():
    for arch in ARCHS:
        assert forward_specs(arch), f"the planner offers no forward kernel for {arch}"
        assert backward_specs(arch), f"the planner offers no backward kernel for {arch}"


def test_spill_detection_works():
    log = ("ptxas info    : Used 255 registers\n"
           "ptxas .  8 bytes stack frame, 12 bytes spill stores, 16 bytes spill loads")
    assert resource_report(log) == {"registers": 255, "spill_stores": 12, "spill_loads": 16}


def test_subset_covers_every_family_and_head_dim():
    """The compiled specializations span every kernel source, kind of spec and head dim (the full sweep: on each
    architecture), and every Hopper forward variant's structure (the full sweep: at every head dim)."""
    def spread(specs):
        return {(type(s), s.source, getattr(s, "headdim", None)) for s in specs}

    def structure(spec, varying=()):
        return tuple(getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in VARYING + varying)

    assert spread(j.spec for j in PORTABLE) == spread(s for arch in ARCHS for s in portable_specs(arch))
    if COMPILE_ALL:
        for arch in ARCHS:
            assert spread(j.spec for j in PORTABLE if j.arch == arch) == spread(portable_specs(arch))
    assert spread(j.spec for j in HOPPER_BACKWARD) == spread(hopper_backward_specs())
    head_dims = {s.headdim for s in hopper_forward_specs()}
    assert {j.spec.headdim for j in HOPPER_FORWARD} == head_dims
    compiled_structures = {structure(j.spec, ("headdim",) * (not COMPILE_ALL)) for j in HOPPER_FORWARD}
    for variant in hopper_variants:
        for d in head_dims:
            for dtype, band, mod in itertools.product(("fp16", "bf16"), (False, True), (False, True)):
                spec = hopper_variant_spec(variant, dtype, d, band, mod)
                assert structure(spec, ("headdim",) * (not COMPILE_ALL)) in compiled_structures, (variant, d)


@pytest.mark.parametrize("job", cases(PORTABLE, arch=True))
def test_compiles_without_spills(compiled, job):
    assert_no_spills(job, compiled_log(compiled, job))


@pytest.mark.parametrize("job", cases(SELFTESTS))
def test_hopper_selftest_compiles_with_async_wgmma(compiled, job):
    """The Hopper primitives (sm90.cuh) assemble for sm_90a without spills, and ptxas keeps wgmma asynchronous:
    its C75xx notes (C7515 serialized, C7517 a wait_group injected because accumulators were touched in flight)
    would say otherwise. Checked against a variant that reads an accumulator before the commit: C7517."""
    log = compiled_log(compiled, job)
    assert_no_spills(job, log)
    assert not re.search(r"\(C75\d\d\).*wgmma|wgmma.*serializ", log), log


@pytest.mark.parametrize("job", cases(HOPPER_BACKWARD))
def test_hopper_backward_compiles_with_async_wgmma(compiled, job):
    """The Hopper backward (bwd_sm90.cu): no spills, no wgmma serialization or injected fences."""
    log = compiled_log(compiled, job)
    assert_no_spills(job, log)
    assert not re.findall(r"\((C75\d\d)\)", log), log


@pytest.mark.parametrize("job", cases(HOPPER_FORWARD))
def test_hopper_forward_compiles_with_async_wgmma(compiled, job):
    """The Hopper forward (fwd_sm90.cu): no spills, no wgmma serialization."""
    log = compiled_log(compiled, job)
    assert_no_spills(job, log)
    assert not re.search(r"\(C75\d\d\).*wgmma|wgmma.*serializ", log), log
    # ptxas notes that it injected warpgroup fences (C7519): the lockstep version has them (its P V fragments are
    # packed between fence and wgmma); the warp-specialized one must have none.
    notes = set(re.findall(r"\((C75\d\d)\)", log))
    assert notes <= (set() if job.spec.warp_specialized else {"C7519"}), log


@pytest.mark.parametrize("job", cases(FP8))
def test_fp8_forward_compiles_with_async_wgmma(compiled, job):
    """The FP8 forward (fwd_fp8_sm90.cu), its producer's V transposes within 32 registers, and the V^T pass: no spills,
    no C75xx note at all (P's e4m3 fragments are packed before the fence, so ptxas injects no warpgroup fence)."""
    log = compiled_log(compiled, job)
    assert_no_spills(job, log)
    assert not re.findall(r"\((C75\d\d)\)", log), log


@pytest.mark.parametrize("job", cases(SPLIT_PTX))
def test_hopper_split_kernel_writes_o_from_registers(compiled, job):
    """The split variant has no TMA store of O (its merge uses the staging tile: fwd_sm90.cu split_tile), whatever
    p.o_tma says; its unsplit sibling has them (the control)."""
    ptx = compiled_log(compiled, job)
    assert ("global.shared::cta.bulk_group" in ptx) == (not job.spec.split), job.spec.name


@pytest.mark.parametrize("job", cases([SHARED_MEMORY]))
def test_hopper_kernels_state_their_shared_memory(compiled, job):
    """Every Hopper forward and backward specialization exports its shared-memory size under the name expression
    the launcher reads (build.smem_bytes), and each size is within the budget: one NVRTC program, for sm_90a."""
    ptx = compiled_log(compiled, job)
    assert job.spec.text.count("out[") == len(set(hopper_forward_specs() + hopper_backward_specs())) > 100
    sizes = [int(n) for n in re.findall(r"^\.global \.align 4 \.u32 \S*_sm90_smem_bytes\S* = (\d+);", ptx, re.M)]
    assert sizes and all(48 * 1024 < n <= 227 * 1024 for n in sizes), sizes
