"""Hugging Face transformers: ``attn_implementation="cuflash"``.

    import cuflash.transformers
    cuflash.transformers.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cuflash", dtype=torch.bfloat16,
                                                 device_map="cuda")

:func:`register` adds :func:`attention_forward` to transformers' ``AttentionInterface`` and, under the same name,
transformers' flash-attention mask builder to ``AttentionMaskInterface``: a model then hands the attention
function what it hands flash-attention 2 -- no mask for a batch without padding, a 2-D ``(batch, kv_len)``
padding mask otherwise -- and the function maps each case onto :mod:`cuflash.torch`:

* no mask: :func:`cuflash.torch.attention` on the model's q, k, v as they are (views, no copy), causal aligned
  bottom-right. That is also decoding against a KV cache: one new query row against the cache's keys.
* a padding mask: the valid key rows are gathered into flash-attn's packed layout and attended with
  :func:`cuflash.torch.attention_varlen`; for causal attention the valid query rows too, scattered back after
  (padded query rows get zeros).
* packed sequences (padding-free batches, ``DataCollatorWithFlattening``): ``cu_seq_lens_q``/``cu_seq_lens_k``
  keyword arguments, or ``position_ids`` that restart within a row, select the varlen kernels, so no token
  attends across a sequence boundary.

GQA/MQA heads go to the kernels as they are; ``scaling``, ``sliding_window`` and ``softcap`` become
``softmax_scale``, ``window_size`` and ``softcap``, and attention dropout in training ``dropout_p``. What cuflash
cannot compute raises instead of returning something else: a 4-D or block mask, attention sinks (``s_aux``), an
additive position bias.
"""
from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as err:
    raise ModuleNotFoundError(f"cuflash.transformers needs Hugging Face transformers: pip install "
                              f"'cuflash[transformers]' ({err})", name=err.name) from err
from . import torch as cuflash_torch  # noqa: E402  (first: it says how to install torch when torch is missing)

import torch  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask  # noqa: E402

__all__ = ["NAME", "register", "attention_forward"]

NAME = "cuflash"


