"""The Hopper primitives' self-test kernel (cuda_src/sm90_selftest.cu) as a build spec, and its parameter layout."""
from dataclasses import dataclass

import numpy as np

TILE_BYTES = 64 * 64 * 2


@dataclass(frozen=True)
class SelftestSpec:
    """sm90_gemm_selftest<T> (C = A B^T, both K-major by TMA) or sm90_pv_selftest<T> (C = A B, A in registers,
    B MN-major by TMA): one warpgroup, 64 x 64 outputs."""

    dtype: str  # "bf16" | "fp16"
    kernel: str = "sm90_gemm_selftest"

    source = "sm90_selftest.cu"
    threads = 128
    smem_bytes = 2 * TILE_BYTES + 8 + 1024  # A, B, one mbarrier, and room to align the tiles to 1024 bytes

    @property
    def name(self) -> str:
        return f"{self.kernel}_{self.dtype}"

    @property
    def template(self) -> str:
        return f"cuflash::{self.kernel}<cuflash::{'bf16_t' if self.dtype == 'bf16' else 'half_t'}>"


KERNELS = ("sm90_gemm_selftest", "sm90_pv_selftest")
# Sm90SelftestParams: two 64-byte-aligned 128-byte tensor maps, two pointers, K / 64; 320 bytes in C++.
PARAMS_DTYPE = np.dtype({"names": ["a", "b", "a_rows", "c", "k_tiles"],
                         "formats": ["V128", "V128", np.uint64, np.uint64, np.int32],
                         "offsets": [0, 128, 256, 264, 272], "itemsize": 320})
