"""The CuPy API's calls kept per signature (``cuflash.attention``, ``attention_backward``, ``attention_varlen``,
``attention_varlen_backward``), without a GPU.

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
from cuflash.ops import backward, forward, forward_sm90
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
    """Calls of the checks (checks.check_backward, check_varlen, check_varlen_backward), of the planning
    (forward.forward_call, backward.backward_call) and of checks.call_signature (the checks' memo's key and
    forward.launch's and backward.launch's), counted."""
    counts = collections.Counter()

    def counting(module, name):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            counts[name] += 1
            return original(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    for name in ("check_backward", "check_varlen", "check_varlen_backward", "call_signature"):
        counting(checks, name)
    counting(forward, "forward_call")
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


CHECKED_OPTIONS = ("softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "dropout_p")  # checks take


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
    problem = checks.check_backward(*args, **{n: options[n] for n in CHECKED_OPTIONS})
    backward.launch(problem, *args, dq, dk, dv, workspace=workspace, **options)
    assert len(kept) == 3 and fake_cupy == kept  # preprocess, main, dQ conversion


# ---------------------------------------------------------------------------------------------------------------
# Varlen: cuflash.attention_varlen (forward.attention_varlen) and attention_varlen_backward
# (backward.attention_varlen_backward), kept per key like the dense calls
# ---------------------------------------------------------------------------------------------------------------

FORWARD_ONLY = ("block_table", "seqused_k", "return_lse")
BACKWARD_ONLY = ("dout", "out", "lse", "deterministic")
# kind of call -> the layout of its arguments (_varlen's): "paged forward" takes page pools, a block_table and
# seqused_k
KINDS = {"forward": {}, "paged forward": dict(pages=(40, 16, 10), seqused_k=True), "backward": {}}
CHECK = {"forward": "check_varlen", "backward": "check_varlen_backward"}
PLAN = {"forward": "forward_call", "backward": "backward_call"}
LAUNCHES = {"forward": 1, "backward": 3}  # the backward's: preprocess, main, dQ conversion


def _varlen(total_q=37, total_k=555, h=4, hk=2, d=64, batch=3, dtype=np.float16, pages=None,
            seqused_k=False) -> dict:
    """The arguments of a varlen call by name, each array at its own address: the forward takes all but
    BACKWARD_ONLY, the backward all but FORWARD_ONLY. ``pages`` (num_pages, page_size, max_pages): k and v are page
    pools, with a block_table; ``seqused_k``: key counts too."""
    q = _DeviceArray((total_q, h, d), dtype)
    k = _DeviceArray((total_k, hk, d) if pages is None else (pages[0], pages[1], hk, d), dtype)
    cu = _DeviceArray((batch + 1,), np.int32)
    return dict(dout=q.at(), q=q, k=k, v=k.at(), out=q.at(), lse=_DeviceArray((h, total_q), np.float32),
                cu_seqlens_q=cu, cu_seqlens_k=cu.at(), max_seqlen_q=20, max_seqlen_k=400,
                block_table=None if pages is None else _DeviceArray((batch, pages[2]), np.int32),
                seqused_k=_DeviceArray((batch,), np.int32) if seqused_k else None)


def _direction(kind: str) -> str:
    return kind.split()[-1]


def _run(kind: str, args: dict):
    """cuflash.attention_varlen (a forward kind) or attention_varlen_backward on `args`' arguments."""
    if _direction(kind) == "forward":
        return cuflash.attention_varlen(**{n: x for n, x in args.items() if n not in BACKWARD_ONLY})
    return cuflash.attention_varlen_backward(**{n: x for n, x in args.items() if n not in FORWARD_ONLY})


def _moved(args: dict) -> dict:
    """The same layouts at new addresses."""
    return {n: x.at() if isinstance(x, _DeviceArray) else x for n, x in args.items()}


