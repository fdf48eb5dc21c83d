"""cuflash.torch without a GPU: the torch.library ops, their fake implementations, autograd and torch.compile.

CPU tensors stand in for CUDA ones: the launcher is swapped for cuflash.reference on host memory, and the
device check is relaxed. Everything between the public function and the launch runs as on a GPU.
"""
import ctypes
import math
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cuflash.torch  # noqa: E402
from cuflash import reference  # noqa: E402
from cuflash.ops import backward as backward_op, forward as forward_op  # noqa: E402


def _host(t):
    if t is None:
        return None
    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _generator_words(options: dict, seed: int, offset: int, state: int) -> dict:
    """The dropout generator a launch was given, as the reference takes it: its seed and offset, or the two int64
    at ``state`` (a host tensor's memory here, where the kernels read device memory)."""
    if "dropout_p" not in options:
        return {}
    if state:
        seed, offset = (ctypes.c_int64 * 2).from_address(state)
    return dict(dropout_seed=seed, dropout_offset=offset)


@pytest.fixture
def on_host(monkeypatch):
    """Launch into torch-allocated CPU tensors with the float64 reference; count launches."""
    calls = []

    def forward(problem, q, k, v, out, lse, *, alibi_slopes, cu_seqlens_q=None, cu_seqlens_k=None, block_table=None,
                seqused_k=None, **options):
        paged = {} if block_table is None and seqused_k is None else dict(block_table=block_table, seqused_k=seqused_k)
        calls.append(("fwd", dict(options, **paged)))
        q, k, v = (x.astype(np.float64) for x in (q, k, v))
        if cu_seqlens_q is None:
            o, l = reference.attention(q, k, v, alibi_slopes=alibi_slopes, return_lse=True, **options)
        else:
            o, l = reference.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, problem.seqlen_q,
                                              problem.seqlen_k, alibi_slopes=alibi_slopes, return_lse=True,
                                              block_table=block_table, seqused_k=seqused_k, **options)
        out[...], lse[...] = o.astype(out.dtype), l

    def backward(problem, dout, q, k, v, out, lse, dq, dk, dv, *, alibi_slopes, deterministic, cu_seqlens_q=None,
                 cu_seqlens_k=None, **options):
        calls.append(("bwd", dict(options, deterministic=deterministic)))
        arrays = (x.astype(np.float64) for x in (dout, q, k, v, out))
        if cu_seqlens_q is None:
            grads = reference.attention_backward(*arrays, lse, alibi_slopes=alibi_slopes, **options)
        else:
            grads = reference.attention_varlen_backward(*arrays, lse, cu_seqlens_q, cu_seqlens_k, problem.seqlen_q,
                                                        problem.seqlen_k, alibi_slopes=alibi_slopes, **options)
        for dst, g in zip((dq, dk, dv), grads):
            dst[...] = g.astype(dst.dtype)

    def kvcache(q, k_cache, v_cache, *, return_lse, **options):
        calls.append(("kvcache", options))
        out, lse = reference.attention_with_kvcache(q, k_cache, v_cache, return_lse=True, **options)
        out = out.astype(q.dtype)
        return (out, lse.astype(np.float32)) if return_lse else out

    def forward_launch(problem, specs, options, lse_shape):  # the ops launch by pointer: same reference underneath
        def launch(q, k, v, out, lse, alibi_slopes, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k,
                   dropout_seed, dropout_offset, dropout_state):
            lse = torch.empty(lse_shape) if lse is None else lse
            generator = _generator_words(options, dropout_seed, dropout_offset, dropout_state)
            forward(problem, *map(_host, (q, k, v, out, lse)), alibi_slopes=_host(alibi_slopes),
                    cu_seqlens_q=_host(cu_seqlens_q), cu_seqlens_k=_host(cu_seqlens_k),
                    block_table=_host(block_table), seqused_k=_host(seqused_k), **options, **generator)
        return launch

    def backward_launch(problem, specs, options, deterministic, packed):
        def launch(dout, q, k, v, out, lse, dq, dk, dv, alibi_slopes, cu_seqlens_q, cu_seqlens_k, workspace,
                   dropout_seed=0, dropout_offset=0, dropout_state=0):
            generator = _generator_words(options, dropout_seed, dropout_offset, dropout_state)
            backward(problem, *map(_host, (dout, q, k, v, out, lse, dq, dk, dv)), alibi_slopes=_host(alibi_slopes),
                     deterministic=deterministic, cu_seqlens_q=_host(cu_seqlens_q), cu_seqlens_k=_host(cu_seqlens_k),
                     **options, **generator)
        return launch, 0

    monkeypatch.setattr(forward_op, "launch", forward)
    monkeypatch.setattr(backward_op, "launch", backward)
    monkeypatch.setattr(cuflash.torch, "_forward_launch", forward_launch)
    monkeypatch.setattr(cuflash.torch, "_backward_launch", backward_launch)
    def kvcache_torch(q, k_cache, v_cache, k, v, cache_seqlens, cache_batch_idx, block_table, alibi_slopes,
                      softmax_scale, causal, window_size, softcap, num_splits, return_lse, rotary_cos=None,
                      rotary_sin=None, rotary_interleaved=True, cache_leftpad=None, k_descale=None,
                      v_descale=None):  # the launch seam (16-bit caches: no descales)
        assert k_descale is None and v_descale is None
        options = dict(k=k, v=v, cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
                       block_table=block_table, alibi_slopes=alibi_slopes, softmax_scale=softmax_scale, causal=causal,
                       window_size=window_size, softcap=softcap, num_splits=num_splits, rotary_cos=rotary_cos,
                       rotary_sin=rotary_sin, rotary_interleaved=rotary_interleaved, cache_leftpad=cache_leftpad)
        host = {n: _host(x) if isinstance(x, torch.Tensor) else x for n, x in options.items()}
        result = kvcache(_host(q), _host(k_cache), _host(v_cache), return_lse=return_lse, **host)
        return (_tensor(result[0]), _tensor(result[1])) if return_lse else (_tensor(result), None)

    monkeypatch.setattr(cuflash.torch, "_kvcache_compute", kvcache_torch)
    monkeypatch.setattr(cuflash.torch, "_view", _host)
    monkeypatch.setattr(cuflash.torch, "_require_cuda", lambda **tensors: None)
    monkeypatch.setattr(cuflash.torch, "_require_aligned", lambda **tensors: None)
    monkeypatch.setattr(cuflash.torch, "_plans", {})
    return calls


