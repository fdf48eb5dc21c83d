"""JAX entry point: :func:`attention` on jax arrays, under ``jax.jit`` and ``jax.grad``.

    import cuflash.jax
    out = cuflash.jax.attention(q, k, v, causal=True)   # q (b, s, h, d) float16/bfloat16 on a GPU

Forward and backward are each one XLA custom call (``jax.ffi.ffi_call``) to a handler registered with
XLA's typed FFI (``api_version=1``). The handler is a ctypes callback into Python: it reads the buffer
pointers and the CUDA stream XLA hands it and launches the kernels on that stream from the pointers. The
launch (checks, plan, kernel) is built once per options, buffer layouts and stream
(:func:`cuflash.ops.forward.forward_call`, :func:`cuflash.ops.backward.backward_call`); a call after that
makes no CuPy object. Nothing goes through the host: no ``pure_callback``, no device-to-host copy, no
synchronization.

Options travel as one string attribute of the custom call. The backward's workspaces (fp32 dQ
accumulator, rowsum(dO*O), lse in log2) are a fourth output of the backward call, sized at trace time by
:func:`backward_workspace_bytes`, so XLA allocates them like any temporary and the handler allocates
nothing. Why the typed FFI and not the older ``api_version=0`` custom call: see ``docs/frameworks.md``.
"""
from __future__ import annotations

import ast
import functools
import math

import numpy as np

try:
    import jax
    import jax.numpy as jnp
except ImportError as err:
    raise ModuleNotFoundError(f"cuflash.jax needs JAX: pip install jax ({err})", name=err.name) from err
import ml_dtypes  # noqa: E402

from . import _xla_ffi as ffi  # noqa: E402
from . import checks, runtime  # noqa: E402
from .options import normalize_window, resolve  # noqa: E402
from .ops import backward, forward, forward_fp8, quantize  # noqa: E402

__all__ = ["attention", "attention_fp8", "attention_varlen", "attention_varlen_fp8", "backward_workspace_bytes",
           "quantize_e4m3"]

FWD_TARGET = "cuflash_attention_fwd"
BWD_TARGET = "cuflash_attention_bwd"
VARLEN_FWD_TARGET = "cuflash_attention_varlen_fwd"
VARLEN_BWD_TARGET = "cuflash_attention_varlen_bwd"
FP8_TARGET = "cuflash_attention_fp8"
VARLEN_FP8_TARGET = "cuflash_attention_varlen_fp8"
QUANTIZE_TARGET = "cuflash_quantize_e4m3"

_DTYPES = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
           "float32": np.dtype(np.float32), "uint8": np.dtype(np.uint8), "int32": np.dtype(np.int32),
           "uint32": np.dtype(np.uint32), "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn)}


def attention(q, k, v, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, deterministic=False, dropout_p=0.0, dropout_key=None):
    """:func:`cuflash.attention` on jax arrays, differentiable with respect to q, k and v.

    Parameters
    ----------
    q : jax.Array, (batch, seqlen_q, nheads, headdim), float16 or bfloat16, on a CUDA GPU
    k, v : jax.Array, (batch, seqlen_k, nheads_k, headdim), dtype of q; ``nheads % nheads_k == 0``
    softmax_scale, causal, window_size, softcap, alibi_slopes
        As in :func:`cuflash.attention` (Python values, static under ``jax.jit``; ``alibi_slopes`` a float32
        array ``(nheads,)`` or ``(batch, nheads)``, not differentiated). ``causal`` is bottom-right
        aligned when ``seqlen_q != seqlen_k`` (``jax.nn.dot_product_attention``'s ``is_causal`` is
        top-left); for seqlen_q = 2, seqlen_k = 5 (x = visible)::

            x x x x .
            x x x x x

    deterministic : bool
        Backward with a fixed dQ summation order (bitwise-repeatable gradients).
    dropout_p : float
        Dropout on the attention probabilities (a Python float, static under ``jax.jit``), as in
        :func:`cuflash.attention`; the backward regenerates the forward's mask. Head dims up to 128 in the backward
        (up to 256 on sm_90a without softcap or ALiBi).
    dropout_key : jax PRNG key, required when ``dropout_p > 0``
        The mask's seed and offset are 128 random bits drawn from it inside the computation (traced keys are
        fine): the same key gives the same mask, bitwise.

    Returns
    -------
    out : jax.Array, (batch, seqlen_q, nheads, headdim), dtype of q

    Examples
    --------
    >>> loss = lambda q, k, v: cuflash.jax.attention(q, k, v, causal=True).astype(jnp.float32).sum()
    >>> dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    """
    options = _Options.make(q, k, v, alibi_slopes, softmax_scale, causal, window_size, softcap, deterministic,
                            dropout_p)
    state = _dropout_state(dropout_p, dropout_key)
    if q.shape[-1] % 8:  # a head dim the kernels do not take: zero-padded copies (_padded)
        d = q.shape[-1]
        return _attention(*_padded(q, k, v), alibi_slopes, state, options.at_headdim(d))[..., :d]
    return _attention(q, k, v, alibi_slopes, state, options)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale=None,
                     causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                     dropout_p=0.0, dropout_key=None):
    """:func:`cuflash.attention_varlen` on jax arrays (packed sequences), differentiable in q, k and v.

    q ``(total_q, nheads, headdim)``, k/v ``(total_k, nheads_k, headdim)``, cu_seqlens_q/k int32
    ``(batch + 1,)`` (traced values are fine), max_seqlen_q/k Python ints (static under ``jax.jit``: they size
    the grid). Options as in :func:`attention`; masks are bottom-right aligned per sequence, and dropout's element
    (b, h, i, j) is query i, key j of sequence b.
    """
    options = _Options.make_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                                   softmax_scale, causal, window_size, softcap, deterministic, dropout_p)
    state = _dropout_state(dropout_p, dropout_key)
    if q.shape[-1] % 8:  # a head dim the kernels do not take: zero-padded copies (_padded)
        d = q.shape[-1]
        return _attention_varlen(*_padded(q, k, v), cu_seqlens_q, cu_seqlens_k, alibi_slopes, state,
                                 options.at_headdim(d))[..., :d]
    return _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, state, options)