def register(name: str = NAME) -> str:
    """Make ``attn_implementation=name`` (default ``"cuflash"``) available to every transformers model.

    Registers :func:`attention_forward` with ``transformers.AttentionInterface`` and transformers' flash-attention
    mask builder (2-D padding masks, ``None`` without padding) with ``AttentionMaskInterface``. Call it once,
    before loading a model or before ``model.set_attn_implementation(name)``. Returns ``name``.

    Examples
    --------
    >>> cuflash.transformers.register()
    >>> model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="cuflash", dtype=torch.bfloat16)
    """
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    if "flash" in name:
        _no_kernel_to_preload(name)
    return name


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, softcap: float | None = None, is_causal: bool | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract, computed by cuflash's kernels.

    Parameters
    ----------
    module : the model's attention layer; its ``is_causal`` (default True) applies unless ``is_causal`` is given
    query : torch.Tensor, (batch, nheads, seqlen_q, headdim), float16 or bfloat16
    key, value : torch.Tensor, (batch, nheads_k, seqlen_k, headdim); ``nheads % nheads_k == 0``
        With a KV cache, ``seqlen_k`` counts the cached keys and the new ones; causal masks are aligned
        bottom-right, so query row ``i`` sees keys ``j <= i + seqlen_k - seqlen_q`` (the new tokens come last).
    attention_mask : torch.Tensor (batch, L) bool or int, or None
        Padding mask over the key positions (nonzero = a real token), as transformers' flash-attention mask
        builder makes it; ``L < seqlen_k`` (a static cache longer than what it holds) uses the first ``L`` keys.
    scaling : float, optional -- softmax scale, default ``1 / sqrt(headdim)``
    dropout : float -- attention dropout (the layer's ``attention_dropout`` in training, 0 in evaluation), drawn
        from torch's CUDA generator as :func:`cuflash.torch.attention`'s ``dropout_p``
    sliding_window : int, optional -- each query sees the last ``sliding_window`` keys up to itself
    softcap : float, optional -- scores ``s`` become ``softcap * tanh(s / softcap)``
    **kwargs
        ``cu_seq_lens_q``, ``cu_seq_lens_k``, ``max_length_q``, ``max_length_k`` (packed sequences),
        ``position_ids``, ``deterministic`` (a bitwise-repeatable backward); others are ignored.

    Returns
    -------
    out : torch.Tensor, (batch, seqlen_q, nheads, headdim), dtype of the kernels' inputs
    None : no attention weights (``output_attentions`` is not supported, as with flash-attention)
    """
    _refuse_unsupported(attention_mask, kwargs)
    if any(n == 0 for n in query.shape):
        raise ValueError(f"query: shape {tuple(query.shape)} has an empty axis")
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    q, k, v = _half(module, *(x.transpose(1, 2) for x in (query, key, value)))  # (batch, seqlen, heads, headdim)
    value_dim = v.shape[-1]
    if value_dim < q.shape[-1]:  # the kernels take one head dim: pad v (MLA), crop the output
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - value_dim))
    options = dict(softmax_scale=scaling, causal=causal, window_size=_window(sliding_window, causal),
                   softcap=0.0 if softcap is None else float(softcap),
                   deterministic=bool(kwargs.get("deterministic") or False))
    if dropout:
        options["dropout_p"] = float(dropout)
    if attention_mask is not None:
        out = _padded(q, k, v, attention_mask, options)
    else:
        cu_seqlens = _packed(q, k, kwargs)
        if cu_seqlens is None:
            out = cuflash_torch.attention(q, k, v, **options)
        else:
            out = _varlen(q, k, v, *cu_seqlens, options)
    return out[..., :value_dim], None


def _padded(q, k, v, attention_mask, options) -> torch.Tensor:
    """Attention over the keys a 2-D padding mask keeps: gather them into flash-attn's packed layout, attend
    per sequence, and give the output q's shape.

    Causal (self-attention, with or without a cache): the query rows are the last ``seqlen_q`` key positions,
    whichever side the padding is on, so a sequence's valid queries are its last valid keys -- the bottom-right
    alignment the kernels use. Only those rows are attended; padded query rows get zeros. Not causal (encoder
    self-attention, cross-attention): a query's position does not matter, so every query row attends its
    sequence's valid keys -- except under a sliding window, where positions matter and q must be the keys' own
    rows (``seqlen_q == seqlen_k``, padded like them).
    """
    batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] > seqlen_k:
        raise ValueError(f"attention_mask: expected a (batch, kv_len) padding mask with batch {batch} and "
                         f"kv_len <= {seqlen_k} (the keys' length), got shape {tuple(attention_mask.shape)}")
    keep_k = attention_mask.to(device=q.device, dtype=torch.bool)
    if keep_k.shape[1] < seqlen_k:  # a static cache: keys past the mask are unused slots
        seqlen_k = keep_k.shape[1]
        k, v = k[:, :seqlen_k], v[:, :seqlen_k]
    rows_k, cu_seqlens_k = (k[keep_k], v[keep_k]), _cumulative(keep_k.sum(1))
    causal, windowed = options["causal"], options["window_size"] != (-1, -1)
    if not causal and not windowed:  # every query row of sequence b against its valid keys
        cu_seqlens_q = torch.arange(0, (batch + 1) * seqlen_q, seqlen_q, dtype=torch.int32, device=q.device)
        return _varlen(q, *rows_k, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, options)
    if seqlen_q > seqlen_k or (not causal and seqlen_q != seqlen_k):
        raise NotImplementedError(f"attention_mask: {seqlen_q} query rows cannot be placed among {seqlen_k} key "
                                  f"positions ({'causal' if causal else 'bidirectional sliding-window'} attention "
                                  "with padding needs the queries to be the last key positions)")
    keep_q = keep_k[:, -seqlen_q:]
    out = _varlen(q[keep_q], *rows_k, _cumulative(keep_q.sum(1)), cu_seqlens_k, seqlen_q, seqlen_k, options)
    padded = out.new_zeros(q.shape[:3] + out.shape[-1:])
    padded[keep_q] = out
    return padded


def _packed(q, k, kwargs) -> tuple | None:
    """``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` of a padding-free batch, or None for a dense one.

    From the collator's ``cu_seq_lens_q/k`` (and ``max_length_q/k``) when given; otherwise from ``position_ids``
    that restart inside a row (a new sequence starts wherever a position is not its predecessor's plus one, as
    transformers' own packed-sequence masks read them). Without a cache only: with one, the keys outnumber the
    queries and the position ids continue the cache's.
    """
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if cu_q is None or cu_k is None:
            raise ValueError("cu_seq_lens_q and cu_seq_lens_k: give both or neither")
        cu_q, cu_k = (x.to(device=q.device, dtype=torch.int32) for x in (cu_q, cu_k))
        return (cu_q, cu_k, _max_length(kwargs.get("max_length_q"), cu_q),
                _max_length(kwargs.get("max_length_k"), cu_k))
    position_ids = kwargs.get("position_ids")
    batch, seqlen = q.shape[:2]
    if (position_ids is None or seqlen == 1 or k.shape[1] != seqlen or position_ids.dim() != 2
            or position_ids.shape[-1] != seqlen):
        return None
    position_ids = position_ids.to(q.device).expand(batch, seqlen)
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    if not starts[:, 1:].any():  # one sequence per row: the dense kernels
        return None
    cu = torch.nn.functional.pad(starts.flatten().nonzero().flatten().to(torch.int32), (0, 1), value=batch * seqlen)
    longest = int((cu[1:] - cu[:-1]).max())
    return cu, cu, longest, longest


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options) -> torch.Tensor:
    """:func:`cuflash.torch.attention_varlen` on rows of (batch, seqlen, heads, headdim) or (total, heads, headdim)
    tensors; the output has q's shape."""
    flat = [x.reshape(-1, *x.shape[-2:]) for x in (q, k, v)]
    out = cuflash_torch.attention_varlen(*flat, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
                                         **options)
    return out.view(*q.shape[:-1], out.shape[-1])


def _cumulative(lengths: torch.Tensor) -> torch.Tensor:
    """int32 ``cu_seqlens`` (batch + 1,) from per-sequence lengths."""
    return torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def _max_length(given, cu_seqlens: torch.Tensor) -> int:
    return int(given) if given is not None else int((cu_seqlens[1:] - cu_seqlens[:-1]).max())


def _window(sliding_window, causal: bool) -> tuple[int, int]:
    """transformers' ``sliding_window`` (a query sees itself and the ``sliding_window - 1`` keys before it;
    bidirectional models: that many on each side) as cuflash's inclusive ``(left, right)``."""
    if sliding_window is None:
        return -1, -1
    if int(sliding_window) < 1:
        raise ValueError(f"sliding_window: expected a positive int or None, got {sliding_window!r}")
    reach = int(sliding_window) - 1
    return reach, 0 if causal else reach


def _half(module, q, k, v) -> tuple:
    """q, k, v in float16/bfloat16: float32 inputs (layer norms kept in float32, as PEFT does) are cast to the
    autocast dtype when autocast is on; otherwise float32 is an error, never a silent downcast."""
    if q.dtype in (torch.float16, torch.bfloat16):
        return q, k, v
    if q.dtype == torch.float32 and torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        if dtype in (torch.float16, torch.bfloat16):
            return q.to(dtype), k.to(dtype), v.to(dtype)
    raise TypeError(f"attn_implementation='cuflash' takes float16 or bfloat16 query/key/value, got {q.dtype} in "
                    f"{type(module).__name__}: load the model with dtype=torch.bfloat16 (or float16), or run it "
                    "under torch.autocast")


def _refuse_unsupported(attention_mask, kwargs) -> None:
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise NotImplementedError(f"attention_mask: a {type(attention_mask).__name__} (flex attention's block mask) "
                                  "cannot be computed by cuflash")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise NotImplementedError(f"attention_mask: cuflash takes a 2-D (batch, kv_len) padding mask, got shape "
                                  f"{tuple(attention_mask.shape)}; an arbitrary 4-D mask (one passed in, or built "
                                  "for another attn_implementation) cannot be computed by cuflash, whose kernels "
                                  "know causal, sliding-window and padding masks only")
    for name in ("s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{name}: cuflash has no attention sinks or additive position bias")


def _no_kernel_to_preload(name: str) -> None:
    """transformers 5 takes every ``attn_implementation`` whose name contains "flash" for a flash-attention kernel
    and, when a model is built with it, loads that kernel through ``modeling_flash_attention_utils._lazy_imports``
    (for torch.compile's sake), which fails for a name that is neither ``flash_attention_N`` nor a hub kernel.
    The attention function registered here imports nothing through that loader, so the loader gets to answer
    "no functions" for this name and stays as it was for every other name. Versions without that loader (4.x)
    preload ``flash_attention_*`` names only and need nothing."""
    from transformers import modeling_flash_attention_utils as fa_utils
    load = getattr(fa_utils, "_lazy_imports", None)
    if load is None:
        return
    names = getattr(load, "cuflash_names", None)
    if names is None:
        def _lazy_imports(implementation, *args, **kwargs):
            if implementation in _lazy_imports.cuflash_names:
                return None, None, None, None, None
            return load(implementation, *args, **kwargs)
        _lazy_imports.cuflash_names = names = set()
        fa_utils._lazy_imports = _lazy_imports
    names.add(name)
