"""Public functions on CuPy arrays: check -> plan -> launch, nothing else."""
from __future__ import annotations

import contextlib
import dataclasses
import math

from typing import Callable, NamedTuple

import numpy as np

from . import build, checks, hopper, plan, tma
from .launcher import KernelCall

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward",
           "attention_with_kvcache"]


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
    import cupy
    try:  # one key for the checks and the launch: layouts of the arrays, values of the options
        key = (_layout(q), _layout(k), _layout(v), alibi_slopes is not None and _layout(alibi_slopes),
               type(softmax_scale), softmax_scale, type(causal), causal, type(window_size), window_size,
               type(softcap), softcap, bool(return_lse))
        hit = _attention_calls.get(key)
    except (AttributeError, TypeError):  # not CuPy arrays, or an unhashable option: the checks say what is wrong
        key = hit = None
    if hit is None:
        problem = checks.check_attention(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                         window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
        _require_device_arrays(q=q, k=k, v=v, alibi_slopes=alibi_slopes)
        lse_shape = (problem.batch, problem.nheads, problem.seqlen_q)
        device_id = q.device.id
        with _device(device_id):
            call = forward_call(problem, q, k, v, _contiguous("out", q.shape, q.dtype),
                                _contiguous("lse", lse_shape, np.float32) if return_lse else None,
                                device_id=device_id, softmax_scale=softmax_scale, causal=causal,
                                window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
        hit = (call, device_id, lse_shape)
        if key is not None:
            if len(_attention_calls) >= 4096:
                _attention_calls.clear()
            _attention_calls[key] = hit
    elif (q.data.ptr | k.data.ptr | v.data.ptr) % 16:
        _require_device_arrays(q=q, k=k, v=v)  # says which pointer
    call, device_id, lse_shape = hit
    with _device(device_id), _on(stream):
        out = cupy.ndarray(q.shape, q.dtype)
        lse = cupy.ndarray(lse_shape, np.float32) if return_lse else None
        call(cupy.cuda.get_current_stream().ptr, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, _ptr(lse),
             _ptr(alibi_slopes), 0, 0)
    return (out, lse) if return_lse else out


_attention_calls: dict = {}  # key of an attention() call -> (KernelCall, device id, lse shape)


def _layout(x) -> tuple:
    """What a check or a launch can depend on in a CuPy array (AttributeError for anything else)."""
    return type(x), x.shape, x.strides, x.dtype, x.data.device_id


def _contiguous(name, shape, dtype, device=None) -> checks.TensorSpec:
    """The layout of an output allocated contiguous (only its strides are read)."""
    strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape)))
    return checks.TensorSpec(name, tuple(shape), np.dtype(dtype), strides, device)


