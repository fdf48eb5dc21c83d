"""Compile kernels ahead of time into CuPy's disk cache, in parallel processes.

    python3 scripts/precompile.py [--pattern REGEX] [--headdims 64,128] [--workers 16] [--hopper]

Every spec the planner can choose on the current device (with --hopper, every Hopper forward, Hopper backward and
FP8 forward specialization too: cuflash.ops.all_specs) whose name matches --pattern, restricted to the given head dims
(specs without a head dim in their name are kept). A file, not a script on stdin: the worker processes
are spawned, and spawn re-imports __main__ from its path.
"""
import argparse
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pattern", default="")
    ap.add_argument("--headdims", default="")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--hopper", action="store_true", help="also every Hopper specialization (cuflash.ops.all_specs)")
    args = ap.parse_args()
    import cupy
    import cuflash
    from cuflash import build, ops
    arch = build.device_arch(cupy.cuda.Device().id)
    dims = [d for d in args.headdims.split(",") if d]
    dim_re = re.compile(r"_d(" + "|".join(dims) + r")(_|$)") if dims else None
    specs = [s for s in ops.all_specs(arch, hopper=args.hopper) if re.match(args.pattern, s.name)
             and (dim_re is None or dim_re.search(s.name) or not re.search(r"_d\d+", s.name))]
    print(len(cuflash.precompile(specs, workers=args.workers, progress=False)), "kernels for", arch)


if __name__ == "__main__":
    main()
