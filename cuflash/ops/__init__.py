"""One module per operation, each owning its kernel choice (portable or Hopper), specializations, tile tables,
parameter struct and launch: :mod:`~cuflash.ops.forward` (with :mod:`~cuflash.ops.forward_sm90`),
:mod:`~cuflash.ops.backward` (with :mod:`~cuflash.ops.backward_sm90`), :mod:`~cuflash.ops.decode`,
:mod:`~cuflash.ops.forward_fp8` and :mod:`~cuflash.ops.quantize` (e4m3 quantization)."""
from __future__ import annotations


def all_specs(arch: str, hopper: bool = False) -> list:
    """Every kernel specialization the planner can choose on `arch` (forward, backward, decode, e4m3 quantization), in
    a stable order: what precompile and the compile test build. `hopper`: also every Hopper forward variant and
    Hopper backward kernel, and the FP8 forward (sm_90a only), which the tables may not all use."""
    from . import backward, backward_sm90, decode, forward, forward_fp8, forward_sm90, quantize
    specs = forward.all_specs(arch) + backward.all_specs(arch) + decode.all_specs(arch) + quantize.all_specs(arch)
    if hopper and arch == "sm_90a":
        specs += forward_sm90.all_specs() + backward_sm90.all_specs() + forward_fp8.all_specs()
    return specs