def launch_forward(problem, q, k, v, out, lse, *, softmax_scale, causal, window_size, softcap, alibi_slopes,
                   cu_seqlens_q=None, cu_seqlens_k=None):
    """Launch the forward into given arrays, on the current device and stream; no checks, no allocation.

    The public :func:`attention` checks and allocates, then calls this; framework wrappers (JAX's FFI
    handler) call it with buffers they own. ``out`` is contiguous like q, ``lse`` is contiguous
    ``(batch, nheads, seqlen_q)`` float32 or None.

    Packed variable-length sequences (:func:`attention_varlen`): give ``cu_seqlens_q`` and ``cu_seqlens_k``
    (int32 ``(batch + 1,)`` on the device); q/out are then ``(total_q, nheads, d)``, k/v
    ``(total_k, nheads_k, d)``, lse ``(nheads, total_q)``, and ``problem`` carries the maximum lengths.
    """
    key = checks.call_signature((problem, q, k, v, out, lse, softmax_scale, causal, window_size, softcap,
                                 alibi_slopes, cu_seqlens_q, cu_seqlens_k))
    call = _fwd_launches.get(key) if key is not None else None
    if call is None:
        call = forward_call(problem, q, k, v, out, lse, device_id=q.device.id, softmax_scale=softmax_scale,
                            causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
        if key is not None:
            if len(_fwd_launches) >= 4096:
                _fwd_launches.clear()
            _fwd_launches[key] = call
    import cupy
    call(cupy.cuda.get_current_stream().ptr, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, _ptr(lse),
         _ptr(alibi_slopes), _ptr(cu_seqlens_q), _ptr(cu_seqlens_k))


_fwd_launches: dict = {}  # call signature -> KernelCall


def forward_call(problem, q, k, v, out, lse, *, device_id, softmax_scale, causal, window_size, softcap,
                 alibi_slopes):
    """The forward's :class:`~cuflash.launcher.KernelCall` for these layouts and options on device `device_id`
    (current), or on Hopper, where the planner chooses it, :class:`cuflash.hopper.ForwardCall` (same call).
    q .. lse and alibi_slopes are arrays or TensorSpecs: only shapes and strides are read, packed
    ones ((total, heads, d); lse (nheads, total_q)) as in :func:`launch_forward`. A call then takes the stream and
    the pointers ``q, k, v, o, lse, alibi, cu_seqlens_q, cu_seqlens_k`` (0 where absent)."""
    scale = 1.0 / math.sqrt(problem.headdim) if softmax_scale is None else float(softmax_scale)
    left, right = plan.normalize_window(*checks.window(causal, window_size), problem.seqlen_q, problem.seqlen_k)
    score_mod = softcap > 0 or alibi_slopes is not None
    arch = build.device_arch(device_id)
    variant = plan.sm90_forward_variant(problem, arch, left >= 0 or right >= 0)
    if variant is not None:  # the Hopper kernel, behind the same call interface
        return hopper.forward_call(problem, q, k, v, out, lse, device_id=device_id, scale=scale, left=left,
                                   right=right, softcap=float(softcap), alibi_slopes=alibi_slopes, variant=variant)
    launch = plan.plan_forward(problem, left, right, score_mod, arch)
    params = _fwd_params(problem, q, k, v, out, lse, alibi_slopes, left, right, scale, float(softcap), score_mod)
    return KernelCall([(build.get_kernel(launch.spec, device_id), launch.grid, launch.block, launch.smem)],
                      params, FWD_POINTERS)


FWD_POINTERS = plan.FWD_PARAMS_DTYPE.names[:8]   # q, k, v, o, lse, alibi, cu_seqlens_q, cu_seqlens_k


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
                    alibi_slopes, deterministic, cu_seqlens_q=None, cu_seqlens_k=None, workspace=None):
    """Launch the backward into given dq/dk/dv (contiguous), on the current device and stream; no checks.

    The fp32 workspaces (rowsum(dO*O), lse in log2, the dQ accumulator) are one block of
    ``backward_call(...).workspace_bytes`` bytes: ``workspace`` (a uint8 array at least that long, e.g. a buffer
    XLA owns) or, without it, one allocation from CuPy's current allocator (a wrapper that sets one with
    ``cupy.cuda.using_allocator`` decides where it lives). With ``cu_seqlens_q`` and ``cu_seqlens_k`` the arrays
    are packed as in :func:`launch_forward`, and the workspaces too: one row per query token.
    """
    key = checks.call_signature((problem, dout, q, k, v, out, lse, dq, dk, dv, softmax_scale, causal, window_size,
                                 softcap, alibi_slopes, deterministic, cu_seqlens_q, cu_seqlens_k))
    call = _bwd_launches.get(key) if key is not None else None
    if call is None:
        call = backward_call(problem, dout, q, k, v, out, lse, dq, dk, dv, device_id=q.device.id,
                             softmax_scale=softmax_scale, causal=causal, window_size=window_size, softcap=softcap,
                             alibi_slopes=alibi_slopes, deterministic=deterministic,
                             packed=cu_seqlens_q is not None)
        if key is not None:
            if len(_bwd_launches) >= 4096:
                _bwd_launches.clear()
            _bwd_launches[key] = call
    import cupy
    if workspace is None:
        workspace = cupy.empty(call.workspace_bytes, dtype=np.uint8)
    elif workspace.nbytes < call.workspace_bytes:
        raise ValueError(f"workspace: {workspace.nbytes} bytes, the backward needs {call.workspace_bytes}")
    call(cupy.cuda.get_current_stream().ptr, dout.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr,
         lse.data.ptr, dq.data.ptr, dk.data.ptr, dv.data.ptr, _ptr(alibi_slopes), _ptr(cu_seqlens_q),
         _ptr(cu_seqlens_k), workspace.data.ptr)


_bwd_launches: dict = {}  # call signature -> BackwardCall