@pytest.mark.parametrize("kind", list(KINDS))
def test_varlen_second_call_skips_checks_and_planning(fake_cupy, counted, kind):
    direction = _direction(kind)
    args = dict(_varlen(**KINDS[kind]), causal=True, return_lse=True)
    _run(kind, args)
    first = dict(counted)  # call_signature: the checks' memo's
    assert first[CHECK[direction]] == first[PLAN[direction]] == 1 and first["call_signature"] >= 1
    launches = LAUNCHES[direction]
    for _ in range(3):
        moved = _moved(args)
        again = _run(kind, moved)
    assert counted == first and len(fake_cupy) == 4 * launches
    assert fake_cupy[-launches:] != fake_cupy[:launches]  # other pointers
    if direction == "forward":
        out, lse = again
        assert (out.shape, out.dtype, out.flags.c_contiguous) == ((37, 4, 64), np.float16, True)
        assert (lse.shape, lse.dtype, lse.flags.c_contiguous) == ((4, 37), np.float32, True)
    else:
        assert [(g.shape, g.dtype, g.flags.c_contiguous) for g in again] == [
            (moved[n].shape, moved[n].dtype, True) for n in ("q", "k", "v")]
    # the dropout generator is a per-call value, not part of the key
    _run(kind, dict(args, dropout_p=0.25, dropout_seed=1, dropout_offset=2))
    _run(kind, dict(args, dropout_p=0.25, dropout_seed=3, dropout_offset=4))
    assert counted[CHECK[direction]] == counted[PLAN[direction]] == 2
    assert fake_cupy[-launches:] != fake_cupy[-2 * launches:-launches]


def _taking(args: dict, names: tuple, **layout) -> dict:
    """`args` with the arrays `names` taken from _varlen(**layout)."""
    other = _varlen(**layout)
    return dict(args, **{n: other[n] for n in names})


FORWARD, BACKWARD, BOTH = ("forward",), ("backward",), ("forward", "backward")
# what changes -> (the kinds of call it applies to, a function of a kept call's arguments giving the changed call's)
VARLEN_CHANGES = {
    "total_q": (BOTH, lambda a: _taking(a, ("dout", "q", "out", "lse"), total_q=41)),
    "total_k": (BOTH, lambda a: _taking(a, ("k", "v"), total_k=600)),
    "batch (cu_seqlens' length)": (BOTH, lambda a: _taking(a, ("cu_seqlens_q", "cu_seqlens_k"), batch=4)),
    "q strides (a view of packed qkv)": (BOTH, lambda a: dict(a, q=a["q"].at(strides=(3 * 4 * 64 * 2, 64 * 2, 2)))),
    "k strides": (BOTH, lambda a: dict(a, k=a["k"].at(strides=(3 * 2 * 64 * 2, 64 * 2, 2)))),
    "dout strides": (BACKWARD, lambda a: dict(a, dout=a["dout"].at(strides=(8 * 64 * 2, 64 * 2, 2)))),
    "dtype": (BOTH, lambda a: _taking(a, ("dout", "q", "k", "v", "out"), dtype=ml_dtypes.bfloat16)),
    "device": (BOTH, lambda a: {n: x.at(device=1) if isinstance(x, _DeviceArray) else x for n, x in a.items()}),
    "max_seqlen_q": (BOTH, lambda a: dict(a, max_seqlen_q=21)),
    "max_seqlen_k": (BOTH, lambda a: dict(a, max_seqlen_k=401)),
    "max_seqlen_k's type": (BOTH, lambda a: dict(a, max_seqlen_k=np.int64(400))),
    "softmax_scale": (BOTH, lambda a: dict(a, softmax_scale=0.3)),
    "causal": (BOTH, lambda a: dict(a, causal=False)),
    "window_size": (BOTH, lambda a: dict(a, window_size=(8, 0))),
    "softcap": (BOTH, lambda a: dict(a, softcap=5.0)),
    "alibi_slopes layout": (BOTH, lambda a: dict(a, alibi_slopes=_alibi(3, 4))),
    "no alibi_slopes": (BOTH, lambda a: dict(a, alibi_slopes=None)),
    "dropout_p": (BOTH, lambda a: dict(a, dropout_p=0.1)),
    "return_lse": (FORWARD, lambda a: dict(a, return_lse=True)),
    "paged keys": (FORWARD, lambda a: _taking(a, ("k", "v", "block_table"), pages=(40, 16, 10))),
    "page size": (FORWARD, lambda a: _taking(_taking(a, ("k", "v", "block_table"), pages=(40, 16, 10)), ("k", "v"),
                                             pages=(40, 32, 10))),
    "seqused_k": (FORWARD, lambda a: _taking(a, ("seqused_k",), seqused_k=True)),
    "deterministic": (BACKWARD, lambda a: dict(a, deterministic=True)),
}


