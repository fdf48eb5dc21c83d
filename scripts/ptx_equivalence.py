"""Does a refactor of cuda_src/ change what the kernels compute? Compares the PTX of kernels between a git revision
and the working tree, without a GPU.

    python3 scripts/ptx_equivalence.py REV [--arch compute_90a] [--limit 8]

For specializations the planner can choose (forward, backward, decode; --limit of each family, spread), the
PTX of both sources is reduced to a multiset of instructions with register numbers erased. The same multiset means
the same operations on the same operand kinds, only scheduled or numbered differently: for floating-point code,
bitwise the same results. With --cubin the machine code itself is compared (byte-identical cubins, NVRTC's
per-process symbol hashes masked): the same cubin runs exactly as the one a GPU run tested. Prints SAME or what
differs, per kernel. A template whose parameters
changed between the revisions is compiled under each revision's own name expression (given by --old-template as
a Python format, e.g. when a parameter was added).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def ptx(source_dir: str, source: str, name_expression: str, arch: str, cubin: bool = False):
    """The PTX text, or with `cubin` (arch sm_XX) the cubin with its per-process symbol hashes masked."""
    from cupy_backends.cuda.libs import nvrtc
    prog = nvrtc.createProgram(f'#include "{source}"\n', "k.cu", [], [])
    nvrtc.addNameExpression(prog, name_expression)
    try:
        nvrtc.compileProgram(prog, [f"-arch={arch}", "-std=c++17", "--use_fast_math", f"-I{source_dir}",
                                    "-DCUFLASH_SOURCE_HASH=0x0"])
    except Exception:
        raise RuntimeError(f"{name_expression} in {source_dir}:\n{nvrtc.getProgramLog(prog)}") from None
    out = nvrtc.getCUBIN(prog) if cubin else nvrtc.getPTX(prog)
    nvrtc.destroyProgram(prog)
    if cubin:  # internal-linkage names carry a per-process hash: _cu_<8 hex>_<pid>
        return re.sub(rb"_cu_[0-9a-f]{8}_\d+", lambda m: b"X" * len(m.group(0)), out)
    return out.decode() if isinstance(out, bytes) else out


def instructions(text: str) -> Counter:
    """PTX lines without comments, register and global declarations, mangled names and register numbers."""
    lines = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("//") or line.startswith(".reg ") or line.startswith(".global "):
            continue  # (.global: static constexpr members NVRTC materializes, whose values the code has inlined)
        line = re.sub(r"_Z\w+", "KERNEL", line)
        lines.append(re.sub(r"%[a-z]+\d+", "%R", line))
    return Counter(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rev", help="git revision to compare the working tree's cuda_src/ with")
    ap.add_argument("--arch", default="compute_90a")
    ap.add_argument("--limit", type=int, default=8, help="kernels per family (forward, backward, decode), spread")
    ap.add_argument("--hopper", action="store_true",
                    help="the Hopper forward's, backward's, FP8 forward's and self-test kernels instead "
                         "(--arch compute_90a)")
    ap.add_argument("--family", help="only this family of kernels (forward, backward, decode; with --hopper: hopper, "
                                     "hopper_bwd, fp8, selftest)")
    ap.add_argument("--cubin", action="store_true",
                    help="compare the machine code instead: byte-identical cubins (symbol hashes masked), sm_XX")
    ap.add_argument("--old-template", action="append", default=[], metavar="NEW=OLD",
                    help="regex NEW on a template -> replacement OLD for the old revision, e.g. "
                         r"'(bwd_kernel<[^>]*), 1, (true|false), (true|false)>=\1, \2, \3>'")
    args = ap.parse_args()
    from cuflash.ops import backward, backward_sm90, decode, forward, forward_fp8, forward_sm90
    arch = args.arch.replace("compute_", "sm_")
    families = {"forward": forward.all_specs(arch), "backward": backward.all_specs(arch),
                "decode": decode.all_specs(arch)}
    if args.hopper:  # the Hopper specializations (cuflash.ops; tests/sm90_selftest.py; sm_90a)
        from tests.sm90_selftest import KERNELS, SelftestSpec
        families = {"hopper": forward_sm90.all_specs(), "hopper_bwd": backward_sm90.all_specs(),
                    "fp8": forward_fp8.all_specs(),
                    "selftest": [SelftestSpec(dtype, kernel) for kernel in KERNELS for dtype in ("bf16", "fp16")]}
    if args.family:
        families = {args.family: families[args.family]}
    compile_arch = args.arch.replace("compute_", "sm_") if args.cubin else args.arch
    rewrites = [tuple(r.split("=", 1)) for r in args.old_template]
    differ = 0
    with tempfile.TemporaryDirectory() as old_dir:
        files = subprocess.run(["git", "ls-tree", "--name-only", args.rev, "cuda_src/"], cwd=ROOT, check=True,
                               capture_output=True, text=True).stdout.split()
        for f in files:
            blob = subprocess.run(["git", "show", f"{args.rev}:{f}"], cwd=ROOT, check=True, capture_output=True).stdout
            Path(old_dir, os.path.basename(f)).write_bytes(blob)
        for family, specs in families.items():
            step = max(1, len(specs) // args.limit)  # spread over the family: aux kernels, head dims, options
            for spec in specs[::step][:args.limit]:
                old_template = spec.template
                for pattern, replacement in rewrites:
                    old_template = re.sub(pattern, replacement, old_template)
                digest = (lambda x: x) if args.cubin else instructions
                b = digest(ptx(str(ROOT / "cuda_src"), spec.source, spec.template, compile_arch, args.cubin))
                try:
                    a = digest(ptx(old_dir, spec.source, old_template, compile_arch, args.cubin))
                except RuntimeError:
                    print(f"{family:9s} {spec.name:50s} NEW (no such kernel at {args.rev})")
                    continue
                if args.cubin:
                    diff = "cubins differ" if a != b else {}
                else:
                    diff = {k: b[k] - a[k] for k in (a - b) + (b - a)}
                differ += bool(diff)
                print(f"{family:9s} {spec.name:50s} {'SAME' if not diff else diff}")
    print(f"{differ} kernel(s) differ")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