class BackwardCall(NamedTuple):
    """The backward's launches for one call signature, and where its workspace pieces lie: dsum at 0, lse_log2 at
    ``lse_log2_offset``, the dQ accumulator (``dq_bytes``, zeroed by the preprocess) at ``dq_offset``, and in
    deterministic mode's fixed point the row scales and the K/V bounds at ``fixed_offsets``
    (:func:`cuflash.plan.backward_workspace`, :func:`cuflash.plan.fixed_point_offsets`)."""
    # D = rowsum(dO * O), lse in log2, dQ accumulator zeroed (fixed point: |dO| per row, the K/V bounds, then each
    # row's dQ scale over its |dO|):
    # out, dout, lse, dsum, lse_log2, dq_accum, dq_scale, kv_bound, k, v
    preprocess: KernelCall
    # main: dK, dV, dQ accumulation: q, k, v, dout, dk, dv, dq_accum, lse_log2, dsum, alibi, cu_q, cu_k, dq_scale,
    # kv_bound (not read by the kernel)
    main: KernelCall
    convert: KernelCall      # dQ = sum of the slices (fixed point: over the row scales), cast: dq_accum, dq, dq_scale
    lse_log2_offset: int
    dq_offset: int
    dq_bytes: int
    workspace_bytes: int
    fixed_offsets: tuple | None = None  # (dq_scale, kv_bound) byte offsets; None: not fixed point

    def __call__(self, stream, dout, q, k, v, out, lse, dq, dk, dv, alibi, cu_seqlens_q, cu_seqlens_k, workspace):
        """Launch on ``stream`` with these data pointers (0 where absent)."""
        dsum, lse_log2, dq_accum = workspace, workspace + self.lse_log2_offset, workspace + self.dq_offset
        row_scale, kv_bound = (workspace + o for o in self.fixed_offsets) if self.fixed_offsets else (0, 0)
        self.preprocess(stream, out, dout, lse, dsum, lse_log2, dq_accum, row_scale, kv_bound, k, v)
        self.main(stream, q, k, v, dout, dk, dv, dq_accum, lse_log2, dsum, alibi, cu_seqlens_q, cu_seqlens_k,
                  row_scale, kv_bound)
        self.convert(stream, dq_accum, dq, row_scale)


