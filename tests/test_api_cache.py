"""The CuPy API's calls kept per signature (``cuflash.attention``, ``cuflash.attention_backward``), without a GPU.

A stand-in for CuPy gives arrays with any layout, pointer and device, and allocates contiguous ones at fresh
addresses; build's device queries and kernel loading are replaced (``no_gpu_kernels``), and each launch records the
parameter struct it would pass instead of launching. So the public functions run as on a GPU up to the driver: a
call with an earlier call's signature skips the checks and the planning, a changed signature plans anew, bad input
raises what it raised uncached, and a kept launch passes the bytes an uncached one passes.
"""
import collections
import contextlib
import itertools
import re
import struct
import sys
import types

import ml_dtypes
import numpy as np
import pytest

import cuflash
from cuflash import checks, runtime, tma
from cuflash.launcher import KernelCall
from cuflash.ops import backward
from cuflash.options import resolve
from tests.fixtures import configure, no_gpu_kernels  # noqa: F401  (fixtures)


def _contiguous(shape, itemsize) -> tuple:
    strides, n = [], itemsize
    for size in reversed(shape):
        strides.append(n)
        n *= size
    return tuple(reversed(strides))


class _DeviceArray:
    """What cuflash reads from a CuPy array. ``_DeviceArray(shape, dtype)`` allocates as ``cupy.ndarray`` does:
    contiguous, at the stand-in's next free address on device 0."""

    allocated: list = []  # every array allocated so far, in order
    _addresses = itertools.count(0x100000, 0x10000)

    def __init__(self, shape, dtype, strides=None, ptr=None, device=0):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.itemsize, self.ndim = self.dtype.itemsize, len(shape)
        contiguous = _contiguous(shape, self.itemsize)
        self.strides = contiguous if strides is None else tuple(strides)
        self.nbytes = int(np.prod(shape)) * self.itemsize
        self.flags = types.SimpleNamespace(c_contiguous=self.strides == contiguous)
        self.data = types.SimpleNamespace(ptr=next(self._addresses) if ptr is None else ptr, device_id=device)
        self.device = types.SimpleNamespace(id=device)
        if ptr is None:
            _DeviceArray.allocated.append(self)

    def at(self, ptr=None, device=None, strides=None) -> "_DeviceArray":
        """An array of this shape and dtype at another address (a fresh one by default), on this device and with these
        strides unless others are given."""
        return _DeviceArray(self.shape, self.dtype, self.strides if strides is None else strides,
                            next(self._addresses) if ptr is None else ptr,
                            self.data.device_id if device is None else device)


@pytest.fixture
def fake_cupy(no_gpu_kernels, monkeypatch):
    """CuPy replaced by the stand-in, every launch by a record of its struct: returns the list of the bytes each
    launch would pass, in order. tma's map encoding is replaced by bytes of the pointer and the layout."""
    fake = types.ModuleType("cupy")
    fake.ndarray = _DeviceArray
    fake.empty = lambda shape, dtype: _DeviceArray(shape, dtype)
    stream = types.SimpleNamespace(ptr=0x5151)
    fake.cuda = types.SimpleNamespace(Device=lambda index: contextlib.nullcontext(),
                                      get_current_stream=lambda: stream,
                                      runtime=types.SimpleNamespace(getDevice=lambda: 0))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(runtime, "require_gpu", lambda: None)
    monkeypatch.setattr(tma, "_encode", lambda ptr, *layout: struct.pack("<Q", ptr) + repr(layout).encode().ljust(
        120, b"\0")[:120])
    launches = []

    def call(self, stream, *pointers):
        launches.append(self.params(*pointers))

    def launch_head(self, stream, head):
        launches.append(head + self.params()[len(head):])

    monkeypatch.setattr(KernelCall, "__call__", call)
    monkeypatch.setattr(KernelCall, "launch_head", launch_head)
    _DeviceArray.allocated.clear()
    return launches


@pytest.fixture
def counted(monkeypatch) -> collections.Counter:
    """Calls of checks.check_backward, of backward.backward_call (the planning) and of checks.call_signature (the
    checks' memo's key and backward.launch's), counted."""
    counts = collections.Counter()

    def counting(module, name):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    counting(checks, "check_backward")
    counting(checks, "call_signature")
    counting(backward, "backward_call")
    return counts