def attention_fp8(q, k, v, *, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False,
                  window_size=(-1, -1), return_lse=False):
    """:func:`cuflash.attention_fp8` on jax arrays: FP8 (e4m3) attention on Hopper, forward only (not differentiable).

    Parameters
    ----------
    q : jax.Array, (batch, seqlen_q, nheads, headdim), float8_e4m3fn, on a CUDA GPU of sm_90a
    k, v : jax.Array, (batch, seqlen_k, nheads_k, headdim), float8_e4m3fn; ``nheads % nheads_k == 0``
        headdim a multiple of 16 up to 256.
    q_descale, k_descale, v_descale : jax.Array of float32, optional
        One value per tensor (shape () or (1,)) or one per (sequence, KV head), ``(batch, nheads_k)``. None: 1.
    softmax_scale, causal, window_size, return_lse : as in :func:`attention` (static under ``jax.jit``)

    Returns
    -------
    out : jax.Array, (batch, seqlen_q, nheads, headdim), bfloat16
    lse : jax.Array, (batch, nheads, seqlen_q), float32 -- only if ``return_lse``

    From ``forward_fp8.VT_PASS_FROM`` keys V^T is a third result of the call, XLA's buffer (docs/fp8.md), dropped
    here.
    """
    return _fp8(q, k, v, (q_descale, k_descale, v_descale), None, softmax_scale, causal, window_size, return_lse)


def attention_varlen_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, q_descale=None,
                         k_descale=None, v_descale=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                         return_lse=False):
    """:func:`cuflash.attention_varlen_fp8` on jax arrays: :func:`attention_fp8` over packed sequences, forward only
    (not differentiable).

    Parameters
    ----------
    q : jax.Array, (total_q, nheads, headdim), float8_e4m3fn, on a CUDA GPU of sm_90a
    k, v : jax.Array, (total_k, nheads_k, headdim), float8_e4m3fn; ``nheads % nheads_k == 0``
    cu_seqlens_q, cu_seqlens_k : jax.Array, int32, (batch + 1,) (traced values are fine)
    max_seqlen_q, max_seqlen_k : int (static under ``jax.jit``: they size the grid and V^T)
    q_descale, k_descale, v_descale : jax.Array of float32, optional: per tensor or ``(batch, nheads_k)``, row ``b``
        for sequence ``b``
    softmax_scale, causal, window_size, return_lse : as in :func:`attention_fp8`, per sequence

    Returns
    -------
    out : jax.Array, (total_q, nheads, headdim), bfloat16; rows outside every sequence are left undefined
    lse : jax.Array, (nheads, total_q), float32 -- only if ``return_lse``

    From ``forward_fp8.VT_PASS_FROM`` keys V^T (``batch nheads_k headdim ceil(max_seqlen_k / 32) 32`` bytes) is a
    third result of the call, dropped here.
    """
    return _fp8(q, k, v, (q_descale, k_descale, v_descale), (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k),
                softmax_scale, causal, window_size, return_lse)