def _tensor(x):
    import ml_dtypes
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x))


def _qkv(dtype=torch.float16, b=2, sq=17, sk=29, h=4, hk=2, d=32, requires_grad=True):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, sq, h, d, generator=g).to(dtype)
    k = torch.randn(b, sk, hk, d, generator=g).to(dtype)
    v = torch.randn(b, sk, hk, d, generator=g).to(dtype)
    return tuple(x.requires_grad_(requires_grad) for x in (q, k, v))


def _math(q, k, v, causal):
    """float32 SDPA math with an explicit bottom-right causal mask, in (b, s, h, d)."""
    qf, kf, vf = (x.detach().float().transpose(1, 2).requires_grad_() for x in (q, k, v))
    sq, sk, g = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    mask = None
    if causal:
        mask = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + sk - sq
    out = torch.nn.functional.scaled_dot_product_attention(
        qf, kf.repeat_interleave(g, 1), vf.repeat_interleave(g, 1), attn_mask=mask)
    return out.transpose(1, 2), (qf, kf, vf)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_autograd_through_the_ops_matches_float32_math(on_host, dtype):
    q, k, v = _qkv(getattr(torch, dtype))
    out, lse = cuflash.torch.attention(q, k, v, causal=True, return_lse=True, deterministic=True)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == (2, 4, 17)
    assert not lse.requires_grad
    dout = torch.randn_like(out)
    out.backward(dout)
    ref, (qf, kf, vf) = _math(q, k, v, True)
    ref.backward(dout.float())
    tol = 3e-2 if dtype == "bfloat16" else 4e-3
    assert (out.float() - ref).abs().max().item() < tol
    for got, want in ((q.grad, qf.grad), (k.grad, kf.grad), (v.grad, vf.grad)):
        assert got.dtype == q.dtype
        assert (got.float() - want.transpose(1, 2)).abs().max().item() < 4 * tol
    assert [c[0] for c in on_host] == ["fwd", "bwd"] and on_host[1][1]["deterministic"] is True


def test_options_reach_the_launcher(on_host):
    q, k, v = _qkv(requires_grad=False)
    cuflash.torch.attention(q, k, v, softmax_scale=0.3, window_size=(4, 2), softcap=2.0)
    assert on_host[0][1] == dict(softmax_scale=0.3, causal=False, window_size=(4, 2), softcap=2.0)


def test_opcheck(on_host):
    q, k, v = _qkv()
    state = torch.tensor([5, 8], dtype=torch.int64)
    for dropout in ((None, 0.0), (state, 0.25)):
        args = (q, k, v, None, dropout[0], None, True, -1, -1, 0.0, False, dropout[1])
        torch.library.opcheck(torch.ops.cuflash.attention_fwd.default, args,
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
        out, lse = torch.ops.cuflash.attention_fwd(*args)
        bwd_args = (torch.randn_like(out), q, k, v, out.detach(), lse, None, *args[4:])
        torch.library.opcheck(torch.ops.cuflash.attention_bwd.default, bwd_args,
                              test_utils=("test_schema", "test_faketensor"))


_cuda_build = pytest.mark.skipif(not torch.backends.cuda.is_built(),
                                 reason="fake CUDA tensors need a CUDA build of torch (this one is CPU-only)")


@_cuda_build
def test_fake_tensors_give_shapes_and_run_the_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(2, 5, 8, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 9, 2, 64, dtype=torch.bfloat16, device="cuda")
        out, lse = torch.ops.cuflash.attention_fwd(q, k, k, None, None, None, False, -1, -1, 0.0, False, 0.0)
        assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, 8, 5)
        assert lse.dtype == torch.float32 and out.device.type == "cuda"
        dq, dk, dv = torch.ops.cuflash.attention_bwd(out, q, k, k, out, lse, None, None, None, False, -1, -1, 0.0,
                                                     False, 0.0)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.dtype == k.dtype
        with pytest.raises(ValueError, match=r"k: head dim \(axis 3\) is 32 but q's is 64"):
            torch.ops.cuflash.attention_fwd(q, k[..., :32], k[..., :32], None, None, None, False, -1, -1, 0.0,
                                            False, 0.0)


def test_torch_compile_has_no_graph_break(on_host):
    q, k, v = _qkv(requires_grad=False)

    def f(q, k, v):
        return cuflash.torch.attention(q * 2, k, v, causal=True).float().sum()

    explain = torch._dynamo.explain(f)(q, k, v)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    qg = q.clone().requires_grad_()
    compiled(qg, k, v).backward()
    assert qg.grad is not None and qg.grad.shape == q.shape
    assert [c[0] for c in on_host][-2:] == ["fwd", "bwd"]