@pytest.mark.parametrize("kind,change", [(kind, change) for change, (kinds, _) in VARLEN_CHANGES.items()
                                         for kind in kinds])
def test_varlen_changed_signature_plans_anew(fake_cupy, counted, kind, change):
    args = dict(_varlen(), causal=True, alibi_slopes=_alibi(4))
    changed = VARLEN_CHANGES[change][1](args)
    if change == "page size":  # against a kept paged call
        args = _taking(args, ("k", "v", "block_table"), pages=(40, 16, 10))
    _run(kind, args)
    for _ in range(2):
        _run(kind, changed)
    assert counted[CHECK[kind]] == counted[PLAN[kind]] == 2  # the second changed call is kept too
    assert len(fake_cupy) == 3 * LAUNCHES[kind]


def _on_host(x) -> _HostOnDevice0:
    return np.zeros(x.shape, x.dtype).view(_HostOnDevice0)


def _misaligned(name: str, by: int = 8):
    return lambda a: dict(a, **{name: a[name].at(ptr=a[name].data.ptr + by)})


ALL_KINDS, PAGED = tuple(KINDS), ("paged forward",)
# bad input -> (the kinds of call it applies to, a function of a kept call's arguments giving the bad call's, what it
# raises)
VARLEN_BAD = {
    "misaligned q": (ALL_KINDS, _misaligned("q"), r"q: must be 16-byte aligned .*; data pointer 0x"),
    "misaligned v": (ALL_KINDS, _misaligned("v", 2), r"v: must be 16-byte aligned .*; data pointer 0x"),
    "misaligned dout": (BACKWARD, _misaligned("dout"), r"dout: must be 16-byte aligned .*; data pointer 0x"),
    "misaligned out": (BACKWARD, _misaligned("out"), r"out: must be 16-byte aligned .*; data pointer 0x"),
    "q not a CuPy array": (ALL_KINDS, lambda a: dict(a, q=_on_host(a["q"])),
                           r"q: expected a cupy\.ndarray, got [\w.]*_HostOnDevice0"),
    "cu_seqlens_k not a CuPy array": (ALL_KINDS, lambda a: dict(a, cu_seqlens_k=_on_host(a["cu_seqlens_k"])),
                                      r"cu_seqlens_k: expected a cupy\.ndarray, got [\w.]*_HostOnDevice0"),
    "block_table not a CuPy array": (PAGED, lambda a: dict(a, block_table=_on_host(a["block_table"])),
                                     r"block_table: expected a cupy\.ndarray of int32, got [\w.]*_HostOnDevice0"),
    "seqused_k not a CuPy array": (PAGED, lambda a: dict(a, seqused_k=_on_host(a["seqused_k"])),
                                   r"seqused_k: expected a cupy\.ndarray of int32, got [\w.]*_HostOnDevice0"),
    "k on another device": (ALL_KINDS, lambda a: dict(a, k=a["k"].at(device=1)),
                            r"q and k are on different devices \(0 and 1\)"),
    "cu_seqlens_q on another device": (ALL_KINDS, lambda a: dict(a, cu_seqlens_q=a["cu_seqlens_q"].at(device=1)),
                                       r"q and cu_seqlens_q are on different devices \(0 and 1\)"),
    "block_table on another device": (PAGED, lambda a: dict(a, block_table=a["block_table"].at(device=1)),
                                      r"q and block_table are on different devices \(0 and 1\)"),
    "cu_seqlens_q of int64": (ALL_KINDS, lambda a: dict(a, cu_seqlens_q=_DeviceArray((4,), np.int64)),
                              r"cu_seqlens_q: dtype int64 is not supported; expected int32"),
    "lse not contiguous": (BACKWARD, lambda a: dict(a, lse=a["lse"].at(strides=(40 * 4, 4))),
                           r"lse: must be contiguous \(nheads, total_q\); got strides \(40, 1\)"),
    "window of floats": (ALL_KINDS, lambda a: dict(a, window_size=(3.0, -1)),
                         r"window_size: expected a pair of ints >= -1, got \(3\.0, -1\)"),
    "int causal": (ALL_KINDS, lambda a: dict(a, causal=1), r"causal: expected a bool, got int 1"),
    "max_seqlen_q of a float": (ALL_KINDS, lambda a: dict(a, max_seqlen_q=20.0),
                                r"max_seqlen_q: expected a positive int, got float 20\.0"),
    "dropout_seed": (ALL_KINDS, lambda a: dict(a, dropout_seed=-1),
                     r"dropout_seed: expected 0 <= dropout_seed < 2\*\*64"),
    "dropout_offset": (ALL_KINDS, lambda a: dict(a, dropout_offset=1.0),
                       r"dropout_offset: expected an int, got float 1\.0"),
}