def _fp8(q, k, v, descales, varlen, softmax_scale, causal, window_size, return_lse):
    """attention_fp8 (varlen None) and attention_varlen_fp8 (varlen: cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k): cuflash.checks' checks at trace time, then one ffi_call (inputs q, k, v, the cu_seqlens where
    packed, the descales present; results out, lse, and V^T where the call takes it from the pass)."""
    names = ("q_descale", "k_descale", "v_descale")
    options = dict(zip(names, (_spec(x, n) for x, n in zip(descales, names))), softmax_scale=softmax_scale,
                   causal=causal, window_size=window_size)
    qkv = [_e4m3_spec(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))]
    if varlen:
        problem = checks.check_varlen_fp8(*qkv, _spec(varlen[0], "cu_seqlens_q"), _spec(varlen[1], "cu_seqlens_k"),
                                          *varlen[2:], **options)
    else:
        problem = checks.check_attention_fp8(*qkv, **options)
    left, right = checks.window(causal, window_size)
    present = tuple(x is not None for x in descales)
    config = (None if softmax_scale is None else float(softmax_scale), left, right, present)
    if varlen:
        config += (problem.seqlen_q, problem.seqlen_k)
    _register()
    b, sq, h = problem.batch, problem.seqlen_q, problem.nheads
    lse_shape = (h, q.shape[0]) if varlen else (b, h, sq)
    results = (jax.ShapeDtypeStruct(q.shape, jnp.bfloat16), jax.ShapeDtypeStruct(lse_shape, jnp.float32))
    vt_shape = forward_fp8.vt_shape(problem, left >= 0 or right >= 0)
    if vt_shape is not None:
        results += (jax.ShapeDtypeStruct(vt_shape, jnp.uint8),)
    args = (q, k, v) + (tuple(varlen[:2]) if varlen else ()) + tuple(x for x in descales if x is not None)
    target = VARLEN_FP8_TARGET if varlen else FP8_TARGET
    out, lse = jax.ffi.ffi_call(target, results, vmap_method="sequential")(*args, config=repr(config))[:2]
    return (out, lse) if return_lse else out


def quantize_e4m3(x, *, per="tensor", nheads_k=None, pow2=False, descale=None):
    """:func:`cuflash.quantize_e4m3` on a jax array, under jit: ``(x8, descale)``, x8 float8_e4m3fn of x's shape and
    descale float32 ``()`` (per "tensor") or ``(batch, nheads_k)`` (per "head"), the inputs :func:`attention_fp8`
    takes. x: ``(batch, seqlen, nheads, headdim)`` float16 or bfloat16, headdim a multiple of 16 up to 256. A given
    ``descale`` (float32 ``()``, ``(1,)`` or ``(batch, nheads_k)``) is used instead of found, and returned. One
    ffi_call; without a given descale its third result is the kernels' amax workspace (zeroed on the call's
    stream)."""
    batch, _, _, _, nheads_k, per = checks.check_quantize_e4m3(_spec(x, "x"), per=per, nheads_k=nheads_k, pow2=pow2,
                                                               descale=_spec(descale, "descale"))
    shape = quantize.descale_shape(batch, nheads_k, per)
    groups = math.prod(shape)
    _register()
    results = (jax.ShapeDtypeStruct(x.shape, jnp.float8_e4m3fn),)
    if descale is None:
        results += (jax.ShapeDtypeStruct((groups,), jnp.float32), jax.ShapeDtypeStruct((groups,), jnp.uint32))
    outs = jax.ffi.ffi_call(QUANTIZE_TARGET, results, vmap_method="sequential")(
        x, *(() if descale is None else (descale,)), config=repr((per, nheads_k, bool(pow2))))
    if descale is not None:
        return outs[0], descale
    return outs[0], outs[1].reshape(shape)


def _e4m3_spec(x, name):
    """_spec of an e4m3 input, as the checks take it: uint8 (the bits, as in the CuPy API)."""
    spec = _spec(x, name)
    if spec is not None and spec.dtype != np.dtype(ml_dtypes.float8_e4m3fn):
        raise TypeError(f"{name}: dtype {spec.dtype} is not supported; expected float8_e4m3fn")
    return spec if spec is None else checks.TensorSpec(name, spec.shape, np.dtype(np.uint8), spec.strides, None)


def _dropout_state(dropout_p, key):
    """The dropout generator's (seed, offset) as four uint32 words drawn from ``key`` (the kernels read them as two
    64-bit words, little-endian), or None without dropout."""
    if not dropout_p:
        return None
    if key is None:
        raise ValueError("dropout_key: a PRNG key is required when dropout_p > 0 (e.g. jax.random.key(0))")
    return jax.random.bits(key, (4,), jnp.uint32)


