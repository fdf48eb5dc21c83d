#!/usr/bin/env python3
"""The instruction mix of a kernel's loops, from its machine code, without a GPU.

    python3 scripts/sass_loops.py NAME [--cuda-src DIR] [--arch sm_90a] [--min 100] [--top 16]

NAME is a kernel name as the compile test and the planner give it (`fwd_sm90_bf16_d64_ws4_n128_drop`,
`fwd_fp8_sm90_d128_pp`, `bwd_sm90_bf16_d128_drop`, `fwd_bf16_d128_...`), or a part of one that only one name holds.
The kernel's source is compiled to PTX by NVRTC with cuflash's own options, assembled by the local `ptxas -v`
(registers and spills) and disassembled by `nvdisasm` (pip's nvidia-cuda-nvdisasm; it does not read NVRTC's own
cubins, hence the local ptxas). Every loop, a backward branch and the instructions from its target to it, of at
least --min instructions is printed with its length and its commonest opcodes, longest first; an outer loop's
extent holds its inner ones. A forward's steady-state key-block loop is the shortest one with the GEMMs (HGMMA,
QGMMA) in it; its length is the per-thread instruction count of one block, which is what an issue-bound kernel's
time follows (docs/perf-notes.md cites such counts). It also prints the highest register the code names: in a
warp-specialized kernel that is what the consumers use after `setmaxnreg`, where ptxas reports the launch's bound.

--cuda-src compiles the same specialization from another tree's cuda_src/ (a checkout of the base commit), for
before / after counts of a kernel change without a device run.
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# one SASS line: /*0a50*/  [@P0 | @!UP1 ...]  OPCODE.MODIFIERS  operands ;   and nvdisasm's labels: .L_x_12:
_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_LABEL = re.compile(r"^\s*(\.L\w+):")
# a general register operand (R0 .. R254; RZ and the uniform URn are other names)
_REGISTER = re.compile(r"(?<![\w.])R(\d+)\b")
# a branch target: a label (nvdisasm) or an offset (cuobjdump -sass)
_TARGET = re.compile(r"\((\.L\w+)\)|\b0x([0-9a-f]+)\b")


@dataclass
class Loop:
    start: int  # byte offset of the branch target (the loop's first instruction)
    end: int    # byte offset of the backward branch
    ops: Counter = field(default_factory=Counter)

    @property
    def length(self) -> int:
        return sum(self.ops.values())


def instructions(sass: str) -> list:
    """(offset, opcode, operands) of every instruction of a disassembly, in order; the opcode without modifiers."""
    out = []
    for line in sass.splitlines():
        m = _LINE.match(line)
        if m:
            out.append((int(m.group(1), 16), m.group(2).split(".")[0], m.group(3)))
    return out


def highest_register(sass: str) -> int:
    """The highest general register (Rn; RZ left out) any instruction of a disassembly names, -1 if none."""
    return max((int(n) for _, _, operands in instructions(sass) for n in _REGISTER.findall(operands)), default=-1)


def labels(sass: str) -> dict:
    """nvdisasm's labels: name -> the offset of the instruction after it."""
    out, pending = {}, []
    for line in sass.splitlines():
        label, m = _LABEL.match(line), _LINE.match(line)
        if label:
            pending.append(label.group(1))
        elif m:
            out.update((name, int(m.group(1), 16)) for name in pending)
            pending = []
    return out


def loops(sass: str) -> list:
    """The loops of a disassembly: each branch (BRA) to its own or an earlier offset, with the opcodes from its
    target to it, longest first."""
    code, where = instructions(sass), labels(sass)
    found = []
    for offset, op, operands in code:
        target = _TARGET.search(operands) if op == "BRA" else None
        if target is None:
            continue
        start = where.get(target.group(1)) if target.group(1) else int(target.group(2), 16)
        if start is not None and start <= offset:
            found.append(Loop(start, offset, Counter(o for at, o, _ in code if start <= at <= offset)))
    return sorted(found, key=lambda loop: -loop.length)