def test_errors_name_the_tensor(monkeypatch):
    monkeypatch.setattr(cuflash.torch, "_plans", {})
    q, k, v = _qkv(requires_grad=False)
    with pytest.raises(ValueError, match="q: expected a CUDA tensor, got one on cpu"):
        cuflash.torch.attention(q, k, v)
    with pytest.raises(TypeError, match=r"q: dtype torch.float32 is not supported|q: dtype float32 is not supported"):
        cuflash.torch.attention(q.float(), k, v)
    with pytest.raises(TypeError, match=r"k: dtype torch.complex64 is not supported; expected torch.float16"):
        cuflash.torch.attention(q, k.to(torch.complex64), v)
    with pytest.raises(ValueError, match=r"v: last dimension \(axis 3\) must be contiguous"):
        cuflash.torch.attention(q, k, v.transpose(1, 3).contiguous().transpose(1, 3))
    with pytest.raises(TypeError, match=r"window_size: expected a pair of ints"):
        cuflash.torch.attention(q, k, v, window_size=5)


# --------------------------------------------------------------------------------------------
# The eager fast path and the op path run the same implementation
# --------------------------------------------------------------------------------------------

def test_eager_calls_skip_the_dispatcher_and_match_the_op(on_host):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    q, k, v = _qkv()
    out = cuflash.torch.attention(q, k, v, causal=True)
    out.backward(torch.ones_like(out))
    eager = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    with Seen() as seen:  # a dispatch mode is active: the call goes through the ops, which the mode sees
        traced = cuflash.torch.attention(q, k, v, causal=True)
        traced.backward(torch.ones_like(traced))
    assert "cuflash.attention_fwd.default" in seen.ops and "cuflash.attention_bwd.default" in seen.ops
    assert torch.equal(out, traced)
    assert all(torch.equal(a, x.grad) for a, x in zip(eager, (q, k, v)))
    assert [c[0] for c in on_host] == ["fwd", "bwd", "fwd", "bwd"]


def test_eager_backward_is_once_differentiable(on_host):
    q, k, v = _qkv()
    out = cuflash.torch.attention(q, k, v)
    (dq,) = torch.autograd.grad(out, q, torch.ones_like(out).requires_grad_(), create_graph=True)
    with pytest.raises(RuntimeError, match="marked with @once_differentiable"):
        dq.float().sum().backward()


# --------------------------------------------------------------------------------------------
# attention_varlen
# --------------------------------------------------------------------------------------------

LENS_Q, LENS_K = (5, 1, 12), (9, 3, 12)  # per sequence; the middle one has more keys than queries