def backward_call(problem, dout, q, k, v, out, lse, dq, dk, dv, *, device_id, softmax_scale, causal, window_size,
                  softcap, alibi_slopes, deterministic, packed) -> BackwardCall:
    """The backward's launches for these layouts (arrays or TensorSpecs; dq, dk, dv contiguous) and options on
    device `device_id` (current); ``packed``: varlen layouts, as in :func:`launch_backward`."""
    scale = 1.0 / math.sqrt(problem.headdim) if softmax_scale is None else float(softmax_scale)
    left, right = plan.normalize_window(*checks.window(causal, window_size), problem.seqlen_q, problem.seqlen_k)
    score_mod = softcap > 0 or alibi_slopes is not None
    launch = plan.plan_backward(problem, left, right, score_mod, bool(deterministic),
                                build.device_arch(device_id), build.sm_count(device_id))
    dtype = launch.spec.dtype
    b, sq, h, d = problem.batch, problem.seqlen_q, problem.nheads, problem.headdim
    # Per-row workspaces: (b, h, sq) and (slices, b, sq, h, d); packed, one row per query token, (h, total_q) and
    # (slices, total_q, h, d). The elementwise launches see a packed batch as one sequence of total_q rows.
    pre_b, pre_sq = (1, q.shape[0]) if packed else (b, sq)
    rows = pre_b * pre_sq  # query rows of all sequences
    fixed = launch.fixed_point
    lse_log2_offset, dq_offset, workspace_bytes = plan.backward_workspace(rows, h, d, launch.slices,
                                                                          problem.nheads_k if fixed else 0)

    # D = rowsum(dO * O) and lse in the log2 domain: plan.bwd_pre_lanes(d) threads per row; grid (row blocks, heads,
    # sequences)
    pre = plan.AuxSpec("bwd_preprocess", dtype)
    pp = np.zeros((), dtype=plan.BWD_PRE_PARAMS_DTYPE)
    _set_strides(pp, o=out, do=dout)
    pp["batch"], pp["seqlen_q"], pp["nheads"], pp["headdim"] = pre_b, pre_sq, h, d
    pp["lanes"] = plan.bwd_pre_lanes(d)
    pp["dq_slice_stride"], pp["slices"] = rows * h * d, launch.slices
    pre_rows = pre.threads // int(pp["lanes"])
    pre_launches = [(build.get_kernel(pre, device_id), plan.check_grid((-(-pre_sq // pre_rows), h, pre_b)),
                     (pre.threads,), 0)]
    if fixed:  # then max |K| and max |V_j| per KV head, over every row of K and V (packed: one sequence)
        _set_strides(pp, k=k, v=v)
        pp["fixed_point"], pp["nheads_k"] = 1, problem.nheads_k
        pp["kv_batch"], pp["seqlen_k"] = (1, k.shape[0]) if packed else (b, problem.seqlen_k)
        kv_grid = plan.check_grid((plan.kv_bound_blocks(int(pp["seqlen_k"]), pre_rows, problem.nheads_k * int(
            pp["kv_batch"]), build.sm_count(device_id)), problem.nheads_k, int(pp["kv_batch"])))
        pre_launches.append((build.get_kernel(plan.AuxSpec("bwd_kv_bound", dtype), device_id), kv_grid,
                             (pre.threads,), 0))
        # then each row's dQ scale over its |dO|: one row per thread, grid (row blocks, heads, sequences)
        scale_spec = plan.AuxSpec("bwd_fixed_scale", dtype)
        pp["softmax_scale"] = scale
        pre_launches.append((build.get_kernel(scale_spec, device_id),
                             plan.check_grid((-(-pre_sq // scale_spec.threads), h, pre_b)), (scale_spec.threads,), 0))
    preprocess = KernelCall(pre_launches, pp, plan.BWD_PRE_PARAMS_DTYPE.names[:10])

    # the main kernel; dsum and lse_log2 are (pre_b, h, pre_sq) contiguous, seen per sequence
    bp = np.zeros((), dtype=plan.BWD_PARAMS_DTYPE)
    _set_strides(bp, q=q, k=k, v=v, do=dout, dk=dk, dv=dv)
    bp["lse_batch_stride"], bp["lse_head_stride"] = (1, pre_sq) if packed else (h * sq, sq)
    bp["dq_batch_stride"] = h * d if packed else sq * h * d  # packed: sequence b starts at row cu_seqlens_q[b]
    bp["alibi_batch_stride"] = _alibi_batch_stride(alibi_slopes)
    bp["dq_slice_stride"] = rows * h * d
    bp["batch"], bp["seqlen_q"], bp["seqlen_k"] = b, sq, problem.seqlen_k
    bp["nheads"], bp["heads_per_kv"], bp["headdim"] = h, h // problem.nheads_k, d
    bp["window_left"], bp["window_right"] = left, right
    bp["deterministic"] = 2 if fixed else int(bool(deterministic))
    for name, value in plan.forward_scales(scale, float(softcap), score_mod).items():
        bp[name] = value
    bp["softmax_scale"] = scale
    if plan.bwd_sm90_applies(problem, score_mod, build.device_arch(device_id)):  # same interface, same workspace
        spec = hopper.BwdSm90Spec(dtype, d, left >= 0 or right >= 0, score_mod, plan.bwd_sm90_block_m(d, score_mod),
                                  fixed)
        main = hopper.backward_main(spec, bp, q, k, v, dout, launch.grid, device_id)  # plan_backward's grid
    else:
        main = KernelCall([(build.get_kernel(launch.spec, device_id), launch.grid, (launch.spec.threads,),
                            launch.spec.smem_bytes)], bp, plan.BWD_PARAMS_DTYPE.names[:14])

    # dQ: sum the slices (fixed order), cast; fixed point: the int32 accumulator times each row's unit, grid (groups
    # of four elements of a row, rows)
    conv = plan.AuxSpec("bwd_convert_dq", dtype)
    cp = np.zeros((), dtype=plan.BWD_CONVERT_PARAMS_DTYPE)
    cp["slice_stride"], cp["slices"] = rows * h * d, launch.slices
    conv_grid = (min(-(-(rows * h * d // 4) // conv.threads), 65535 * 16),)
    if fixed:
        cp["fixed_point"], cp["seqlen_q"], cp["nheads"], cp["headdim"] = 1, pre_sq, h, d
        conv_grid = (-(-(h * d // 4) // conv.threads), min(rows, 65535))
    convert = KernelCall([(build.get_kernel(conv, device_id), conv_grid, (conv.threads,), 0)], cp,
                         plan.BWD_CONVERT_PARAMS_DTYPE.names[:3])
    return BackwardCall(preprocess, main, convert, lse_log2_offset, dq_offset, launch.slices * rows * h * d * 4,
                        workspace_bytes, plan.fixed_point_offsets(rows, h, d) if fixed else None)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None,
                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_lse=False,
                     stream=None):
    """Attention over a batch of variable-length sequences packed along one token axis (flash-attn's layout).

    Sequence ``b`` is rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``
    of k and v. Each sequence is attended on its own, exactly as :func:`attention` with batch 1 would: masks are
    aligned bottom-right with the sequence's own lengths. For lengths ``sq = 2``, ``sk = 5``, causal::

        x x x x .
        x x x x x

    Parameters
    ----------
    q : cupy.ndarray, (total_q, nheads, headdim), float16 or bfloat16
    k, v : cupy.ndarray, (total_k, nheads_k, headdim), same dtype as q
        ``nheads % nheads_k == 0`` (GQA/MQA). Last axis contiguous, other strides free (16-byte aligned).
    cu_seqlens_q, cu_seqlens_k : cupy.ndarray, int32, (batch + 1,), on the device
        Cumulative sequence starts: non-decreasing, ``cu_seqlens[0] = 0`` and ``cu_seqlens[-1]`` at most the
        token count. Equal neighbours make an empty sequence. They are read by the kernels, never by the host
        (no synchronization); out and lse rows outside every sequence are not written.
    max_seqlen_q, max_seqlen_k : int
        Upper bounds on the sequence lengths (they size the grid and pick the tile config); a sequence longer
        than ``max_seqlen_q`` would be left partly uncomputed.
    softmax_scale, causal, window_size, softcap : as in :func:`attention`, per sequence.
    alibi_slopes : cupy.ndarray, float32, (nheads,) or (batch, nheads), optional
        Row ``b`` for sequence ``b``.
    return_lse : bool
        Also return the float32 log-sum-exp ``(nheads, total_q)`` (natural log).
    stream : cupy.cuda.Stream, optional

    Returns
    -------
    out : cupy.ndarray, (total_q, nheads, headdim), contiguous, dtype of q
    lse : cupy.ndarray, (nheads, total_q), float32 -- only if ``return_lse``

    A query row that sees no key (also every row of a sequence with no keys) gets ``out = 0`` and
    ``lse = -inf``.

    Examples
    --------
    >>> cu = cupy.asarray([0, 100, 100, 612], dtype=cupy.int32)   # lengths 100, 0, 512
    >>> q = cupy.random.randn(612, 16, 128).astype(cupy.float16)
    >>> out = cuflash.attention_varlen(q, q, q, cu, cu, 512, 512, causal=True)
    """
    problem = checks.check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                  softcap=softcap, alibi_slopes=alibi_slopes)
    _require_device_arrays(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                           alibi_slopes=alibi_slopes)
    import cupy
    with cupy.cuda.Device(q.device.id), _on(stream):
        out = cupy.empty(q.shape, dtype=q.dtype)
        lse = cupy.empty((problem.nheads, q.shape[0]), dtype=np.float32) if return_lse else None
        launch_forward(problem, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                       window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                       cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return (out, lse) if return_lse else out


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                              alibi_slopes=None, deterministic=False, stream=None):
    """Gradients of :func:`attention_varlen`: the kernels of :func:`attention_backward`, per sequence.

    Parameters
    ----------
    dout : cupy.ndarray, (total_q, nheads, headdim), dtype of q
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k : as in :func:`attention_varlen`;
        head dims up to 128 (larger ones raise NotImplementedError).
    out : cupy.ndarray, (total_q, nheads, headdim)
        The forward's output.
    lse : cupy.ndarray, float32, (nheads, total_q), contiguous
        The forward's log-sum-exp (``attention_varlen(..., return_lse=True)``).
    softmax_scale, causal, window_size, softcap, alibi_slopes
        Exactly as given to the forward.
    deterministic : bool
        Bitwise-repeatable dQ, as in :func:`attention_backward`.
    stream : cupy.cuda.Stream, optional

    Returns
    -------
    dq, dk, dv : cupy.ndarray
        Shaped and typed like q, k, v (contiguous). Keys of a sequence without queries get zero gradients.
        Token rows outside every sequence get dq = 0; their dk, dv are not written.
    """
    problem = checks.check_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                           max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                                           window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    _require_device_arrays(dout=dout, q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q,
                           cu_seqlens_k=cu_seqlens_k, alibi_slopes=alibi_slopes)
    if not lse.flags.c_contiguous:
        raise ValueError(f"lse: must be contiguous (nheads, total_q); got strides {_elem_strides(lse)} elements")
    import cupy
    with cupy.cuda.Device(q.device.id), _on(stream):
        dq, dk, dv = (cupy.empty(x.shape, dtype=x.dtype) for x in (q, k, v))
        launch_backward(problem, dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=softmax_scale, causal=causal,
                        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
                        deterministic=deterministic, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    return dq, dk, dv


def attention_with_kvcache(q, k_cache, v_cache, *, k=None, v=None, cache_seqlens=None, cache_batch_idx=None,
                           block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, num_splits=0, return_lse=False, stream=None):
    """Attention of new query rows against a KV cache (decode), with FlashAttention's semantics.

    Parameters
    ----------
    q : cupy.ndarray, (batch, seqlen_new, nheads, headdim)
        Usually seqlen_new = 1; up to a few hundred rows (speculative decoding) work too.
    k_cache, v_cache : cupy.ndarray
        Contiguous cache ``(batch_cache, max_len, nheads_k, headdim)``, or with ``block_table`` a page pool
        ``(num_pages, page_size, nheads_k, headdim)``, page_size any multiple of 16. Updated in place when
        ``k``/``v`` are given.
    k, v : cupy.ndarray, (batch, seqlen_new_k, nheads_k, headdim), optional
        Appended to the cache at positions ``cache_seqlens[b] ..`` (in place) before attending.
    cache_seqlens : int or cupy int32 (batch,), optional
        Keys already in the cache per batch row (before the append); default: the whole capacity.
    cache_batch_idx : cupy int32 (batch,), optional
        Batch row b reads (and appends to) cache row ``cache_batch_idx[b]``. Not with ``block_table``.
    block_table : cupy int32 (batch, max_pages), optional
        Page indices: logical position p of row b lives at page ``block_table[b, p // page_size]``,
        row ``p % page_size``.
    softmax_scale, causal, window_size, softcap, alibi_slopes, return_lse, stream
        As in :func:`attention`. Row b attends to ``L_b = cache_seqlens[b] + seqlen_new_k`` keys; causal and
        window masks are aligned bottom-right over that length (new query i sits at position
        ``L_b - seqlen_new + i``).
    num_splits : int
        Splits of the keys across CTAs (merged by a combine kernel). 0 chooses from the SM count, the number
        of (batch, KV head) pairs and the cache length; 1 writes the output directly.

    Returns
    -------
    out : cupy.ndarray, (batch, seqlen_new, nheads, headdim); lse (batch, nheads, seqlen_new) float32 if asked.
    A row with no key (``L_b = 0``) gets ``out = 0`` and ``lse = -inf``.

    The query heads that share a KV head are processed together, so every K/V byte is read once.
    """
    args = (q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale, causal,
            window_size, softcap, alibi_slopes, num_splits, return_lse)
    key = checks.call_signature(args)
    prep = _decode_calls.get(key) if key is not None else None
    if prep is None:
        prep = _prepare_decode(*args)
        if key is not None:
            if len(_decode_calls) >= 4096:
                _decode_calls.clear()
            _decode_calls[key] = prep
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k", k), ("v", v)):
        if x is not None and x.data.ptr % 16:
            raise ValueError(f"{name}: must be 16-byte aligned; data pointer {x.data.ptr:#x}")

    import cupy
    with _device(prep.device_id), _on(stream):
        # one allocation: out, then lse, then the split workspace (partial O, partial lse)
        mem = cupy.cuda.alloc(prep.nbytes)
        out = cupy.ndarray(q.shape, q.dtype, memptr=mem)
        lse = cupy.ndarray(prep.lse_shape, np.float32, memptr=mem + prep.lse_offset) if return_lse else None
        o_partial = mem.ptr + prep.partial_offset if prep.partial_offset else 0
        lse_partial = mem.ptr + prep.lse_partial_offset if prep.partial_offset else 0
        stream_ptr = cupy.cuda.get_current_stream().ptr
        counters = _split_counters(prep.device_id, stream_ptr, prep.counter_tiles) if prep.counter_tiles else 0
        pointers = (q.data.ptr, k_cache.data.ptr, v_cache.data.ptr, _ptr(k), _ptr(v), out.data.ptr, _ptr(lse),
                    o_partial, lse_partial, _ptr(prep.seqlens_array(cache_seqlens)), _ptr(cache_batch_idx),
                    _ptr(block_table), _ptr(alibi_slopes), counters)
        if prep.maps is None:
            prep.launch(stream_ptr, *pointers)
        else:  # the TMA kernel: the caches' tensor maps (cached per address) after the struct's plain fields
            k_map, v_map = prep.maps
            prep.launch.call_with_tail(stream_ptr, plan.DECODE_TMA_MAPS_OFFSET,
                                       k_map(k_cache.data.ptr) + v_map(v_cache.data.ptr), *pointers)
    return (out, lse) if return_lse else out


# DecodeParams starts with 14 pointers (q .. split_counters, params.cuh); every kernel of a call (append, decode,
# combine) takes the same struct, so one KernelCall launches them all.
DECODE_POINTERS = plan.DECODE_PARAMS_DTYPE.names[:14]
_decode_calls: dict = {}  # call signature -> _DecodeCall: checks, plan and constant params, done once
_counters: dict = {}      # (device id, stream pointer) -> int32 zeros: the split counters of calls on that stream
_retired: list = []       # outgrown counter buffers, kept: a kernel still queued may use one


def _split_counters(device_id: int, stream_ptr: int, tiles: int) -> int:
    """A zeroed int32 counter per row tile for the fused combine (plan.DECODE_COMBINE), on this stream. The last
    CTA of a tile resets its counter, so a buffer is zero again for the next call on the same stream; calls on
    other streams, which may run at the same time, get their own."""
    buf = _counters.get((device_id, stream_ptr))
    if buf is None or buf.size < tiles:
        import cupy
        if buf is not None:
            _retired.append(buf)
        buf = _counters[device_id, stream_ptr] = cupy.zeros(max(tiles, 2 * (buf.size if buf is not None else 512)),
                                                             dtype=np.int32)
    return buf.data.ptr


class _DecodeCall(NamedTuple):
    device_id: int
    launch: KernelCall        # append (when k/v are given), decode, combine (when split), one struct
    lse_shape: tuple
    nbytes: int               # one allocation per call: out | lse | partial O | partial lse
    lse_offset: int           # byte offsets into it; partial_offset 0: one split, no workspace
    partial_offset: int
    lse_partial_offset: int
    seqlens_array: Callable   # cache_seqlens -> the array to point at, or None
    maps: tuple | None = None  # the TMA kernel: (k map, v map) encoders, ptr -> 128 bytes; None: cp.async kernel
    counter_tiles: int = 0    # the fused combine: split counters needed (row tiles x KV heads x batch); 0: none


def _ptr(x) -> int:
    return 0 if x is None else x.data.ptr


def _prepare_decode(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, softmax_scale,
                    causal, window_size, softcap, alibi_slopes, num_splits, return_lse) -> _DecodeCall:
    """Everything about a decode call that depends only on shapes, strides, dtypes and options."""
    problem = checks.check_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=cache_seqlens,
                                   cache_batch_idx=cache_batch_idx, block_table=block_table,
                                   num_splits=num_splits, softmax_scale=softmax_scale, causal=causal,
                                   window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes)
    _require_device_arrays(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v, alibi_slopes=alibi_slopes)
    seqlens_is_array = not (cache_seqlens is None or checks._is_int(cache_seqlens))
    _require_device_index_arrays(cache_seqlens=cache_seqlens if seqlens_is_array else None,
                                 cache_batch_idx=cache_batch_idx, block_table=block_table)
    scale = 1.0 / math.sqrt(problem.headdim) if softmax_scale is None else float(softmax_scale)
    left, right = plan.normalize_window(*checks.window(causal, window_size), problem.seqlen_q, problem.seqlen_k)
    score_mod = softcap > 0 or alibi_slopes is not None
    seqlen_new_k = 0 if k is None else k.shape[1]
    capacity = problem.seqlen_k
    if cache_seqlens is None:
        cache_len = capacity
    else:
        cache_len = 0 if seqlens_is_array else int(cache_seqlens)
    known_keys = capacity if seqlens_is_array else cache_len + seqlen_new_k  # bounds the split count
    device_id = q.device.id
    maps = _decode_tma_maps(problem, k_cache, v_cache, block_table, build.device_arch(device_id))
    launch = plan.plan_decode(dataclasses.replace(problem, seqlen_k=max(known_keys, 1)), left, right, score_mod,
                              int(num_splits), build.sm_count(device_id), maps is not None)
    b, sq, h, d = problem.batch, problem.seqlen_q, problem.nheads, problem.headdim

    p = np.zeros((), dtype=plan.DECODE_PARAMS_DTYPE if maps is None else plan.DECODE_TMA_PARAMS_DTYPE)
    _set_strides(p, q=q, k=k_cache, v=v_cache, o=q)  # out is allocated contiguous like q's shape
    p["o_batch_stride"], p["o_row_stride"], p["o_head_stride"] = sq * h * d, h * d, d
    if k is not None:
        _set_strides(p, kn=k, vn=v)
    p["alibi_batch_stride"] = _alibi_batch_stride(alibi_slopes)
    p["block_table_stride"] = _elem_strides(block_table)[0] if block_table is not None else 0
    p["batch"], p["seqlen_q"], p["seqlen_new_k"], p["cache_len"] = b, sq, seqlen_new_k, cache_len
    p["nheads"], p["heads_per_kv"], p["headdim"] = h, h // problem.nheads_k, d
    p["page_size"] = k_cache.shape[1] if block_table is not None else 0
    p["window_left"], p["window_right"] = left, right
    p["num_splits"] = launch.splits
    kv_bytes = 2 * b * max(known_keys, 1) * problem.nheads_k * d * q.itemsize  # what the call reads at most
    p["kv_evict_first"] = int(maps is not None and plan.decode_evict_first(kv_bytes))
    for name, value in plan.forward_scales(scale, float(softcap), score_mod).items():
        p[name] = value

    dtype = launch.spec.dtype
    launches = []
    if k is not None:
        append = plan.DecodeAuxSpec("decode_append", dtype)
        chunks = b * seqlen_new_k * problem.nheads_k * (d // 8)
        launches.append((build.get_kernel(append, device_id), (min(-(-chunks // append.threads), 65535),),
                         (append.threads,), 0))
    launches.append((build.get_kernel(launch.spec, device_id), launch.grid, (launch.spec.threads,),
                     launch.spec.smem_bytes))
    partial_rows = launch.splits * b * h * sq if launch.splits > 1 else 0
    fused = maps is not None and plan.decode_fused_combine(launch.splits)  # the TMA kernel merges its own splits
    counter_tiles = launch.grid[0] // launch.splits * launch.grid[1] * launch.grid[2] if fused else 0
    if partial_rows and not fused:
        combine = plan.DecodeAuxSpec("decode_combine", dtype)
        launches.append((build.get_kernel(combine, device_id), (b * h * sq,), (combine.threads,), 0,  # a CTA a row
                         plan.pdl_applies(build.device_arch(device_id))))
    align = lambda n: -(-n // 256) * 256  # noqa: E731
    lse_offset = align(q.size * q.itemsize)
    partial_offset = align(lse_offset + (b * h * sq * 4 if return_lse else 0)) if partial_rows else 0
    lse_partial_offset = partial_offset + partial_rows * d * 4
    nbytes = (lse_partial_offset + partial_rows * 4 if partial_rows
              else partial_offset or align(lse_offset + b * h * sq * 4))
    with _device(device_id):  # the kernels' functions are taken on the device they run on
        launch = KernelCall(launches, p, DECODE_POINTERS)
    return _DecodeCall(device_id, launch, (b, h, sq), nbytes, lse_offset,
                       partial_offset, lse_partial_offset, (lambda x: x) if seqlens_is_array else (lambda x: None),
                       maps, counter_tiles)


def _decode_tma_maps(problem, k_cache, v_cache, block_table, arch: str):
    """(k, v) tensor-map encoders for the TMA decode kernel, or None where it does not apply (the planner's
    switch and shapes, plan.decode_tma_applies; or cache strides TMA refuses). A map covers the whole cache as
    (head dim, KV heads, rows, cache rows or pages), one box a 64-column panel of 64 rows."""
    page_size = k_cache.shape[1] if block_table is not None else 0
    if not plan.decode_tma_applies(arch, problem.headdim, problem.seqlen_q * (problem.nheads // problem.nheads_k),
                                   page_size):
        return None
    layouts = [hopper._map_layout(x, plan.DECODE_TMA["block_n"]) for x in (k_cache, v_cache)]
    try:
        for layout in layouts:
            tma.check_tiled(0x10000, *layout, 128)
    except ValueError:
        return None
    return tuple(tma.encoder(*layout, swizzle=128) for layout in layouts)


def _require_device_index_arrays(**arrays) -> None:
    import cupy
    for name, x in arrays.items():
        if x is not None and not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name}: expected a cupy.ndarray of int32, got "
                            f"{type(x).__module__}.{type(x).__name__}")


def _set_strides(p, **arrays) -> None:
    """`name_{batch,row,head}_stride` fields of each array, in elements (see _seq_strides)."""
    for name, x in arrays.items():
        p[f"{name}_batch_stride"], p[f"{name}_row_stride"], p[f"{name}_head_stride"] = _seq_strides(x)


_seq_strides = checks.seq_strides
_lse_strides = checks.lse_strides


def _fwd_params(problem, q, k, v, out, lse, alibi, left, right, scale, softcap, score_mod):
    """FwdParams but its pointers (each call gives them): strides of the layouts (arrays or TensorSpecs), sizes,
    window, scales."""
    p = np.zeros((), dtype=plan.FWD_PARAMS_DTYPE)
    _set_strides(p, q=q, k=k, v=v, o=out)
    p["lse_batch_stride"], p["lse_head_stride"] = _lse_strides(lse)
    p["alibi_batch_stride"] = _alibi_batch_stride(alibi)
    p["seqlen_q"], p["seqlen_k"] = problem.seqlen_q, problem.seqlen_k
    p["nheads"], p["heads_per_kv"] = problem.nheads, problem.nheads // problem.nheads_k
    p["headdim"] = problem.headdim
    p["window_left"], p["window_right"] = left, right
    for name, value in plan.forward_scales(scale, softcap, score_mod).items():
        p[name] = value
    return p[()]


_elem_strides = checks.elem_strides


_alibi_batch_stride = checks.alibi_batch_stride


def _require_device_arrays(**arrays) -> None:
    """CuPy arrays whose 16-byte chunks along the last axis are aligned (cp.async copies 16 bytes)."""
    import cupy
    for name, x in arrays.items():
        if x is None:
            continue
        if not isinstance(x, cupy.ndarray):
            raise TypeError(f"{name}: expected a cupy.ndarray, got {type(x).__module__}.{type(x).__name__} "
                            "(torch and JAX arrays convert without a copy: cupy.from_dlpack(x))")
        if x.dtype in (np.float32, np.int32):  # ALiBi slopes, lse, cu_seqlens: read one element at a time
            continue
        bad = [axis for axis, (n, s) in enumerate(zip(x.shape[:-1], x.strides[:-1])) if n > 1 and s % 16]
        if x.data.ptr % 16 or bad:
            where = f"stride of axis {bad[0]} is {x.strides[bad[0]] // x.itemsize} elements" if bad else \
                f"data pointer {x.data.ptr:#x}"
            raise ValueError(f"{name}: must be 16-byte aligned (pointer and strides multiples of 8 elements); "
                             f"{where}")


def _device(device_id: int):
    """Switch to `device_id` unless it is current already (a context switch costs microseconds per call)."""
    import cupy
    if cupy.cuda.runtime.getDevice() == device_id:
        return contextlib.nullcontext()
    return cupy.cuda.Device(device_id)


def _on(stream):
    if stream is None:
        return contextlib.nullcontext()
    if isinstance(stream, int):
        import cupy
        stream = cupy.cuda.ExternalStream(stream)
    return stream