def _padded(*arrays) -> list:
    """The kernels load 16 bytes at a time, so they take head dims that are multiples of 8. Any other head dim d
    runs on copies of q, k, v padded with zero columns up to checks.padded_headdim(d) (jnp.pad: jax.grad slices
    the gradients back), at the default scale 1 / sqrt(d); the caller gets the first d columns of out. Zero
    columns add nothing to q . k and give zero columns of out, so the result is the unpadded attention."""
    d = arrays[0].shape[-1]
    widths = [(0, 0)] * (arrays[0].ndim - 1) + [(0, checks.padded_headdim(d) - d)]
    return [jnp.pad(x, widths) for x in arrays]


# --------------------------------------------------------------------------------------------
# Options: checked once at trace time, then carried to the handler as one string attribute
# --------------------------------------------------------------------------------------------

class _Options(tuple):
    """(softmax_scale or None, causal, left, right, softcap, deterministic, dropout_p), then for varlen calls
    (max_seqlen_q, max_seqlen_k): hashable, static under jit."""

    @classmethod
    def make(cls, q, k, v, alibi_slopes, softmax_scale, causal, window_size, softcap, deterministic, dropout_p=0.0):
        problem = checks.check_attention(*(_spec(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"))),
                                         softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                                         softcap=softcap, alibi_slopes=_spec(alibi_slopes, "alibi_slopes"),
                                         headdim_multiple=1, dropout_p=dropout_p)  # padded after, in attention
        if not isinstance(deterministic, (bool, np.bool_)):
            raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__} {deterministic!r}")
        del problem  # only checked here; the handler rebuilds it from the buffer shapes
        left, right = checks.window(causal, window_size)
        scale = None if softmax_scale is None else float(softmax_scale)
        return cls((scale, bool(causal), left, right, float(softcap), bool(deterministic), float(dropout_p)))

    @classmethod
    def make_varlen(cls, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes,
                    softmax_scale, causal, window_size, softcap, deterministic, dropout_p=0.0):
        """The options plus (max_seqlen_q, max_seqlen_k), checked like cuflash.attention_varlen's."""
        specs = [_spec(x, n) for x, n in ((q, "q"), (k, "k"), (v, "v"), (cu_seqlens_q, "cu_seqlens_q"),
                                          (cu_seqlens_k, "cu_seqlens_k"))]
        checks.check_varlen(*specs, max_seqlen_q, max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                            window_size=window_size, softcap=softcap, alibi_slopes=_spec(alibi_slopes, "alibi_slopes"),
                            headdim_multiple=1, dropout_p=dropout_p)  # padded after, in attention_varlen
        if not isinstance(deterministic, (bool, np.bool_)):
            raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__} {deterministic!r}")
        left, right = checks.window(causal, window_size)
        scale = None if softmax_scale is None else float(softmax_scale)
        return cls((scale, bool(causal), left, right, float(softcap), bool(deterministic), float(dropout_p),
                    int(max_seqlen_q), int(max_seqlen_k)))

    def at_headdim(self, headdim: int) -> "_Options":
        """The options of a call padded from ``headdim``: the default scale is ``1 / sqrt(headdim)``."""
        scale = 1.0 / math.sqrt(headdim) if self[0] is None else self[0]
        return _Options((scale, *self[1:]))

    def encode(self) -> str:
        return repr(tuple(self))

    @staticmethod
    @functools.lru_cache(maxsize=256)
    def decode(text: bytes) -> tuple:
        """The launch keywords (a tuple of pairs; make a dict per call; dropout_p among them where it is > 0), the
        deterministic flag and the varlen call's (max_seqlen_q, max_seqlen_k)."""
        scale, causal, left, right, softcap, det, dropout_p, *max_seqlens = ast.literal_eval(text.decode())
        dropout = (("dropout_p", dropout_p),) if dropout_p else ()
        return (("softmax_scale", scale), ("causal", causal), ("window_size", (left, right)),
                ("softcap", softcap)) + dropout, det, tuple(max_seqlens)


def _spec(x, name):
    """A TensorSpec for a jax array or tracer: row-major (XLA's default layout for custom-call operands)."""
    if x is None:
        return None
    if not all(hasattr(x, a) for a in ("shape", "dtype")):
        raise TypeError(f"{name}: expected a jax array, got {type(x).__name__}")
    shape = tuple(int(n) for n in x.shape)
    strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape)))
    return checks.TensorSpec(name, shape, np.dtype(x.dtype), strides, None)