def _inputs(b=2, sq=20, sk=40, h=4, hk=2, d=64, dtype=np.float16):
    """dout, q, k, v, out, lse of a backward call, each at its own address."""
    q, k = _DeviceArray((b, sq, h, d), dtype), _DeviceArray((b, sk, hk, d), dtype)
    return q.at(), q, k, k.at(), q.at(), _DeviceArray((b, h, sq), np.float32)


def _fresh(args):
    """The same layouts at new addresses."""
    return [x.at() for x in args]


def test_backward_second_call_skips_checks_and_planning(fake_cupy, counted):
    args = _inputs()
    grads = cuflash.attention_backward(*args, causal=True)
    first = dict(counted)  # call_signature: the checks' memo's
    assert first["check_backward"] == first["backward_call"] == 1 and first["call_signature"] >= 1
    assert len(fake_cupy) == 3  # preprocess, main, dQ conversion
    for _ in range(3):
        again = cuflash.attention_backward(*_fresh(args), causal=True)
    assert counted == first and len(fake_cupy) == 12
    assert fake_cupy[-3:] != fake_cupy[:3]  # other pointers
    assert [(g.shape, g.dtype, g.flags.c_contiguous) for g in again] == [
        (x.shape, x.dtype, True) for x in args[1:4]] and {g.data.ptr for g in again}.isdisjoint(
        g.data.ptr for g in grads)
    # the dropout generator is a per-call value, not part of the signature
    cuflash.attention_backward(*args, causal=True, dropout_p=0.25, dropout_seed=1, dropout_offset=2)
    cuflash.attention_backward(*args, causal=True, dropout_p=0.25, dropout_seed=3, dropout_offset=4)
    assert counted["check_backward"] == counted["backward_call"] == 2


def _alibi(*shape):
    return _DeviceArray(shape, np.float32)