def _packed(dtype=torch.float16, h=4, hk=2, d=32, requires_grad=True):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(sum(LENS_Q), h, d, generator=g).to(dtype)
    k = torch.randn(sum(LENS_K), hk, d, generator=g).to(dtype)
    v = torch.randn(sum(LENS_K), hk, d, generator=g).to(dtype)
    cu_q, cu_k = (torch.tensor(np.cumsum((0,) + lens), dtype=torch.int32) for lens in (LENS_Q, LENS_K))
    return tuple(x.requires_grad_(requires_grad) for x in (q, k, v)) + (cu_q, cu_k)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_varlen_autograd_matches_float32_math_per_sequence(on_host, dtype):
    q, k, v, cu_q, cu_k = _packed(getattr(torch, dtype))
    out, lse = cuflash.torch.attention_varlen(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=True,
                                              return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (4, sum(LENS_Q)) and not lse.requires_grad
    dout = torch.randn_like(out)
    out.backward(dout)
    tol = 3e-2 if dtype == "bfloat16" else 4e-3
    for b in range(len(LENS_Q)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        ref, (qf, kf, vf) = _math(q[None, sq], k[None, sk], v[None, sk], True)
        ref.backward(dout[None, sq].float())
        assert (out[sq].float() - ref[0]).abs().max().item() < tol
        for got, want in ((q.grad[sq], qf.grad), (k.grad[sk], kf.grad), (v.grad[sk], vf.grad)):
            assert (got.float() - want.transpose(1, 2)[0]).abs().max().item() < 4 * tol
    assert [c[0] for c in on_host] == ["fwd", "bwd"]


def test_varlen_opcheck(on_host):
    q, k, v, cu_q, cu_k = _packed()
    state = torch.tensor([5, 8], dtype=torch.int64)
    for dropout in ((None, 0.0), (state, 0.25)):
        args = (q, k, v, cu_q, cu_k, None, dropout[0], max(LENS_Q), max(LENS_K), None, True, -1, -1, 0.0, False,
                dropout[1])
        torch.library.opcheck(torch.ops.cuflash.attention_varlen_fwd.default, args,
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
        out, lse = torch.ops.cuflash.attention_varlen_fwd(*args)
        bwd_args = (torch.randn_like(out), *(x.detach() for x in (q, k, v)), out.detach(), lse, *args[3:])
        torch.library.opcheck(torch.ops.cuflash.attention_varlen_bwd.default, bwd_args,
                              test_utils=("test_schema", "test_faketensor"))


def test_varlen_fake_tensors_give_shapes_and_run_the_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(40, 8, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(50, 2, 64, dtype=torch.bfloat16, device="cuda")
        cu = torch.empty(4, dtype=torch.int32, device="cuda")
        out, lse = torch.ops.cuflash.attention_varlen_fwd(q, k, k, cu, cu, None, None, 20, 30, None, False, -1, -1,
                                                          0.0, False, 0.0)
        assert out.shape == q.shape and lse.shape == (8, 40) and lse.dtype == torch.float32
        dq, dk, dv = torch.ops.cuflash.attention_varlen_bwd(out, q, k, k, out, lse, cu, cu, None, None, 20, 30,
                                                            None, False, -1, -1, 0.0, False, 0.0)
        assert dq.shape == q.shape and dk.shape == k.shape
        with pytest.raises(TypeError, match="cu_seqlens_k: dtype int64 is not supported; expected int32"):
            torch.ops.cuflash.attention_varlen_fwd(q, k, k, cu, cu.long(), None, None, 20, 30, None, False, -1, -1,
                                                   0.0, False, 0.0)


def test_varlen_torch_compile_has_no_graph_break(on_host):
    q, k, v, cu_q, cu_k = _packed(requires_grad=False)

    def f(q, k, v):
        return cuflash.torch.attention_varlen(q * 2, k, v, cu_q, cu_k, 12, 12, causal=True).float().sum()

    explain = torch._dynamo.explain(f)(q, k, v)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    torch._dynamo.reset()
    qg = q.clone().requires_grad_()
    torch.compile(f, backend="aot_eager", fullgraph=True)(qg, k, v).backward()
    assert qg.grad is not None and qg.grad.shape == q.shape
    assert [c[0] for c in on_host][-2:] == ["fwd", "bwd"]


def test_varlen_errors_name_the_tensor(monkeypatch):
    monkeypatch.setattr(cuflash.torch, "_plans", {})
    q, k, v, cu_q, cu_k = _packed(requires_grad=False)
    with pytest.raises(TypeError, match="cu_seqlens_q: dtype torch.bool is not supported; expected torch.int32"):
        cuflash.torch.attention_varlen(q, k, v, cu_q.bool(), cu_k, 12, 12)
    with pytest.raises(ValueError, match="max_seqlen_k: expected a positive int, got 0"):
        cuflash.torch.attention_varlen(q, k, v, cu_q, cu_k, 12, 0)
    with pytest.raises(ValueError, match="q: expected a CUDA tensor, got one on cpu"):
        cuflash.torch.attention_varlen(q, k, v, cu_q, cu_k, 12, 12)


# --------------------------------------------------------------------------------------------
# attention_with_kvcache
# --------------------------------------------------------------------------------------------

def _decode(dtype=torch.float16, b=3, sq=1, s_new=2, max_len=40, h=4, hk=2, d=32):
    g = torch.Generator().manual_seed(2)
    q = torch.randn(b, sq, h, d, generator=g).to(dtype)
    k_cache = torch.randn(b, max_len, hk, d, generator=g).to(dtype)
    v_cache = torch.randn(b, max_len, hk, d, generator=g).to(dtype)
    k = torch.randn(b, s_new, hk, d, generator=g).to(dtype)
    v = torch.randn(b, s_new, hk, d, generator=g).to(dtype)
    return q, k_cache, v_cache, k, v


@pytest.mark.parametrize("seqlens", ["int", "tensor"])
def test_kvcache_appends_in_place_and_matches_the_reference(on_host, seqlens):
    q, k_cache, v_cache, k, v = _decode()
    lens = 7 if seqlens == "int" else torch.tensor([3, 0, 20], dtype=torch.int32)
    want_k, want_v = k_cache.numpy().copy(), v_cache.numpy().copy()
    want, want_lse = reference.attention_with_kvcache(q.numpy(), want_k, want_v, k=k.numpy(), v=v.numpy(),
                                                      cache_seqlens=_host(lens) if seqlens == "tensor" else lens,
                                                      causal=True, return_lse=True)
    version = k_cache._version
    out, lse = cuflash.torch.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens, causal=True,
                                                    return_lse=True)
    assert k_cache._version > version  # autograd knows the cache was written
    assert np.array_equal(k_cache.numpy(), want_k) and np.array_equal(v_cache.numpy(), want_v)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (3, 4, 1) and lse.dtype == torch.float32
    assert np.abs(out.numpy() - want).max() < 4e-3 and np.abs(lse.numpy() - want_lse).max() < 1e-5
    assert on_host[0][1]["cache_seqlens"] is lens if seqlens == "int" else on_host[0][1]["cache_seqlens"] is not None


def test_kvcache_paged_and_options_reach_the_call(on_host):
    q, _, _, k, v = _decode(b=2)
    pool_k, pool_v = torch.randn(6, 16, 2, 32).half(), torch.randn(6, 16, 2, 32).half()
    table = torch.tensor([[5, 0, 3], [1, 4, 2]], dtype=torch.int32)
    slopes = torch.tensor([0.1, 0.2, 0.3, 0.4])
    out = cuflash.torch.attention_with_kvcache(q, pool_k, pool_v, k=k, v=v, cache_seqlens=20, block_table=table,
                                               softmax_scale=0.2, window_size=(8, 0), softcap=3.0,
                                               alibi_slopes=slopes, num_splits=3)
    assert out.shape == q.shape
    options = on_host[0][1]
    assert options["block_table"] is not None and options["num_splits"] == 3 and options["cache_seqlens"] == 20
    assert options["softmax_scale"] == 0.2 and options["window_size"] == (8, 0) and options["softcap"] == 3.0
    assert options["alibi_slopes"] is not None and options["cache_batch_idx"] is None
    assert torch.equal(pool_k[0, 4:6], k[0])  # logical positions 20, 21 of row 0: page table[0, 1] = 0, rows 4, 5


@pytest.mark.parametrize("interleaved", [True, False])
def test_kvcache_rotary_and_leftpad_match_the_reference(on_host, interleaved):
    q, k_cache, v_cache, k, v = _decode()
    lens = torch.tensor([3, 0, 20], dtype=torch.int32)
    pads = torch.tensor([1, 0, 5], dtype=torch.int32)
    angle = torch.rand(64, 8, generator=torch.Generator().manual_seed(3)) * 6.28
    cos, sin = angle.cos().half(), angle.sin().half()
    want_k, want_v = k_cache.numpy().copy(), v_cache.numpy().copy()
    want = reference.attention_with_kvcache(q.numpy(), want_k, want_v, k=k.numpy(), v=v.numpy(),
                                            cache_seqlens=lens.numpy(), causal=True, rotary_cos=cos.numpy(),
                                            rotary_sin=sin.numpy(), rotary_interleaved=interleaved,
                                            cache_leftpad=pads.numpy())
    out = cuflash.torch.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens, causal=True,
                                               rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved,
                                               cache_leftpad=pads)
    assert np.array_equal(k_cache.numpy(), want_k) and np.array_equal(v_cache.numpy(), want_v)
    assert np.abs(out.numpy() - want).max() < 4e-3
    assert on_host[0][1]["rotary_interleaved"] is interleaved and on_host[0][1]["cache_leftpad"] is not None


def test_kvcache_opcheck(on_host):
    q, k_cache, v_cache, k, v = _decode()
    lens = torch.tensor([3, 0, 20], dtype=torch.int32)
    cos, sin = torch.rand(64, 8).half(), torch.rand(64, 8).half()
    pads = torch.tensor([1, 0, 2], dtype=torch.int32)
    for args in ((q, k_cache, v_cache, k, v, lens, -1, None, None, None, None, True, -1, -1, 0.0, 0, True, None, None,
                  True, None),
                 (q, k_cache, v_cache, None, None, None, 5, None, None, None, 0.3, False, -1, -1, 0.0, 1, False, None,
                  None, True, None),
                 (q, k_cache, v_cache, k, v, lens, -1, None, None, None, None, True, -1, -1, 0.0, 0, False, cos, sin,
                  False, pads)):
        torch.library.opcheck(torch.ops.cuflash.attention_with_kvcache.default, args,
                              test_utils=("test_schema", "test_faketensor"))


@_cuda_build
def test_kvcache_fake_tensors_give_shapes_and_run_the_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(2, 3, 8, 64, dtype=torch.float16, device="cuda")
        cache = torch.empty(2, 100, 2, 64, dtype=torch.float16, device="cuda")
        out, lse = torch.ops.cuflash.attention_with_kvcache(q, cache, cache, None, None, None, 10, None, None, None,
                                                            None, True, -1, -1, 0.0, 0, True, None, None, True, None)
        assert out.shape == q.shape and lse.shape == (2, 8, 3)
        with pytest.raises(ValueError, match="cache_seqlens: 99 cached \\+ 3 new keys exceed the cache capacity 100"):
            torch.ops.cuflash.attention_with_kvcache(q, cache, cache, q[:, :, :2], q[:, :, :2], None, 99, None, None,
                                                     None, None, True, -1, -1, 0.0, 0, False, None, None, True, None)


def test_kvcache_torch_compile_has_no_graph_break_and_appends(on_host):
    q, k_cache, v_cache, k, v = _decode()
    lens = torch.tensor([3, 0, 20], dtype=torch.int32)

    def f(q, k_cache, v_cache, k, v, lens):
        return cuflash.torch.attention_with_kvcache(q * 2, k_cache, v_cache, k=k, v=v, cache_seqlens=lens,
                                                    causal=True).float()

    explain = torch._dynamo.explain(f)(q, k_cache.clone(), v_cache.clone(), k, v, lens)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    torch._dynamo.reset()
    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    want = f(q, eager_k, eager_v, k, v, lens)
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k_cache, v_cache, k, v, lens)
    assert torch.equal(got, want) and torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)