# --------------------------------------------------------------------------------------------
# custom_vjp: forward and backward are one ffi_call each
# --------------------------------------------------------------------------------------------

# Inputs of every call: its fixed ones, then the dropout state (uint32[4]) where dropout_p > 0, then alibi_slopes
# where given (_optional_inputs).

@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, alibi_slopes, state, options):
    return _forward_call(q, k, v, alibi_slopes, options, state)[0]


def _attention_fwd(q, k, v, alibi_slopes, state, options):
    out, lse = _forward_call(q, k, v, alibi_slopes, options, state)
    return out, (q, k, v, alibi_slopes, state, out, lse)


def _attention_bwd(options, residuals, dout):
    q, k, v, alibi_slopes, state, out, lse = residuals
    dq, dk, dv = _backward_call(dout, q, k, v, out, lse, alibi_slopes, options, state)
    return (dq, dk, dv, None if alibi_slopes is None else jnp.zeros_like(alibi_slopes),
            None if state is None else np.zeros(state.shape, dtype=jax.dtypes.float0))


_attention.defvjp(_attention_fwd, _attention_bwd)


def _optional(state, alibi_slopes) -> tuple:
    return tuple(x for x in (state, alibi_slopes) if x is not None)


def _optional_inputs(buffers: list, fixed: int, options: dict) -> tuple:
    """(dropout state, alibi slopes) among a call's input buffers after its `fixed` ones, each None if absent."""
    rest = buffers[fixed:]
    state = rest.pop(0) if options.get("dropout_p") else None
    return state, (rest[0] if rest else None)


def _forward_call(q, k, v, alibi_slopes, options, state=None):
    _register()
    b, sq, h, _ = q.shape
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, sq), jnp.float32))
    args = (q, k, v) + _optional(state, alibi_slopes)
    return jax.ffi.ffi_call(FWD_TARGET, results, vmap_method="sequential")(*args, config=options.encode())


def _backward_call(dout, q, k, v, out, lse, alibi_slopes, options, state=None):
    _register()
    problem = checks.Problem(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3],
                             np.dtype(q.dtype))
    workspace = backward_workspace_bytes(problem, options[2], options[3], options[4] > 0 or alibi_slopes is not None,
                                         options[5], dropout=options[6] > 0)
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
               jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((workspace,), jnp.uint8))
    args = (dout.astype(q.dtype), q, k, v, out, lse) + _optional(state, alibi_slopes)
    dq, dk, dv, _ = jax.ffi.ffi_call(BWD_TARGET, results, vmap_method="sequential")(*args, config=options.encode())
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, state, options):
    return _varlen_forward_call(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, options, state)[0]


def _attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, state, options):
    out, lse = _varlen_forward_call(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, options, state)
    return out, (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, state, out, lse)


def _attention_varlen_bwd(options, residuals, dout):
    q, k, v, cu_q, cu_k, alibi_slopes, state, out, lse = residuals
    _register()
    total_q, h, d = q.shape
    problem = checks.Problem(cu_q.shape[0] - 1, options[7], options[8], h, k.shape[1], d, np.dtype(q.dtype))
    workspace = backward_workspace_bytes(problem, options[2], options[3], options[4] > 0 or alibi_slopes is not None,
                                         options[5], rows=total_q, dropout=options[6] > 0)
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
               jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct((workspace,), jnp.uint8))
    args = (dout.astype(q.dtype), q, k, v, out, lse, cu_q, cu_k) + _optional(state, alibi_slopes)
    dq, dk, dv, _ = jax.ffi.ffi_call(VARLEN_BWD_TARGET, results, vmap_method="sequential")(
        *args, config=options.encode())
    zero_int = lambda x: np.zeros(x.shape, dtype=jax.dtypes.float0)  # noqa: E731  (integer inputs)
    return (dq, dk, dv, zero_int(cu_q), zero_int(cu_k),
            None if alibi_slopes is None else jnp.zeros_like(alibi_slopes),
            None if state is None else zero_int(state))


_attention_varlen.defvjp(_attention_varlen_fwd, _attention_varlen_bwd)


def _varlen_forward_call(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, options, state=None):
    _register()
    total_q, h, _ = q.shape
    results = (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((h, total_q), jnp.float32))
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k) + _optional(state, alibi_slopes)
    return jax.ffi.ffi_call(VARLEN_FWD_TARGET, results, vmap_method="sequential")(*args, config=options.encode())


