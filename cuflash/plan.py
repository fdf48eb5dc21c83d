"""Shared pieces of planning: compiled head dims, dtype tags, kernel name expressions, grid limits, and the
NumPy layouts of the kernels' parameter structs.

Each operation's own tables, specializations and launch shapes live with that operation
(:mod:`cuflash.ops.forward`, :mod:`cuflash.ops.backward`, :mod:`cuflash.ops.decode`).

Pure Python: runs on a machine without a GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# NVRTC targets the kernels are compiled and checked for.
ARCHS = ("sm_80", "sm_90a")

# Head dims the kernels are compiled for; a call's head dim is padded up to the next one inside the
# kernel (zero-filled loads, masked stores), never by copying inputs.
COMPILED_HEADDIMS = (32, 64, 96, 128, 160, 192, 224, 256)

# numpy dtype name -> (short name used in kernel names, C++ element tag)
DTYPES = {"float16": ("fp16", "cuflash::half_t"), "bfloat16": ("bf16", "cuflash::bf16_t")}

MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z (heads and batch here)

SMEM_PER_SM = 227 * 1024   # usable shared memory per SM on sm_80 / sm_90 (1 KB per CTA reserved)


def check_grid(grid: tuple) -> tuple:
    """A launch shape CUDA accepts, or a ValueError naming the axis, before anything is launched."""
    for axis, name, n in ((1, "heads", grid[1]), (2, "batch", grid[2])):
        if n > MAX_GRID_YZ:
            raise ValueError(f"{name}: {n} exceeds the {MAX_GRID_YZ} CUDA allows on grid axis {'xyz'[axis]}")
    return grid


def arch_of(compute_capability: str | int) -> str:
    """NVRTC target for a device: sm_90a on Hopper (wgmma, setmaxnreg), sm_XY elsewhere."""
    cc = int(compute_capability)
    return "sm_90a" if cc == 90 else f"sm_{cc}"


def is_hopper(arch: str) -> bool:
    """sm_90 / sm_90a: the family whose measurements the Hopper rows of the tables come from."""
    return arch.startswith("sm_90")


# The Hopper kernels' compiled head dims, and the smallest head dim they take: a call's head dim (a multiple of 8)
# runs on the next one, its TMA boxes zero-filled past the head dim and its stores bounded by it (smaller head dims
# would waste most of a 64-column panel; the portable kernels take them).
HOPPER_HEADDIMS = (64, 128, 256)
HOPPER_MIN_HEADDIM = 40


def hopper_headdim(headdim: int) -> int | None:
    """The Hopper kernels' compiled head dim for a call's: the next of HOPPER_HEADDIMS, for multiples of 8 from
    HOPPER_MIN_HEADDIM to 256; None for the others."""
    if headdim % 8 or not HOPPER_MIN_HEADDIM <= headdim <= HOPPER_HEADDIMS[-1]:
        return None
    return next(d for d in HOPPER_HEADDIMS if headdim <= d)


def compiled_headdim(headdim: int) -> int:
    for d in COMPILED_HEADDIMS:
        if headdim <= d:
            return d
    raise ValueError(f"head dim {headdim} exceeds the largest compiled head dim {COMPILED_HEADDIMS[-1]}")


def dtype_tag(dtype) -> str:
    """"fp16" or "bf16": a NumPy dtype's short name in kernel names and specs."""
    return DTYPES[np.dtype(dtype).name][0]


def template(kernel: str, dtype: str, ints: tuple, flags: tuple) -> str:
    """C++ name expression of a kernel instantiation: kernel<dtype tag, ints..., flags...>."""
    args = [dict(DTYPES.values())[dtype]] + [str(i) for i in ints] + ["true" if f else "false" for f in flags]
    return f"cuflash::{kernel}<{', '.join(args)}>"


@dataclass(frozen=True)
class HelperSpec:
    """A small helper kernel templated on the dtype only; a subclass names its source file (`source`)."""

    kernel: str
    dtype: str

    threads = 256
    smem_bytes = 0

    @property
    def name(self) -> str:
        return f"{self.kernel}_{self.dtype}"

    @property
    def template(self) -> str:
        return template(self.kernel, self.dtype, (), ())


def smem_row_bytes(headdim: int) -> int:
    """Bytes of one shared-memory tile row: whole 64-column panels of 16-bit elements (tile.cuh)."""
    return math.ceil(headdim / 64) * 64 * 2


def struct(pointers, int64s, int32s, float32s) -> np.dtype:
    """A NumPy structured dtype laid out like a C struct of these fields, in this order."""
    return np.dtype([(n, np.uint64) for n in pointers] + [(n, np.int64) for n in int64s]
                    + [(n, np.int32) for n in int32s] + [(n, np.float32) for n in float32s], align=True)


def stride_fields(*tensors) -> list:
    """`t_batch_stride, t_row_stride, t_head_stride` for each tensor name t."""
    return [f"{t}_{s}_stride" for t in tensors for s in ("batch", "row", "head")]


def set_strides(p, **arrays) -> None:
    """Fill the `name_{batch,row,head}_stride` fields of struct `p` from each array's layout, in elements
    (checks.seq_strides: padded or packed)."""
    from .checks import seq_strides
    for name, x in arrays.items():
        p[f"{name}_batch_stride"], p[f"{name}_row_stride"], p[f"{name}_head_stride"] = seq_strides(x)


def set_pages(p, k, block_table) -> None:
    """Fill a forward struct's paged-keys fields: block_table's row stride and the pools' geometry (k, v page pools
    ``(num_pages, page_size, nheads_k, d)``, block_table ``(batch, max_pages)``)."""
    from .checks import elem_strides
    p["block_table_stride"] = elem_strides(block_table)[0]
    p["page_size"], p["num_pages"], p["max_pages"] = k.shape[1], k.shape[0], block_table.shape[1]