@pytest.mark.parametrize("kind,bad", [(kind, bad) for bad, (kinds, *_) in VARLEN_BAD.items() for kind in kinds])
def test_varlen_bad_input_on_a_kept_signature_raises_before_any_launch(fake_cupy, kind, bad):
    """Bad input like a kept varlen call raises what it raises uncached, and launches nothing (as
    test_backward_bad_input_on_a_kept_signature_raises_before_any_launch)."""
    args = dict(_varlen(**KINDS[kind]), window_size=(3, -1), causal=True)
    _, make, expected = VARLEN_BAD[bad]
    bad_args = make(args)
    uncached = _error(lambda: _run(kind, bad_args))
    _run(kind, args)
    launched = len(fake_cupy)
    assert _error(lambda: _run(kind, bad_args)) == uncached
    assert len(fake_cupy) == launched
    assert uncached[0] in (TypeError, ValueError) and re.search(expected, uncached[1]), uncached


# case -> (the layout (_varlen's) and options of a call, whether sm_90a's Hopper forward runs it when the sm90
# setting is on)
VARLEN_FORWARD = {
    "causal": (dict(causal=True, return_lse=True), True),
    "score mod": (dict(softcap=5.0, alibi_slopes=_alibi(3, 4), softmax_scale=0.2), True),
    "dropout window": (dict(window_size=(8, 2), dropout_p=0.2, dropout_seed=5, dropout_offset=7, return_lse=True),
                       True),
    "seqused_k": (dict(seqused_k=True, causal=True, return_lse=True), False),
    "paged": (dict(pages=(40, 16, 10), causal=True, return_lse=True), True),
    "paged seqused_k": (dict(pages=(12, 48, 9), seqused_k=True, alibi_slopes=_alibi(4)), True),
    "paged dropout": (dict(pages=(40, 16, 10), seqused_k=True, dropout_p=0.1, dropout_seed=9, dropout_offset=1,
                           return_lse=True), False),
}