def backward_workspace_bytes(problem, left: int, right: int, score_mod: bool, deterministic: bool,
                             rows: int | None = None, dropout: bool = False) -> int:
    """Bytes of the workspace :func:`cuflash.ops.backward.launch` needs, the backward call's fourth result (an XLA
    buffer; :func:`cuflash.ops.backward.workspace`: ``dsum``, ``lse_log2``, the fp32 dQ accumulator).

    Deterministic mode's slice count grows with the GPU's SM count and differs between the portable and the
    Hopper main kernel, so it is planned for the largest GPU visible here and every architecture among the
    visible GPUs (both, on a machine without one), and the largest count taken (an upper bound for any of them),
    with room for the Hopper kernel's fixed point (one slice and two small pieces). A backward that none of those
    architectures has (head dims above 128 off sm_90a) raises NotImplementedError here, at trace time.
    `rows`: query rows of the workspaces, batch * seqlen_q by default, total_q for packed sequences.
    """
    left, right = normalize_window(left, right, problem.seqlen_q, problem.seqlen_k)
    rows = problem.batch * problem.seqlen_q if rows is None else rows  # total_q for packed sequences
    slices, refused = [], None
    for arch in _archs():
        try:
            slices.append(backward.plan_backward(problem, left, right, score_mod, deterministic, arch,
                                                 _max_sm_count(), dropout=dropout).slices)
        except NotImplementedError as err:
            refused = err
    if not slices:
        raise refused
    slices = max(slices)
    # room for the fixed point's pieces too in deterministic mode (whether a GPU takes it depends on its SM count),
    # and for the first stores' counters (for the smallest query blocks the kernel may take)
    counters = backward.first_store_counters(problem.batch, problem.nheads, problem.seqlen_q,
                                             min(backward.backward_sm90.BLOCK_M_CHOICES))
    return backward.workspace(rows, problem.nheads, problem.headdim, slices,
                              problem.nheads_k if deterministic else 0, counters)[2]


@functools.lru_cache(maxsize=None)
def _archs() -> tuple:
    """The architectures of the visible GPUs, or both the kernels know where none is visible (tracing on a CPU
    machine)."""
    try:
        import cupy
        from . import build
        archs = tuple(sorted({build.device_arch(i) for i in range(cupy.cuda.runtime.getDeviceCount())}))
        return archs or ("sm_80", "sm_90a")
    except Exception:
        return ("sm_80", "sm_90a")


@functools.lru_cache(maxsize=None)
def _max_sm_count() -> int:
    try:
        import cupy
        return max(cupy.cuda.runtime.getDeviceProperties(i)["multiProcessorCount"]
                   for i in range(cupy.cuda.runtime.getDeviceCount()))
    except Exception:  # no GPU here (tracing on a CPU machine): plan for one slice per KV block
        return 1 << 20


# --------------------------------------------------------------------------------------------
# The FFI handlers (run by XLA on its own thread, on the stream it hands us)
# --------------------------------------------------------------------------------------------

def _parse(frame):
    """(options, deterministic, input buffers, output buffers) of one call; buffers are (ptr, shape, dtype name).
    Varlen calls also carry (max_seqlen_q, max_seqlen_k): see _parse_varlen."""
    options, deterministic, _ = _Options.decode(ffi.string_attr(frame, "config"))
    return dict(options), deterministic, ffi.buffers(frame.args), ffi.buffers(frame.rets)


def _parse_varlen(frame, first: int):
    """_parse plus the varlen problem: (options, deterministic, problem, inputs, outputs). q and k are inputs
    `first` and `first + 1`, cu_seqlens_q comes after (q, k, v) in the forward (first = 0) and after
    (dout, q, k, v, out, lse) in the backward (first = 1)."""
    options, deterministic, (max_q, max_k) = _Options.decode(ffi.string_attr(frame, "config"))
    ins, outs = ffi.buffers(frame.args), ffi.buffers(frame.rets)
    problem = _varlen_problem(ins[first], ins[first + 1], ins[3 if first == 0 else 6], max_q, max_k)
    return dict(options), deterministic, problem, ins, outs


def _parse_call(frame, varlen: bool, first: int):
    """(options, deterministic, problem, inputs, outputs) of a dense or varlen call whose q and k are inputs `first`
    and `first + 1` (0 in the forward, 1 in the backward)."""
    if varlen:
        return _parse_varlen(frame, first)
    options, deterministic, ins, outs = _parse(frame)
    return options, deterministic, _problem(ins[first], ins[first + 1]), ins, outs


def _problem(q, k) -> checks.Problem:
    (b, sq, h, d), (sk, hk) = q[1], k[1][1:3]
    return checks.Problem(b, sq, sk, h, hk, d, _DTYPES[q[2]])