def test_kvcache_errors(monkeypatch):
    monkeypatch.setattr(cuflash.torch, "_plans", {})
    q, k_cache, v_cache, k, v = _decode()
    with pytest.raises(ValueError, match="cache_seqlens: expected an int >= 0, got -1"):
        cuflash.torch.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=-1)
    with pytest.raises(TypeError, match="cache_seqlens: expected an int or an int32 tensor, got float 2.0"):
        cuflash.torch.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=2.0)
    with pytest.raises(ValueError, match="k and v must be given together; got k but not v"):
        cuflash.torch.attention_with_kvcache(q, k_cache, v_cache, k=k, cache_seqlens=3)
    with pytest.raises(ValueError, match="q: expected a CUDA tensor, got one on cpu"):
        cuflash.torch.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=3)


def test_varlen_paged_opcheck(on_host):
    g = torch.Generator().manual_seed(5)
    q = torch.randn(6, 4, 32, generator=g).half()
    pool = torch.randn(5, 16, 2, 32, generator=g).half()
    table = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32)
    cu_q, cu_k = torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 20, 37], dtype=torch.int32)
    used = torch.tensor([20, 9], dtype=torch.int32)
    state = torch.tensor([5, 8], dtype=torch.int64)
    for args in ((q, pool, pool, cu_q, cu_k, table, None, None, None, 4, 20, None, True, -1, 0, 0.0, 0.0),
                 (q, pool, pool, cu_q, cu_k, table, used, None, state, 4, 20, 0.2, False, 8, 8, 3.0, 0.1)):
        torch.library.opcheck(torch.ops.cuflash.attention_varlen_paged.default, args,
                              test_utils=("test_schema", "test_faketensor"))


