"""Public functions on CuPy arrays: check -> plan -> launch, nothing else."""
from __future__ import annotations

import contextlib
import math

import numpy as np

from . import build, checks, plan

__all__ = ["attention", "attention_backward"]


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, return_lse=False, stream=None):
    """Exact scaled-dot-product attention (FlashAttention-2 algorithm).

    Parameters
    ----------
    q : cupy.ndarray, (batch, seqlen_q, nheads, headdim), float16 or bfloat16
    k, v : cupy.ndarray, (batch, seqlen_k, nheads_k, headdim), same dtype as q
        ``nheads % nheads_k == 0`` (GQA/MQA: query head h reads KV head ``h // (nheads // nheads_k)``).
        The last axis must be contiguous; other strides are free (views of a packed qkv tensor work
        without a copy), but must keep 16-byte alignment (multiples of 8 elements).
    softmax_scale : float, optional
        Defaults to ``1 / sqrt(headdim)``.
    causal : bool
        Bottom-right aligned when ``seqlen_q != seqlen_k``: query i sees key j iff
        ``j <= i + seqlen_k - seqlen_q``. For seqlen_q = 2, seqlen_k = 5 (x = visible)::

            x x x x .
            x x x x x

    window_size : (int, int)
        Sliding window ``(left, right)``: query i sees keys
        ``i + sk - sq - left <= j <= i + sk - sq + right``; -1 is unbounded. ``causal`` sets right to 0.
    softcap : float
        If > 0, scores ``s`` become ``softcap * tanh(s / softcap)`` (after scaling).
    alibi_slopes : cupy.ndarray, float32, (nheads,) or (batch, nheads), optional
        Adds ``-slope * |i + sk - sq - j|`` to each (scaled, capped) score.
    return_lse : bool
        Also return the float32 log-sum-exp ``(batch, nheads, seqlen_q)`` (natural log).
    stream : cupy.cuda.Stream, optional
        Defaults to CuPy's current stream.

    Returns
    -------
    out : cupy.ndarray, (batch, seqlen_q, nheads, headdim), contiguous, dtype of q
    lse : cupy.ndarray, (batch, nheads, seqlen_q), float32 -- only if ``return_lse``

    A query row that sees no key gets ``out = 0`` and ``lse = -inf``.

    Examples
    --------
    >>> q = cupy.random.randn(2, 1024, 16, 128).astype(cupy.float16)
    >>> out = cuflash.attention(q, q, q, causal=True)
    """
    problem = checks.check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                     window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    _require_device_arrays(q=q, k=k, v=v, alibi_slopes=alibi_slopes)
    import cupy
    with cupy.cuda.Device(q.device.id), _on(stream):
        out = cupy.empty(q.shape, dtype=q.dtype)
        lse = cupy.empty((problem.batch, problem.nheads, problem.seqlen_q), dtype=np.float32) if return_lse else None
        launch_forward(problem, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                       window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    return (out, lse) if return_lse else out


def launch_forward(problem, q, k, v, out, lse, *, softmax_scale, causal, window_size, softcap, alibi_slopes):
    """Launch the forward into given arrays, on the current device and stream; no checks, no allocation.

    The public :func:`attention` checks and allocates, then calls this; framework wrappers (JAX's FFI
    handler) call it with buffers they own. ``out`` is contiguous like q, ``lse`` is contiguous
    ``(batch, nheads, seqlen_q)`` float32 or None.
    """
    scale = 1.0 / math.sqrt(problem.headdim) if softmax_scale is None else float(softmax_scale)
    left, right = plan.normalize_window(*checks.window(causal, window_size), problem.seqlen_q, problem.seqlen_k)
    score_mod = softcap > 0 or alibi_slopes is not None
    device_id = q.device.id
    launch = plan.plan_forward(problem, left, right, score_mod, build.device_arch(device_id))
    params = _fwd_params(problem, q, k, v, out, lse, alibi_slopes, left, right, scale, float(softcap), score_mod)
    kernel = build.get_kernel(launch.spec, device_id)
    kernel(launch.grid, launch.block, (params,), shared_mem=launch.smem)


def attention_backward(dout, q, k, v, out, lse, *, softmax_scale=None, causal=False, window_size=(-1, -1),
                       softcap=0.0, alibi_slopes=None, deterministic=False, stream=None):
    """Gradients of :func:`attention` (FlashAttention-2 backward, KV-block parallel).

    Parameters
    ----------
    dout : cupy.ndarray, (batch, seqlen_q, nheads, headdim), dtype of q
        Gradient of the loss with respect to ``out``.
    q, k, v : as in :func:`attention`; head dims up to 128 (larger ones raise NotImplementedError).
    out : cupy.ndarray, (batch, seqlen_q, nheads, headdim)
        The forward's output.
    lse : cupy.ndarray, float32, (batch, nheads, seqlen_q), contiguous
        The forward's log-sum-exp (``attention(..., return_lse=True)``).
    softmax_scale, causal, window_size, softcap, alibi_slopes
        Exactly as given to the forward.
    deterministic : bool
        If True, dQ is accumulated in a fixed order (per-CTA slices summed in order), so repeated calls
        give bitwise-identical results; otherwise fp32 atomics (faster, last-bit nondeterministic).
    stream : cupy.cuda.Stream, optional
        Defaults to CuPy's current stream.

    Returns
    -------
    dq, dk, dv : cupy.ndarray
        Shaped and typed like q, k, v (contiguous). With GQA, dk/dv hold the sum over the query heads
        that share each KV head. Rows that saw no key get zero gradients.
    """
    problem = checks.check_backward(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                                    window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    _require_device_arrays(dout=dout, q=q, k=k, v=v, out=out, lse=lse, alibi_slopes=alibi_slopes)
    if not lse.flags.c_contiguous:
        raise ValueError(f"lse: must be contiguous (batch, nheads, seqlen_q); got strides "
                         f"{_elem_strides(lse)} elements")
    import cupy
    with cupy.cuda.Device(q.device.id), _on(stream):
        dq, dk, dv = (cupy.empty(x.shape, dtype=x.dtype) for x in (q, k, v))
        launch_backward(problem, dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=softmax_scale, causal=causal,
                        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                        deterministic=deterministic)
    return dq, dk, dv


def launch_backward(problem, dout, q, k, v, out, lse, dq, dk, dv, *, softmax_scale, causal, window_size, softcap,
                    alibi_slopes, deterministic):
    """Launch the backward into given dq/dk/dv (contiguous), on the current device and stream; no checks.

    Workspaces (fp32 dQ accumulator, rowsum(dO*O), lse in log2) come from CuPy's current allocator, so a
    wrapper that sets one (``cupy.cuda.using_allocator``) decides where they live.
    """
    import cupy
    scale = 1.0 / math.sqrt(problem.headdim) if softmax_scale is None else float(softmax_scale)
    left, right = plan.normalize_window(*checks.window(causal, window_size), problem.seqlen_q, problem.seqlen_k)
    score_mod = softcap > 0 or alibi_slopes is not None
    device_id = q.device.id
    sm_count = cupy.cuda.Device(device_id).attributes["MultiProcessorCount"]
    launch = plan.plan_backward(problem, left, right, score_mod, bool(deterministic),
                                build.device_arch(device_id), sm_count)
    dtype = launch.spec.dtype
    b, sq, h, d = problem.batch, problem.seqlen_q, problem.nheads, problem.headdim

    dsum = cupy.empty((b, h, sq), dtype=np.float32)
    lse_log2 = cupy.empty((b, h, sq), dtype=np.float32)
    dq_accum = cupy.zeros((launch.slices, b, sq, h, d), dtype=np.float32)

    # D = rowsum(dO * O) and lse in the log2 domain: one warp per row
    pre = plan.AuxSpec("bwd_preprocess", dtype)
    pp = np.zeros((), dtype=plan.BWD_PRE_PARAMS_DTYPE)
    _set_pointers(pp, out=out, dout=dout, lse=lse, dsum=dsum, lse_log2=lse_log2)
    _set_strides(pp, o=out, do=dout)
    pp["batch"], pp["seqlen_q"], pp["nheads"], pp["headdim"] = b, sq, h, d
    rows_per_cta = pre.threads // 32
    build.get_kernel(pre, device_id)((min(-(-b * h * sq // rows_per_cta), 65535 * 8),), (pre.threads,), (pp[()],))

    # the main kernel
    bp = np.zeros((), dtype=plan.BWD_PARAMS_DTYPE)
    _set_pointers(bp, q=q, k=k, v=v, dout=dout, dk=dk, dv=dv, dq_accum=dq_accum, lse_log2=lse_log2, dsum=dsum,
                  alibi=alibi_slopes)
    _set_strides(bp, q=q, k=k, v=v, do=dout, dk=dk, dv=dv)
    bp["alibi_batch_stride"] = _elem_strides(alibi_slopes)[0] if alibi_slopes is not None and alibi_slopes.ndim == 2 else 0
    bp["dq_slice_stride"] = b * sq * h * d
    bp["batch"], bp["seqlen_q"], bp["seqlen_k"] = b, sq, problem.seqlen_k
    bp["nheads"], bp["heads_per_kv"], bp["headdim"] = h, h // problem.nheads_k, d
    bp["window_left"], bp["window_right"] = left, right
    bp["deterministic"] = int(bool(deterministic))
    for name, value in plan.forward_scales(scale, float(softcap), score_mod).items():
        bp[name] = value
    bp["softmax_scale"] = scale
    build.get_kernel(launch.spec, device_id)(launch.grid, (launch.spec.threads,), (bp[()],),
                                             shared_mem=launch.spec.smem_bytes)

    # dQ: sum the slices (fixed order), cast
    conv = plan.AuxSpec("bwd_convert_dq", dtype)
    cp = np.zeros((), dtype=plan.BWD_CONVERT_PARAMS_DTYPE)
    _set_pointers(cp, dq_accum=dq_accum, dq=dq)
    cp["slice_stride"], cp["slices"] = b * sq * h * d, launch.slices
    n_pairs = b * sq * h * d // 2
    build.get_kernel(conv, device_id)((min(-(-n_pairs // conv.threads), 65535 * 16),), (conv.threads,), (cp[()],))


def _set_pointers(p, **arrays) -> None:
    for name, x in arrays.items():
        p[name] = 0 if x is None else x.data.ptr


def _set_strides(p, **arrays) -> None:
    """`name_{batch,row,head}_stride` fields from the first three axes of each array, in elements."""
    for name, x in arrays.items():
        p[f"{name}_batch_stride"], p[f"{name}_row_stride"], p[f"{name}_head_stride"] = _elem_strides(x)[:3]


def _fwd_params(problem, q, k, v, out, lse, alibi, left, right, scale, softcap, score_mod):
    p = np.zeros((), dtype=plan.FWD_PARAMS_DTYPE)
    _set_pointers(p, q=q, k=k, v=v, o=out, lse=lse, alibi=alibi)
    _set_strides(p, q=q, k=k, v=v, o=out)
    p["alibi_batch_stride"] = _elem_strides(alibi)[0] if alibi is not None and alibi.ndim == 2 else 0
    p["seqlen_q"], p["seqlen_k"] = problem.seqlen_q, problem.seqlen_k
    p["nheads"], p["heads_per_kv"] = problem.nheads, problem.nheads // problem.nheads_k
    p["headdim"] = problem.headdim
    p["window_left"], p["window_right"] = left, right
    for name, value in plan.forward_scales(scale, softcap, score_mod).items():
        p[name] = value
    return p[()]


def _elem_strides(x) -> tuple:
    return tuple(s // x.itemsize for s in x.strides)


def _require_device_arrays(**arrays) -> None:
    """CuPy arrays whose 16-byte chunks along the last axis are aligned (cp.async copies 16 bytes)."""
    import cupy
    for name, x in arrays.items():
        if x is None:
            continue
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name}: expected a cupy.ndarray, got {type(x).__module__}.{type(x).__name__} "
                            "(torch and JAX arrays convert without a copy: cupy.from_dlpack(x))")
        if x.dtype == np.float32:  # ALiBi slopes, lse: read one float at a time
            continue
        bad = [axis for axis, (n, s) in enumerate(zip(x.shape[:-1], x.strides[:-1])) if n > 1 and s % 16]
        if x.data.ptr % 16 or bad:
            where = f"stride of axis {bad[0]} is {x.strides[bad[0]] // x.itemsize} elements" if bad else \
                f"data pointer {x.data.ptr:#x}"
            raise ValueError(f"{name}: must be 16-byte aligned (pointer and strides multiples of 8 elements); "
                             f"{where}")


def _on(stream):
    if stream is None:
        return contextlib.nullcontext()
    if isinstance(stream, int):
        import cupy
        stream = cupy.cuda.ExternalStream(stream)
    return stream