def _varlen_problem(q, k, cu_q, max_q: int, max_k: int) -> checks.Problem:
    """The problem of packed q (total_q, h, d) and k (total_k, hk, d): batch from cu_seqlens_q, lengths the maxima."""
    return checks.Problem(cu_q[1][0] - 1, max_q, max_k, q[1][1], k[1][1], q[1][2], _DTYPES[q[2]])


# A call's launch depends only on its options, its buffers' shapes and dtypes and its stream: it is built once
# (checks, plan, kernel) and then run from the buffers' pointers alone, with no CuPy object per call.
_launchers: dict = {}  # (target, config, stream, buffer layouts) -> (device, launch(stream, inputs, outputs))


def _run(frame, target: str, build) -> None:
    """Run the call of `frame` through its cached launch; ``build(device, frame)`` makes one (on a miss)."""
    config = ffi.string_attr(frame, "config")
    ins, outs = ffi.buffers(frame.args), ffi.buffers(frame.rets)
    stream = ffi.stream(frame)
    key = (target, config, stream, tuple(b[1:] for b in ins), tuple(b[1:] for b in outs))
    entry = _launchers.get(key)
    if entry is None:
        import cupy
        device = cupy.cuda.runtime.pointerGetAttributes(next(b[0] for b in ins if b[0])).device
        with cupy.cuda.Device(device):
            entry = runtime.keep(_launchers, key, (device, build(device, frame)))
    device, launch = entry
    with runtime.device(device):
        launch(stream, [b[0] for b in ins], [b[0] for b in outs])


def _buffer_spec(buf, name: str) -> checks.TensorSpec:
    """The layout of an XLA buffer (contiguous, row-major)."""
    return checks.contiguous(name, buf[1], _DTYPES[buf[2]])


def _build_forward(device, frame, varlen: bool = False):
    """The forward's launch for the call of `frame` (parsed as the CPU tests parse it: _parse_call)."""
    options, _, problem, ins, outs = _parse_call(frame, varlen, 0)
    q, k, v = (_buffer_spec(b, n) for b, n in zip(ins, ("q", "k", "v")))
    out, lse = _buffer_spec(outs[0], "out"), _buffer_spec(outs[1], "lse")
    fixed = 5 if varlen else 3
    state, alibi = _optional_inputs(ins, fixed, options)
    alibi = _buffer_spec(alibi, "alibi_slopes") if alibi is not None else None
    call = forward.forward_call(problem, q, k, v, out, lse, resolve(problem, alibi_slopes=alibi, **options),
                                device_id=device, alibi_slopes=alibi)
    n_state, n_alibi = (fixed, fixed + 1) if state is not None else (None, fixed)
    has_alibi = alibi is not None

    def launch(stream, i, o):
        cu = (i[3], i[4]) if varlen else (0, 0)
        call(stream, i[0], i[1], i[2], o[0], o[1], i[n_alibi] if has_alibi else 0, *cu, 0, 0, 0, 0,
             i[n_state] if n_state is not None else 0)
    return launch


def _build_backward(device, frame, varlen: bool = False):
    """The backward's launch for the call of `frame`; the workspace is its fourth output, XLA's buffer."""
    options, deterministic, problem, ins, outs = _parse_call(frame, varlen, 1)
    dout, q, k, v, out, lse = (_buffer_spec(b, n) for b, n in zip(ins, ("dout", "q", "k", "v", "out", "lse")))
    dq, dk, dv = (_buffer_spec(b, n) for b, n in zip(outs, ("dq", "dk", "dv")))
    fixed = 8 if varlen else 6
    state, alibi = _optional_inputs(ins, fixed, options)
    alibi = _buffer_spec(alibi, "alibi_slopes") if alibi is not None else None
    call = backward.backward_call(problem, dout, q, k, v, out, lse, dq, dk, dv,
                                  resolve(problem, alibi_slopes=alibi, **options), device_id=device,
                                  alibi_slopes=alibi, deterministic=deterministic, packed=varlen)
    workspace = ffi.nbytes(outs[3][1], _DTYPES[outs[3][2]])
    if workspace < call.workspace_bytes:
        raise ValueError(f"workspace: {workspace} bytes, the backward needs {call.workspace_bytes}")
    n_state, n_alibi = (fixed, fixed + 1) if state is not None else (None, fixed)
    has_alibi = alibi is not None

    def launch(stream, i, o):
        cu = (i[6], i[7]) if varlen else (0, 0)
        call(stream, *i[:6], *o[:3], i[n_alibi] if has_alibi else 0, *cu, o[3], 0, 0,
             i[n_state] if n_state is not None else 0)
    return launch


