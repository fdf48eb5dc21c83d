"""cuda_src/dropout.cuh's own code, run on the host with 32 threads as a warp's lanes (tests/dropout_warp.cpp, built
with the host's C++ compiler; skipped without one): keep_rows (the forward's layout) and keep_mask_cols (the
backward's transposed one) give every element of 1 to 8 16 x 16 tiles the keep bit of cuflash.reference.dropout_keep,
in the mma.sync C-fragment positions, and drop_fragments (the Hopper forward's, on P's A fragments) zeroes exactly the
dropped elements of 1 to 8 tiles, an odd count included, for seeds and offsets across their 64 bits."""
import subprocess

import pytest

from cuflash import reference as ref
from tests.fixtures import host_program
CASES = [((5 << 40) + 77, (3 << 33) + 9, 0.4), (123, 7, 0.1), (2 ** 63 + 5, 2 ** 40 + 3, 0.75)]


@pytest.fixture(scope="module")
def warp(tmp_path_factory):
    build, exe = host_program(tmp_path_factory, "dropout_warp.cpp", "c++20", ("-pthread",))
    if build.returncode != 0 and "barrier" in build.stderr:
        pytest.skip(f"{build.args[0]} has no C++20 <barrier>")
    assert build.returncode == 0, build.stderr

    def run(seed, offset, bh, threshold, mode, nt, r, c):
        out = subprocess.run([str(exe), str(seed), str(offset), str(bh), str(threshold), mode, str(nt), str(r), str(c)],
                             capture_output=True, text=True, check=True).stdout
        return [[int(x) for x in line.split()] for line in out.splitlines()]

    return run


@pytest.mark.parametrize("seed, offset, p", CASES)
@pytest.mark.parametrize("nt", [2, 4, 6, 8, 10, 16])
def test_dropout_cuh_lanes_match_the_reference(warp, seed, offset, p, nt):
    bh, R, C = 7, 2, 1
    keep = ref.dropout_keep(seed, offset, 1, bh + 1, 16 * (nt // 2 + 3), 16 * (nt // 2 + 3), p)[0, bh]
    threshold = ref.dropout_threshold(p)
    for mode in ("rows", "frags"):
        out = warp(seed, offset, bh, threshold, mode, nt, R, C)
        for lane in range(32):
            g, c = lane // 4, lane % 4
            for n in range(nt):
                for e in range(4):
                    bit = 4 * n + e
                    row, col = 16 * R + g + 8 * (e // 2), 16 * C + 8 * n + 2 * c + e % 2
                    assert bool((out[lane][bit // 32] >> (bit % 32)) & 1) == keep[row, col], (mode, lane, n, e)
    if nt > 8:
        return
    cols = warp(seed, offset, bh, threshold, "cols", nt, R, C)
    for lane in range(32):
        g, c = lane // 4, lane % 4
        for n in range(nt):
            for e in range(4):
                key, query = 16 * C + g + 8 * (e // 2), 16 * R + 8 * n + 2 * c + e % 2
                assert bool((cols[lane][0] >> (4 * n + e)) & 1) == keep[query, key], ("keep_mask_cols", lane, n, e)