# what changes -> a function of the kept call's (args, options) giving the changed call's
CHANGES = {
    "seqlen_q": lambda a, o: (list(_inputs(sq=24)), o),
    "seqlen_k": lambda a, o: (a[:2] + list(_inputs(sk=48)[2:4]) + a[4:], o),
    "q strides (a view of packed qkv)": lambda a, o: (
        [a[0], a[1].at(strides=(20 * 3 * 4 * 64 * 2, 3 * 4 * 64 * 2, 64 * 2, 2))] + a[2:], o),
    "dout strides": lambda a, o: ([a[0].at(strides=(20 * 8 * 64 * 2, 8 * 64 * 2, 64 * 2, 2))] + a[1:], o),
    "dtype": lambda a, o: (list(_inputs(dtype=ml_dtypes.bfloat16)), o),
    "device": lambda a, o: ([x.at(device=1) for x in a], dict(o, alibi_slopes=o["alibi_slopes"].at(device=1))),
    "softmax_scale": lambda a, o: (a, dict(o, softmax_scale=0.3)),
    "causal": lambda a, o: (a, dict(o, causal=False)),
    "window_size": lambda a, o: (a, dict(o, window_size=(8, 0))),
    "softcap": lambda a, o: (a, dict(o, softcap=5.0)),
    "alibi_slopes layout": lambda a, o: (a, dict(o, alibi_slopes=_alibi(2, 4))),
    "no alibi_slopes": lambda a, o: (a, dict(o, alibi_slopes=None)),
    "deterministic": lambda a, o: (a, dict(o, deterministic=True)),
    "dropout_p": lambda a, o: (a, dict(o, dropout_p=0.1)),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_backward_changed_signature_plans_anew(fake_cupy, counted, change):
    args, options = list(_inputs()), dict(causal=True, alibi_slopes=_alibi(4))
    cuflash.attention_backward(*args, **options)
    changed_args, changed_options = CHANGES[change](args, options)
    for _ in range(2):
        cuflash.attention_backward(*changed_args, **changed_options)
    assert counted["check_backward"] == counted["backward_call"] == 2  # the second changed call is kept too
    assert len(fake_cupy) == 9


class _HostOnDevice0(np.ndarray):
    """A NumPy array that says it is on device 0, as a CuPy array would: it passes the checks, not the type check."""

    device = types.SimpleNamespace(id=0)


def _error(call) -> tuple:
    """The type and message of what ``call()`` raises."""
    with pytest.raises(Exception) as info:
        call()
    return type(info.value), str(info.value)


# bad input -> (a function of a kept call's (args, options) giving the bad call's, what it raises)
BAD = {
    "misaligned dout": (lambda a, o: ([a[0].at(ptr=a[0].data.ptr + 8)] + a[1:], o),
                        r"dout: must be 16-byte aligned .*; data pointer 0x"),
    "misaligned v": (lambda a, o: (a[:3] + [a[3].at(ptr=a[3].data.ptr + 2)] + a[4:], o),
                     r"v: must be 16-byte aligned .*; data pointer 0x"),
    "q not a CuPy array": (lambda a, o: ([a[0], np.zeros(a[1].shape, a[1].dtype).view(_HostOnDevice0)] + a[2:], o),
                           r"q: expected a cupy\.ndarray, got [\w.]*_HostOnDevice0"),
    "k on another device": (lambda a, o: (a[:2] + [a[2].at(device=1)] + a[3:], o),
                            r"q and k are on different devices \(0 and 1\)"),
    "lse not contiguous": (lambda a, o: (a[:5] + [a[5].at(strides=(4 * 24 * 4, 24 * 4, 4))], o),
                           r"lse: must be contiguous \(batch, nheads, seqlen_q\); got strides \(96, 24, 1\)"),
    "window of floats": (lambda a, o: (a, dict(o, window_size=(3.0, -1))),
                         r"window_size: expected a pair of ints >= -1, got \(3\.0, -1\)"),
    "int causal": (lambda a, o: (a, dict(o, causal=1)), r"causal: expected a bool, got int 1"),
    "dropout_seed": (lambda a, o: (a, dict(o, dropout_seed=-1)), r"dropout_seed: expected 0 <= dropout_seed < 2\*\*64"),
    "dropout_offset": (lambda a, o: (a, dict(o, dropout_offset=1.0)),
                       r"dropout_offset: expected an int, got float 1\.0"),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_backward_bad_input_on_a_kept_signature_raises_before_any_launch(fake_cupy, bad):
    """Bad input like a kept call (its layouts, options equal to its options) raises what it raises uncached, and
    launches nothing: the pointers' alignment and the dropout generator are checked on every call; array types,
    devices, strides and the options' types are part of the signature."""
    args, options = list(_inputs()), dict(window_size=(3, -1), causal=True)
    make, expected = BAD[bad]
    bad_args, bad_options = make(args, options)
    uncached = _error(lambda: cuflash.attention_backward(*bad_args, **bad_options))
    cuflash.attention_backward(*args, **options)
    launched = len(fake_cupy)
    assert _error(lambda: cuflash.attention_backward(*bad_args, **bad_options)) == uncached
    assert len(fake_cupy) == launched
    assert uncached[0] in (TypeError, ValueError) and re.search(expected, uncached[1]), uncached


def test_forward_bad_input_on_a_kept_signature_raises_before_any_launch(fake_cupy):
    """cuflash.attention's kept calls: a misaligned pointer, and a window of floats equal to a kept one's ints."""
    q = _DeviceArray((2, 20, 4, 64), np.float16)
    k, v = q.at(), q.at()
    cuflash.attention(q, k, v, window_size=(3, -1))
    launched = len(fake_cupy)
    with pytest.raises(TypeError, match=r"window_size: expected a pair of ints >= -1, got \(3\.0, -1\)"):
        cuflash.attention(q, k, v, window_size=(3.0, -1))
    with pytest.raises(ValueError, match=r"k: must be 16-byte aligned .* data pointer 0x"):
        cuflash.attention(q, k.at(ptr=k.data.ptr + 8), v, window_size=(3, -1))
    assert len(fake_cupy) == launched


def _launch_options(**given) -> dict:
    return dict(dict(softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                     deterministic=False, dropout_p=0.0, dropout_seed=0, dropout_offset=0), **given)


OPTIONS = {
    "causal": dict(causal=True),
    "deterministic": dict(causal=True, deterministic=True),
    "score mod": dict(softcap=5.0, alibi_slopes=_alibi(2, 4), softmax_scale=0.2),
    "dropout window": dict(window_size=(8, 2), dropout_p=0.2, dropout_seed=5, dropout_offset=7),
}


@pytest.mark.parametrize("bwd_sm90", [False, True])
@pytest.mark.parametrize("options", list(OPTIONS))
def test_backward_kept_launch_passes_the_bytes_of_an_uncached_one(fake_cupy, configure, bwd_sm90, options):
    """The kept launches (planned on dq, dk, dv's contiguous layouts) pass, struct by struct, the bytes backward.launch
    passes when it plans on the arrays themselves, with the same pointers; on sm_90a's Hopper main kernel (bwd_sm90)
    and on the portable one."""
    configure(bwd_sm90=bwd_sm90)
    options = _launch_options(**OPTIONS[options])
    args = _inputs(sk=400)  # several key blocks: deterministic mode's slices
    cuflash.attention_backward(*args, **options)
    fake_cupy.clear()
    _DeviceArray.allocated.clear()
    dq, dk, dv = cuflash.attention_backward(*args, **options)
    kept = list(fake_cupy)
    workspace = _DeviceArray.allocated[3]
    assert (dq, dk, dv) == tuple(_DeviceArray.allocated[:3]) and workspace.dtype == np.uint8
    fake_cupy.clear()
    backward._launches.clear()
    problem = checks.check_backward(*args, **{n: options[n] for n in ("softmax_scale", "causal", "window_size",
                                                                       "softcap", "alibi_slopes", "dropout_p")})
    backward.launch(problem, *args, dq, dk, dv, workspace=workspace, **options)
    assert len(kept) == 3 and fake_cupy == kept  # preprocess, main, dQ conversion


@pytest.mark.parametrize("bwd_sm90", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_packed_backward_planned_on_layouts_passes_the_bytes_of_one_planned_on_arrays(
        fake_cupy, configure, bwd_sm90, deterministic):
    """Packed varlen: a BackwardCall planned on dq, dk, dv's contiguous layouts (as a kept call or cuflash.torch
    plans it) passes the bytes cuflash.attention_varlen_backward's launches pass, pointer for pointer (the workspace's
    lse and dsum are (nheads, total_q) there: the strides a packed plan has to get right)."""
    configure(bwd_sm90=bwd_sm90)
    total_q, total_k, h, hk, d = 37, 555, 4, 2, 64
    q, k = _DeviceArray((total_q, h, d), np.float16), _DeviceArray((total_k, hk, d), np.float16)
    v, dout, out = k.at(), q.at(), q.at()
    lse = _DeviceArray((h, total_q), np.float32)
    cu_q, cu_k = _DeviceArray((4,), np.int32), _DeviceArray((4,), np.int32)
    _DeviceArray.allocated.clear()
    dq, dk, dv = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 20, 400, causal=True,
                                                   deterministic=deterministic)
    from_arrays = list(fake_cupy)
    workspace = _DeviceArray.allocated[3]
    fake_cupy.clear()
    problem = checks.check_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, 20, 400, causal=True)
    grads = (checks.contiguous(n, x.shape, x.dtype) for n, x in (("dq", q), ("dk", k), ("dv", v)))
    call = backward.backward_call(problem, dout, q, k, v, out, lse, *grads, resolve(problem, causal=True), device_id=0,
                                  deterministic=deterministic, packed=True)
    call(0x5151, dout.data.ptr, q.data.ptr, k.data.ptr, v.data.ptr, out.data.ptr, lse.data.ptr, dq.data.ptr,
         dk.data.ptr, dv.data.ptr, 0, cu_q.data.ptr, cu_k.data.ptr, workspace.data.ptr)
    assert len(from_arrays) == 3 and fake_cupy == from_arrays
    main = np.frombuffer(from_arrays[1], backward.SM90_PARAMS_DTYPE if bwd_sm90 else backward.PARAMS_DTYPE)[0]
    assert (main["lse_batch_stride"], main["lse_head_stride"]) == (1, total_q)