def find_spec(name: str, arch: str):
    """The one specialization (any family the planner compiles for `arch`) whose name is `name` or contains it."""
    from cuflash import ops
    from cuflash.ops import backward_sm90, forward_fp8, forward_sm90
    specs = list(ops.all_specs(arch))
    if arch == "sm_90a":
        specs += forward_sm90.all_specs() + backward_sm90.all_specs() + forward_fp8.all_specs()
    exact = [s for s in specs if s.name == name]
    matches = exact or list({s.name: s for s in specs if name in s.name}.values())
    if len(matches) != 1:
        some = ", ".join(sorted(s.name for s in matches)[:8])
        raise SystemExit(f"{name!r} names {len(matches)} kernels for {arch}" + (f": {some} ..." if matches else ""))
    return matches[0]


def tool(name: str) -> str:
    """ptxas from PATH; nvdisasm from PATH or pip's nvidia-cuda-nvdisasm."""
    found = shutil.which(name)
    if found is None and name == "nvdisasm":
        try:
            import nvidia
            for base in nvidia.__path__:
                candidates = sorted(Path(base).glob("cu*/bin/nvdisasm"))
                if candidates:
                    found = str(candidates[-1])
                    break
        except ImportError:
            pass
    if found is None:
        raise SystemExit(f"{name} not found (ptxas: the CUDA toolkit; nvdisasm: pip install nvidia-cuda-nvdisasm)")
    return found


def disassemble(spec, arch: str, cuda_src: Path | None = None) -> tuple:
    """(ptxas's resource report, the SASS) of one specialization."""
    from cuflash import build
    # PTX for the local ptxas (compute_XX in place of sm_XX), and another tree's headers where asked
    options = ["-arch=compute_" + arch[len("sm_"):] if o.startswith("-arch=")
               else f"-I{cuda_src}" if o.startswith("-I") and cuda_src is not None else o
               for o in build.nvrtc_options(arch)]
    nvrtc = build._nvrtc()
    prog = nvrtc.createProgram(build.kernel_source(spec), spec.name + ".cu", [], [])
    try:
        nvrtc.addNameExpression(prog, spec.template)
        try:
            nvrtc.compileProgram(prog, options)
        except Exception as err:  # NVRTCError: the log says why
            raise SystemExit(f"NVRTC failed on {spec.name}:\n{nvrtc.getProgramLog(prog)}") from err
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    with tempfile.TemporaryDirectory() as tmp:
        ptx_file, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        ptx_file.write_bytes(ptx if isinstance(ptx, bytes) else ptx.encode())
        assembled = subprocess.run([tool("ptxas"), f"-arch={arch}", "-v", str(ptx_file), "-o", str(cubin)],
                                   capture_output=True, text=True, check=True)
        sass = subprocess.run([tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, check=True)
    report = [line.split(":", 1)[-1].strip() for line in assembled.stderr.splitlines()
              if "registers" in line or "spill" in line]
    return report, sass.stdout


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name")
    parser.add_argument("--cuda-src", type=Path, help="compile from this cuda_src/ instead of the checkout's")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--min", type=int, default=100, help="the shortest loop printed (instructions)")
    parser.add_argument("--top", type=int, default=16, help="opcodes printed per loop")
    args = parser.parse_args(argv)
    spec = find_spec(args.name, args.arch)
    report, sass = disassemble(spec, args.arch, args.cuda_src)
    print(f"{spec.name} ({args.arch}, {args.cuda_src or ROOT / 'cuda_src'}): {len(instructions(sass))} instructions")
    for line in report:
        print(f"  ptxas: {line}")
    print(f"  highest register: R{highest_register(sass)}")
    for loop in loops(sass):
        if loop.length < args.min:
            continue
        mix = " ".join(f"{op} {n}" for op, n in loop.ops.most_common(args.top))
        print(f"loop {loop.start:#06x}..{loop.end:#06x}: {loop.length} instructions: {mix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