def test_varlen_paged_keys_forward_and_no_backward(on_host):
    """block_table and seqused_k reach the forward (eager and through the op); with a gradient to track they raise
    NotImplementedError naming the argument."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(6, 4, 32, generator=g).half()
    pool_k, pool_v = (torch.randn(5, 16, 2, 32, generator=g).half() for _ in range(2))
    table = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32)
    cu_q = torch.tensor([0, 2, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 37], dtype=torch.int32)
    used = torch.tensor([20, 9], dtype=torch.int32)
    out = cuflash.torch.attention_varlen(q, pool_k, pool_v, cu_q, cu_k, 4, 20, causal=True, block_table=table,
                                         seqused_k=used)
    want = reference.attention_varlen(q.numpy(), pool_k.numpy(), pool_v.numpy(), cu_q.numpy(), cu_k.numpy(), 4, 20,
                                      causal=True, block_table=table.numpy(), seqused_k=used.numpy())
    assert np.abs(out.numpy() - want).max() < 4e-3
    assert on_host[-1][1]["block_table"] is not None and on_host[-1][1]["seqused_k"] is not None
    with pytest.raises(NotImplementedError, match="block_table: attention_varlen with paged keys"):
        cuflash.torch.attention_varlen(q.requires_grad_(), pool_k, pool_v, cu_q, cu_k, 4, 20, block_table=table)
    compiled = torch.compile(lambda *a: cuflash.torch.attention_varlen(*a, 4, 20, causal=True, block_table=table,
                                                                       seqused_k=used), backend="aot_eager",
                             fullgraph=True)
    with torch.no_grad():
        assert torch.equal(compiled(q.detach(), pool_k, pool_v, cu_q, cu_k), out)


# --------------------------------------------------------------------------------------------
# dropout
# --------------------------------------------------------------------------------------------

class _FakeCudaGenerator:
    """torch's CUDA generator as cuflash.torch reads it: a seed and an offset the call advances."""

    def __init__(self, seed, offset):
        self.seed, self.offset = seed, offset

    def initial_seed(self):
        return self.seed

    def get_offset(self):
        return self.offset

    def set_offset(self, offset):
        self.offset = offset


def _check_dropout_against_torch(q, k, v, out, dout, p, seed, offset):
    """out and q, k, v's gradients (after out.backward(dout)) against the same causal attention (_qkv's shapes) in
    float64 torch with the reference's mask: dropped probabilities, kept ones scaled."""
    keep = torch.from_numpy(reference.dropout_keep(seed, offset, 2, 4, 17, 29, p))
    scale = reference.DROPOUT_LEVELS / reference.dropout_threshold(p)
    qf, kf, vf = (x.detach().double().transpose(1, 2).requires_grad_() for x in (q, k, v))
    kr, vr = kf.repeat_interleave(2, 1), vf.repeat_interleave(2, 1)
    s = qf @ kr.transpose(-1, -2) / math.sqrt(32)
    s = s.masked_fill(~(torch.arange(29)[None, :] <= torch.arange(17)[:, None] + 12), float("-inf"))
    ref = ((s.softmax(-1) * keep * scale) @ vr).transpose(1, 2)
    ref.backward(dout.double())
    assert (out.double() - ref).abs().max().item() < 4e-3
    for got, want in ((q.grad, qf.grad), (k.grad, kf.grad), (v.grad, vf.grad)):
        assert (got.double() - want.transpose(1, 2)).abs().max().item() < 2e-2


def test_dropout_mask_comes_from_the_generator_and_reaches_forward_and_backward(on_host, monkeypatch):
    generator = _FakeCudaGenerator(seed=(7 << 40) + 123, offset=8)
    monkeypatch.setattr(cuflash.torch, "_generator", lambda q: generator)
    q, k, v = _qkv(torch.float16)
    p = 0.3
    out = cuflash.torch.attention(q, k, v, causal=True, dropout_p=p)
    assert generator.offset == 12  # the call took 4 of the generator's offsets
    dout = torch.randn_like(out)
    out.backward(dout)
    fwd, bwd = on_host[0][1], on_host[1][1]
    for options in (fwd, bwd):  # the backward regenerates the forward's mask
        assert (options["dropout_p"], options["dropout_seed"], options["dropout_offset"]) == (p, (7 << 40) + 123, 8)
    _check_dropout_against_torch(q, k, v, out, dout, p, (7 << 40) + 123, 8)
    # a second call draws a new mask
    out2 = cuflash.torch.attention(q.detach(), k.detach(), v.detach(), causal=True, dropout_p=p)
    assert generator.offset == 16 and on_host[2][1]["dropout_offset"] == 12 and not torch.equal(out2, out.detach())


def test_dropout_under_graph_capture_reads_its_seed_from_the_device(on_host, monkeypatch):
    """Under CUDA-graph capture a dropout call takes its seed and offset from a device tensor that torch's generator
    fills (at every replay), not from the host's generator; the backward reads the same tensor."""
    generator = _FakeCudaGenerator(seed=5, offset=0)
    monkeypatch.setattr(cuflash.torch, "_generator", lambda q: generator)
    state = torch.tensor([(3 << 40) + 1, 44], dtype=torch.int64)
    drawn = []
    monkeypatch.setattr(cuflash.torch, "_device_dropout_state", lambda device, gen: drawn.append(gen) or state)
    monkeypatch.setattr(cuflash.torch, "_capturing", lambda q: True)
    q, k, v = _qkv(torch.float16)
    cuflash.torch.attention(q, k, v, causal=True, dropout_p=0.3).sum().backward()
    assert drawn == [generator] and generator.offset == 0  # drawn by the generator on the device, not read here
    assert [c[0] for c in on_host] == ["fwd", "bwd"]
    for _, options in on_host:
        assert (options["dropout_p"], options["dropout_seed"], options["dropout_offset"]) == (0.3, (3 << 40) + 1, 44)