@pytest.mark.parametrize("sm90", [False, True])
@pytest.mark.parametrize("case", list(VARLEN_FORWARD))
def test_varlen_forward_kept_launch_passes_the_bytes_of_an_uncached_one(fake_cupy, configure, sm90, case):
    """A kept attention_varlen launch (planned on out's and lse's contiguous layouts) passes the bytes forward.launch
    passes when it plans on the arrays themselves, with the same pointers (cu_seqlens, block_table and seqused_k
    too); on the portable kernel and, with the sm90 setting, on the Hopper kernel where the planner takes it."""
    configure(sm90=sm90)
    given, hopper = VARLEN_FORWARD[case]
    layout = {n: x for n, x in given.items() if n in ("pages", "seqused_k")}
    options = {n: x for n, x in given.items() if n not in layout}
    args = dict(_varlen(**layout), **options)
    _run("forward", args)
    fake_cupy.clear()
    _DeviceArray.allocated.clear()
    result = _run("forward", args)
    kept = list(fake_cupy)
    out, lse = result if options.get("return_lse") else (result, None)
    assert _DeviceArray.allocated == [x for x in (out, lse) if x is not None]
    assert out.shape == (37, 4, 64) and (lse is None or lse.shape == (4, 37))  # lse packed: (nheads, total_q)
    (call, *_), = forward._varlen_calls.values()
    assert isinstance(call, forward_sm90.ForwardCall) == (sm90 and hopper)
    if sm90 and hopper:  # the head: the maps of q, k, v and out (the fake encoder writes the pointer first), in order
        maps = [struct.unpack_from("<Q", kept[0], 128 * i)[0] for i in range(4)]
        assert maps == [x.data.ptr for x in (args["q"], args["k"], args["v"], out)]
    fake_cupy.clear()
    forward._launches.clear()
    options = {n: x for n, x in _launch_options(**options).items() if n not in ("deterministic", "return_lse")}
    indices = {n: args[n] for n in ("cu_seqlens_q", "cu_seqlens_k", "block_table", "seqused_k")}
    problem = checks.check_varlen(*(args[n] for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                                                      "max_seqlen_k")),
                                  block_table=args["block_table"], seqused_k=args["seqused_k"],
                                  **{n: options[n] for n in CHECKED_OPTIONS})
    forward.launch(problem, args["q"], args["k"], args["v"], out, lse, **indices, **options)
    assert len(kept) == 1 and fake_cupy == kept


@pytest.mark.parametrize("bwd_sm90", [False, True])
@pytest.mark.parametrize("options", list(OPTIONS))
def test_varlen_backward_kept_launch_passes_the_bytes_of_an_uncached_one(fake_cupy, configure, bwd_sm90, options):
    """A kept attention_varlen_backward launch (planned packed, on dq, dk, dv's contiguous layouts) passes, struct by
    struct, the bytes backward.launch passes when it plans on the arrays themselves, with the same pointers: the
    workspace's lse and dsum are (nheads, total_q), one row per query token (the strides a packed plan has to get
    right); on sm_90a's Hopper main kernel (bwd_sm90) and on the portable one."""
    configure(bwd_sm90=bwd_sm90)
    options = _launch_options(**OPTIONS[options])
    args = dict(_varlen(batch=2), **options)  # 555 keys: deterministic mode's slices
    _run("backward", args)
    fake_cupy.clear()
    _DeviceArray.allocated.clear()
    dq, dk, dv = _run("backward", args)
    kept = list(fake_cupy)
    workspace = _DeviceArray.allocated[3]
    assert (dq, dk, dv) == tuple(_DeviceArray.allocated[:3]) and workspace.dtype == np.uint8
    fake_cupy.clear()
    backward._launches.clear()
    arrays = [args[n] for n in ("dout", "q", "k", "v", "out", "lse")]
    indices = {n: args[n] for n in ("cu_seqlens_q", "cu_seqlens_k")}
    problem = checks.check_varlen_backward(*arrays, *indices.values(), 20, 400,
                                           **{n: options[n] for n in CHECKED_OPTIONS})
    backward.launch(problem, *arrays, dq, dk, dv, workspace=workspace, **indices, **options)
    assert len(kept) == 3 and fake_cupy == kept  # preprocess, main, dQ conversion
    pre = np.frombuffer(kept[0], backward.PRE_PARAMS_DTYPE)[0]
    sm90 = len(kept[1]) == backward.SM90_PARAMS_DTYPE.itemsize
    main = np.frombuffer(kept[1], backward.SM90_PARAMS_DTYPE if sm90 else backward.PARAMS_DTYPE)[0]
    assert sm90 == bwd_sm90
    assert (pre["batch"], pre["seqlen_q"], main["lse_batch_stride"], main["lse_head_stride"]) == (1, 37, 1, 37)