def _parse_fp8(frame):
    """(options, problem, packed, inputs, outputs, slots) of an FP8 call: options (softmax_scale, left, right); inputs
    q, k, v, then for packed sequences cu_seqlens_q and cu_seqlens_k, then the descales present; packed (total_q,
    total_k) for packed sequences (the config then ends in max_seqlen_q, max_seqlen_k), else None; slots: the input
    index of q_descale, k_descale, v_descale (None where absent); outputs out, lse, and V^T's workspace where the call
    takes V^T from the pass."""
    scale, left, right, present, *max_seqlens = ast.literal_eval(ffi.string_attr(frame, "config").decode())
    ins, outs = ffi.buffers(frame.args), ffi.buffers(frame.rets)
    fixed = 5 if max_seqlens else 3
    slots = [fixed + sum(present[:i]) if given else None for i, given in enumerate(present)]
    if max_seqlens:
        problem, packed = _varlen_problem(ins[0], ins[1], ins[3], *max_seqlens), (ins[0][1][0], ins[1][1][0])
    else:
        problem, packed = _problem(ins[0], ins[1]), None
    return (scale, left, right), problem, packed, ins, outs, slots


def _build_fp8(device, frame):
    """The FP8 forward's launches for the call of `frame` (_parse_fp8), dense or packed; V^T is its third output
    where the call takes it from the pass."""
    (scale, left, right), problem, packed, ins, outs, slots = _parse_fp8(frame)
    descales = [None if j is None else _buffer_spec(ins[j], "descale") for j in slots]
    call = forward_fp8.Fp8Call(problem, *(_buffer_spec(b, x).strides for b, x in zip(ins, "qkv")), left, right,
                               scale, forward_fp8.descale_stride(problem, descales), device, packed)
    workspace = outs[2][1] if len(outs) > 2 else None
    if workspace != call.vt_shape:  # traced under other settings (forward_fp8.vt_pass)
        raise ValueError(f"V^T workspace: shape {workspace}, the FP8 forward needs {call.vt_shape}")

    def launch(stream, i, o):
        cu = (i[3], i[4]) if packed else (0, 0)
        call(stream, i[0], i[1], i[2], o[2] if len(o) > 2 else 0, o[0], o[1],
             *(0 if j is None else i[j] for j in slots), *cu)
    return launch


def _build_quantize(device, frame):
    """quantize_e4m3's launches for the call of `frame`: inputs x (and a given descale); outputs x8, and without a
    given descale the descale found and the amax workspace."""
    per, nheads_k, pow2 = ast.literal_eval(ffi.string_attr(frame, "config").decode())
    ins = ffi.buffers(frame.args)
    x, given = _buffer_spec(ins[0], "x"), len(ins) > 1
    call = quantize.QuantizeCall(x.shape + (nheads_k, per), x.strides, x.dtype, pow2, device, given)
    import cupy
    memset, amax_bytes = cupy.cuda.runtime.memsetAsync, 4 * call.groups

    def launch(stream, i, o):
        if given:
            call(stream, i[0], o[0], 0, i[1])
            return
        memset(o[2], 0, amax_bytes, stream)
        call(stream, i[0], o[0], o[2], o[1])
    return launch


def _run_quantize(frame):
    _run(frame, QUANTIZE_TARGET, _build_quantize)


def _run_fp8(frame):
    _run(frame, FP8_TARGET, _build_fp8)


def _run_varlen_fp8(frame):
    _run(frame, VARLEN_FP8_TARGET, _build_fp8)


def _run_forward(frame):
    _run(frame, FWD_TARGET, _build_forward)


def _run_backward(frame):
    _run(frame, BWD_TARGET, _build_backward)


def _run_varlen_forward(frame):
    _run(frame, VARLEN_FWD_TARGET, functools.partial(_build_forward, varlen=True))


def _run_varlen_backward(frame):
    _run(frame, VARLEN_BWD_TARGET, functools.partial(_build_backward, varlen=True))


_handlers: dict = {}


def _register() -> None:
    """Registers the targets with XLA for CUDA, once (the handlers must outlive every call)."""
    if _handlers:
        return
    for name, run in ((FWD_TARGET, _run_forward), (BWD_TARGET, _run_backward),
                      (VARLEN_FWD_TARGET, _run_varlen_forward), (VARLEN_BWD_TARGET, _run_varlen_backward),
                      (FP8_TARGET, _run_fp8), (VARLEN_FP8_TARGET, _run_varlen_fp8),
                      (QUANTIZE_TARGET, _run_quantize)):
        _handlers[name] = handler = ffi.make_handler(run)
        jax.ffi.register_ffi_target(name, ffi.capsule(handler), platform="CUDA", api_version=1)