def test_dropout_through_varlen_and_padded_head_dims(on_host, monkeypatch):
    generator = _FakeCudaGenerator(seed=5, offset=0)
    monkeypatch.setattr(cuflash.torch, "_generator", lambda q: generator)
    q, k, v, cu_q, cu_k = _packed(torch.float16)
    cuflash.torch.attention_varlen(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), dropout_p=0.1).sum().backward()
    assert [c[0] for c in on_host] == ["fwd", "bwd"] and generator.offset == 4
    assert all(c[1]["dropout_p"] == 0.1 and c[1]["dropout_offset"] == 0 for c in on_host)
    q, k, v = _qkv(torch.float16, d=20)  # padded to 24: the same mask, drawn per score
    cuflash.torch.attention(q, k, v, dropout_p=0.1).sum().backward()
    assert on_host[2][1]["dropout_offset"] == 4 and generator.offset == 8


def test_dropout_p_is_checked(on_host, monkeypatch):
    monkeypatch.setattr(cuflash.torch, "_generator", lambda q: _FakeCudaGenerator(0, 0))
    q, k, v = _qkv()
    for p in (1.0, -0.1):
        with pytest.raises(ValueError, match="dropout_p"):
            cuflash.torch.attention(q, k, v, dropout_p=p)
    with pytest.raises(TypeError, match="dropout_p"):
        cuflash.torch.attention(q, k, v, dropout_p="0.1")
    compiled = torch.compile(lambda q, k, v: cuflash.torch.attention(q, k, v, dropout_p=1.5), backend="aot_eager",
                             fullgraph=True)
    with pytest.raises(Exception, match="dropout_p"):
        compiled(q, k, v)


def _launched_words(calls) -> list:
    return [(c[0], c[1]["dropout_p"], c[1]["dropout_seed"], c[1]["dropout_offset"]) for c in calls]


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.skipif(
    shutil.which("c++") is None, reason="inductor on the CPU compiles C++: no c++ on PATH"))])
def test_dropout_under_torch_compile_draws_its_mask_in_the_graph(on_host, backend):
    """Under torch.compile the mask's seed and offset are two words drawn by a random op of the graph (torch's
    generator, so torch.manual_seed repeats them); the backward reads the words its forward read."""
    q, k, v = _qkv(torch.float16)
    p = 0.3
    f = lambda q, k, v: cuflash.torch.attention(q, k, v, causal=True, dropout_p=p)  # noqa: E731
    explain = torch._dynamo.explain(f)(q.detach(), k.detach(), v.detach())
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    torch._dynamo.reset()
    on_host.clear()
    compiled = torch.compile(f, backend=backend, fullgraph=True)
    torch.manual_seed(11)
    out = compiled(q, k, v)
    dout = torch.randn_like(out)
    out.backward(dout)
    (fwd, p_fwd, seed, offset), (bwd, p_bwd, seed_b, offset_b) = _launched_words(on_host)
    assert (fwd, bwd, p_fwd, p_bwd) == ("fwd", "bwd", p, p) and (seed_b, offset_b) == (seed, offset)
    assert 0 <= seed < 2 ** 62 and 0 <= offset < 2 ** 62
    _check_dropout_against_torch(q, k, v, out, dout, p, seed, offset)
    with torch.no_grad():
        again = compiled(q, k, v)  # a new mask each run
        torch.manual_seed(11)
        repeat = compiled(q, k, v)  # the first run's mask again
    words = _launched_words(on_host)
    assert words[2][2:] != (seed, offset) and words[3][2:] == (seed, offset)
    assert not torch.equal(again, out.detach()) and torch.equal(repeat, out.detach())


def test_dropout_under_torch_compile_through_varlen_and_paged_keys(on_host):
    q, k, v, cu_q, cu_k = _packed(torch.float16)
    compiled = torch.compile(lambda *a: cuflash.torch.attention_varlen(*a, max(LENS_Q), max(LENS_K), dropout_p=0.1),
                             backend="aot_eager", fullgraph=True)
    compiled(q, k, v, cu_q, cu_k).sum().backward()
    (fwd, p_fwd, *words), (bwd, p_bwd, *words_b) = _launched_words(on_host)
    assert (fwd, bwd, p_fwd, p_bwd) == ("fwd", "bwd", 0.1, 0.1) and words == words_b
    g = torch.Generator().manual_seed(4)
    q = torch.randn(6, 4, 32, generator=g).half()
    pool_k, pool_v = (torch.randn(5, 16, 2, 32, generator=g).half() for _ in range(2))
    table = torch.tensor([[3, 0], [1, 4]], dtype=torch.int32)
    cu_q, cu_k = torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([0, 20, 37], dtype=torch.int32)
    paged = torch.compile(lambda *a: cuflash.torch.attention_varlen(*a, 4, 20, block_table=table, dropout_p=0.2),
                          backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        out = paged(q, pool_k, pool_v, cu_q, cu_k)
    _, p, seed, offset = _launched_words(on_host)[-1]
    want = reference.attention_varlen(q.numpy(), pool_k.numpy(), pool_v.numpy(), cu_q.numpy(), cu_k.numpy(), 4, 20,
                                      block_table=table.numpy(), dropout_p=p, dropout_seed=seed, dropout_offset=offset)
    assert p == 0.2 and np.abs(out.numpy() - want).max() < 4e-3


# --------------------------------------------------------------------------------------------
# FP8: the forward ops under torch.compile (the eager path, _fp8, on the host's reference here)
# --------------------------------------------------------------------------------------------

@pytest.fixture
def fp8_on_host(on_host, monkeypatch):
    """cuflash.torch._fp8 (the eager FP8 call) checks as on a GPU, then computes the reference on host memory."""
    def fp8(q, k, v, descales, varlen, softmax_scale, causal, window_size, return_lse):
        cuflash.torch._fp8_problem(q, k, v, descales, varlen, softmax_scale, causal, window_size)
        on_host.append(("fp8", dict(varlen=varlen is not None, window_size=tuple(window_size))))
        bits = [x.view(torch.uint8).numpy() for x in (q, k, v)]
        names = ("q_descale", "k_descale", "v_descale")
        options = dict({n: d.numpy() for n, d in zip(names, descales) if d is not None},
                       softmax_scale=softmax_scale, causal=causal, window_size=tuple(window_size), return_lse=True)
        if varlen is None:
            out, lse = reference.attention_fp8(*bits, **options)
        else:
            out, lse = _fp8_varlen_reference(bits, varlen, options)
        out = torch.from_numpy(np.ascontiguousarray(out)).to(torch.bfloat16)
        lse = torch.from_numpy(np.ascontiguousarray(lse)).float()
        return (out, lse) if return_lse else out

    monkeypatch.setattr(cuflash.torch, "_fp8", fp8)
    return on_host


def _fp8_varlen_reference(bits, varlen, options) -> tuple:
    """attention_fp8 per packed sequence (tensor descales), as (total_q, h, d) and (h, total_q)."""
    cu_q, cu_k = varlen[0].numpy(), varlen[1].numpy()
    q8, k8, v8 = bits
    out = np.zeros(q8.shape)
    lse = np.zeros((q8.shape[1], q8.shape[0]))
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o, l = reference.attention_fp8(q8[None, rows], k8[None, keys], v8[None, keys], **options)
        out[rows], lse[:, rows] = o[0], l[0]
    return out, lse


def _fp8_qkv(b=2, sq=17, sk=29, h=4, hk=2, d=32):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(n, h_, d, generator=g) if b is None else torch.randn(b, n, h_, d, generator=g)
               for n, h_ in ((sq, h), (sk, hk), (sk, hk)))
    return tuple(x.to(torch.float8_e4m3fn) for x in (q, k, v))


