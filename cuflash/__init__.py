"""cuflash: exact attention for NVIDIA GPUs, FlashAttention-2 design, kernels compiled at run time.

Public functions take and return CuPy arrays; ``cuflash.torch`` and ``cuflash.jax`` wrap them for
those frameworks. ``cuflash.reference`` is the float64 NumPy specification of every function.
"""
from . import reference
from .api import (attention, attention_backward, attention_varlen, attention_varlen_backward,
                  attention_with_kvcache)
from .build import precompile
from .ops.forward_fp8 import attention_fp8, attention_varlen_fp8
from .ops.quantize import quantize_e4m3

__all__ = ["attention", "attention_backward", "attention_fp8", "attention_varlen", "attention_varlen_backward",
           "attention_varlen_fp8", "attention_with_kvcache", "precompile", "quantize_e4m3", "reference"]
__version__ = "0.1.0"