def test_fp8_ops_opcheck(fp8_on_host):
    """The fake implementations against the ops (test_schema compares the inputs by arithmetic that float8 lacks on
    the CPU)."""
    q, k, v = _fp8_qkv()
    descale = torch.tensor(0.5)
    for args in ((q, k, v, None, None, None, None, True, -1, -1, True),
                 (q, k, v, *(torch.full((2, 2), x) for x in (0.5, 2.0, 0.25)), 0.2, False, 5, 0, False)):
        torch.library.opcheck(torch.ops.cuflash.attention_fp8.default, args,
                              test_utils=("test_faketensor",))
    q, k, v = _fp8_qkv(b=None, sq=sum(LENS_Q), sk=sum(LENS_K))
    cu_q, cu_k = (torch.tensor(np.cumsum((0,) + lens), dtype=torch.int32) for lens in (LENS_Q, LENS_K))
    torch.library.opcheck(torch.ops.cuflash.attention_varlen_fp8.default,
                          (q, k, v, cu_q, cu_k, descale, None, None, max(LENS_Q), max(LENS_K), None, True, -1, -1,
                           True), test_utils=("test_faketensor",))


def test_fp8_under_torch_compile_is_the_eager_call(fp8_on_host):
    """attention_fp8 and attention_varlen_fp8 compile without a graph break into their ops, whose results are the
    eager calls'."""
    q, k, v = _fp8_qkv()
    descales = dict(q_descale=torch.full((2, 2), 0.5), v_descale=torch.full((2, 2), 0.25))
    f = lambda q, k, v: cuflash.torch.attention_fp8(q, k, v, causal=True, window_size=[6, 0], return_lse=True,  # noqa
                                                    **descales)
    explain = torch._dynamo.explain(f)(q, k, v)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    torch._dynamo.reset()
    out, lse = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
    want, want_lse = f(q, k, v)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want) and torch.equal(lse, want_lse)
    assert fp8_on_host[-1] == fp8_on_host[-2] == ("fp8", dict(varlen=False, window_size=(6, 0)))
    q, k, v = _fp8_qkv(b=None, sq=sum(LENS_Q), sk=sum(LENS_K))
    cu_q, cu_k = (torch.tensor(np.cumsum((0,) + lens), dtype=torch.int32) for lens in (LENS_Q, LENS_K))
    g = lambda q, k, v: cuflash.torch.attention_varlen_fp8(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K),  # noqa
                                                           k_descale=torch.tensor(2.0))
    out = torch.compile(g, backend="aot_eager", fullgraph=True)(q, k, v)
    assert out.shape == q.shape and torch.equal(out, g(q, k, v)) and fp8_on_host[-1][1]["varlen"]


@_cuda_build
def test_fp8_fake_tensors_give_shapes_and_run_the_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(2, 5, 8, 64, dtype=torch.float8_e4m3fn, device="cuda")
        k = torch.empty(2, 9, 2, 64, dtype=torch.float8_e4m3fn, device="cuda")
        out, lse = torch.ops.cuflash.attention_fp8(q, k, k, None, None, None, None, False, -1, -1, True)
        assert out.shape == q.shape and out.dtype == torch.bfloat16 and lse.shape == (2, 8, 5)
        out, lse = torch.ops.cuflash.attention_fp8(q, k, k, None, None, None, None, False, -1, -1, False)
        assert lse.shape == (0,)
        with pytest.raises(TypeError, match="v: dtype torch.bfloat16 is not supported; expected torch.float8_e4m3fn"):
            torch.ops.cuflash.attention_fp8(q, k, k.to(torch.bfloat16), None, None, None, None, False, -1, -1, True)
        cu = torch.empty(4, dtype=torch.int32, device="cuda")
        out, lse = torch.ops.cuflash.attention_varlen_fp8(q[0], k[0], k[0], cu, cu, None, None, None, 5, 9, None,
                                                          True, -1, -1, True)
        assert out.shape == q[0].shape and lse.shape == (8, 5)
