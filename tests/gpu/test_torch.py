"""cuflash.torch: gradients against SDPA's math backend in float32; a call on a side stream; varlen and KV cache."""
import contextlib
import itertools

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


def _sdpa_reference(q, k, v, causal):
    """float32 math attention in (b, s, h, d) layout; causal bottom-right as an explicit mask."""
    qf, kf, vf = (x.detach().float().transpose(1, 2).requires_grad_() for x in (q, k, v))
    sq, sk = q.shape[1], k.shape[1]
    mask = None
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        mask = j <= i + sk - sq
    g = q.shape[2] // k.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        qf, kf.repeat_interleave(g, dim=1), vf.repeat_interleave(g, dim=1), attn_mask=mask)
    return out.transpose(1, 2), (qf, kf, vf)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_torch_gradients_match_float32_math(dtype, causal):
    import cuflash.torch
    dt = getattr(torch, dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 97, 4, 64, device="cuda", dtype=dt, generator=gen).requires_grad_()
    k = torch.randn(2, 130, 2, 64, device="cuda", dtype=dt, generator=gen).requires_grad_()
    v = torch.randn(2, 130, 2, 64, device="cuda", dtype=dt, generator=gen).requires_grad_()
    dout = torch.randn(2, 97, 4, 64, device="cuda", dtype=dt, generator=gen)
    out = cuflash.torch.attention(q, k, v, causal=causal)
    out.backward(dout)
    ref, (qf, kf, vf) = _sdpa_reference(q, k, v, causal)
    ref.backward(dout.float())
    tol = 2e-2 if dtype == "bfloat16" else 4e-3
    assert (out.float() - ref).abs().max().item() < tol
    for got, want in ((q.grad, qf.grad.transpose(1, 2)), (k.grad, kf.grad.transpose(1, 2)),
                      (v.grad, vf.grad.transpose(1, 2))):
        assert got.shape == want.shape and got.dtype == dt
        err = (got.float() - want).abs().max().item() / max(1.0, want.abs().max().item())
        assert err < 4 * tol, err


def test_side_stream_is_ordered_after_its_producer():
    """Inputs written on a busy side stream, attention called on that stream: no race with the producer."""
    import cuflash.torch
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        big = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):  # keep the stream busy so a missing dependency would show
            big = torch.tanh(big @ big / 64)
        q = torch.randn(1, 256, 2, 64, device="cuda", dtype=torch.float16) + big[:1, :1].half() * 0
        out = cuflash.torch.attention(q, q, q)
        ref, _ = _sdpa_reference(q, q, q, False)
    side.synchronize()
    assert torch.isfinite(out).all() and (out.float() - ref).abs().max().item() < 4e-3


def test_a_raw_stream_is_wrapped_once_per_pointer_and_warns_nothing():
    """`stream=` as a raw cudaStream_t (torch's): one CuPy stream per pointer, no deprecated CuPy class."""
    import warnings

    import cupy
    import cuflash
    from cuflash import runtime
    side = torch.cuda.Stream()
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.float16)
    qc = cupy.from_dlpack(q)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = cuflash.attention(qc, qc, qc, stream=side.cuda_stream)
        wrapped = runtime.external_stream(side.cuda_stream)
    assert not [w for w in caught if "Stream" in str(w.message)], [str(w.message) for w in caught]
    assert wrapped is runtime.external_stream(side.cuda_stream) and wrapped.ptr == side.cuda_stream
    side.synchronize()
    ref, _ = _sdpa_reference(q, q, q, False)
    assert (torch.from_dlpack(out).float() - ref).abs().max().item() < 4e-3


def _qkv(dtype=torch.float16, b=2, sq=97, sk=130, h=4, hk=2, d=64, device="cuda", requires_grad=True, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    shapes = ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d))
    return tuple(torch.randn(s, device=device, dtype=dtype, generator=gen).requires_grad_(requires_grad)
                 for s in shapes)


def test_same_kernels_as_the_cupy_api():
    """Every option reaches the kernel: bitwise equal to cuflash.attention on the same memory."""
    import cupy
    import cuflash
    import cuflash.torch
    q, k, v = _qkv(torch.bfloat16, requires_grad=False)
    slopes = torch.linspace(0.1, 1.0, 4, device="cuda")
    opts = dict(causal=True, window_size=(40, -1), softcap=5.0, softmax_scale=0.11)
    out, lse = cuflash.torch.attention(q, k, v, alibi_slopes=slopes, return_lse=True, **opts)
    want, want_lse = cuflash.attention(*(_as_cupy(x) for x in (q, k, v)), alibi_slopes=_as_cupy(slopes),
                                       return_lse=True, **opts)
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), torch.from_dlpack(want.view(cupy.int16)))
    assert torch.equal(lse, torch.from_dlpack(want_lse))


def _as_cupy(x):
    import cupy
    import ml_dtypes
    if x.dtype == torch.bfloat16:  # DLPack export of bf16 is not universal: go through int16
        return cupy.from_dlpack(x.detach().view(torch.int16)).view(ml_dtypes.bfloat16)
    return cupy.from_dlpack(x.detach())


def test_outputs_and_workspaces_come_from_torch():
    """CuPy's allocator is never asked: forward outputs and backward workspaces are torch blocks."""
    import cupy
    import cuflash.torch
    q, k, v = _qkv()
    cuflash.torch.attention(q, k, v)  # compile outside the measurement

    def refuse(size):
        raise AssertionError(f"CuPy allocator asked for {size} bytes")

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(refuse)
    try:
        out = cuflash.torch.attention(q, k, v, causal=True)
        grown = torch.cuda.memory_allocated() - before
        out.sum().backward()
    finally:
        cupy.cuda.set_allocator(previous)
    assert grown >= out.numel() * out.element_size() + 2 * 4 * 97 * 4  # out + lse
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_deterministic_backward_is_bitwise_repeatable():
    import cuflash.torch
    q, k, v = _qkv(torch.bfloat16, sq=300, sk=300)
    dout = torch.randn_like(q)
    grads = []
    for _ in range(3):
        for x in (q, k, v):
            x.grad = None
        cuflash.torch.attention(q, k, v, causal=True, deterministic=True).backward(dout)
        grads.append([x.grad.clone() for x in (q, k, v)])
    assert all(torch.equal(a, b) for g in grads[1:] for a, b in zip(grads[0], g))


def test_opcheck_on_cuda():
    import cuflash.torch  # noqa: F401  (registers the ops)
    q, k, v = _qkv(sq=33, sk=33)
    args = (q, k, v, None, None, None, True, -1, -1, 0.0, False, 0.0)
    torch.library.opcheck(torch.ops.cuflash.attention_fwd.default, args)
    out, lse = torch.ops.cuflash.attention_fwd(*args)
    # the backward op has no derivative of its own (no double backward): check it on inputs without grad
    q, k, v = (x.detach() for x in (q, k, v))
    torch.library.opcheck(torch.ops.cuflash.attention_bwd.default,
                          (torch.randn_like(out), q, k, v, out.detach(), lse, *args[3:]),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


class _Block(torch.nn.Module):
    """A pre-norm transformer block whose attention is cuflash's."""

    def __init__(self, dim=256, heads=4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        import cuflash.torch
        b, s, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, dim // self.heads).unbind(2)
        x = x + self.proj(cuflash.torch.attention(q, k, v, causal=True).reshape(b, s, dim))
        return x + self.mlp(self.norm2(x))


def test_torch_compile_model_has_no_graph_break():
    torch._dynamo.reset()
    model = _Block().cuda().to(torch.bfloat16)
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)
    explain = torch._dynamo.explain(model)(x)
    assert explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(model, fullgraph=True)
    y = compiled(x)
    y.float().sum().backward()
    eager = model(x)
    assert (y.float() - eager.float()).abs().max().item() < 5e-2
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_gpu():
    import cuflash.torch
    q, k, v = _qkv(device="cuda:1")
    with torch.cuda.device(0):  # the tensors' device wins over the current one
        out = cuflash.torch.attention(q, k, v, causal=True)
        out.sum().backward()
    assert out.device == q.device and q.grad.device == q.device
    ref, _ = _sdpa_reference(q, k, v, True)
    assert (out.float() - ref).abs().max().item() < 4e-3


def test_eager_path_and_op_path_are_bitwise_equal():
    """An eager call skips the dispatcher; under a dispatch mode it goes through the ops: same kernels, same bits."""
    import cuflash.torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    q, k, v = _qkv(torch.bfloat16)
    dout = torch.randn_like(q)
    results = []
    for mode in (None, Passthrough()):
        for x in (q, k, v):
            x.grad = None
        with mode or contextlib.nullcontext():
            out = cuflash.torch.attention(q, k, v, causal=True, deterministic=True)
            out.backward(dout)
        results.append([out.detach(), *(x.grad for x in (q, k, v))])
    assert all(torch.equal(a, b) for a, b in zip(*results))


# --------------------------------------------------------------------------------------------
# attention_varlen
# --------------------------------------------------------------------------------------------

LENS_Q, LENS_K = (97, 1, 0, 130, 17), (130, 33, 5, 130, 17)


def _packed(dtype, h=4, hk=2, d=64, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(LENS_Q), h, d, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    k = torch.randn(sum(LENS_K), hk, d, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    v = torch.randn(sum(LENS_K), hk, d, device="cuda", dtype=dtype, generator=gen).requires_grad_()
    cu_q, cu_k = (torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
                  for lens in (LENS_Q, LENS_K))
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_per_sequence_attention_and_float32_gradients(dtype, causal):
    import cuflash.torch
    dt = getattr(torch, dtype)
    q, k, v, cu_q, cu_k = _packed(dt)
    out, lse = cuflash.torch.attention_varlen(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=causal,
                                              return_lse=True)
    assert out.shape == q.shape and lse.shape == (4, sum(LENS_Q)) and lse.dtype == torch.float32
    dout = torch.randn_like(out)
    out.backward(dout)
    tol = 2e-2 if dtype == "bfloat16" else 4e-3
    for b, (lq, lk) in enumerate(zip(LENS_Q, LENS_K)):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if lq == 0:
            continue
        qb, kb, vb = (x.detach()[None, s].requires_grad_() for x, s in ((q, sq), (k, sk), (v, sk)))
        dense, dense_lse = cuflash.torch.attention(qb, kb, vb, causal=causal, return_lse=True)
        eps = torch.finfo(dt).eps  # the same kernels; the tile config may differ (it follows max_seqlen)
        assert torch.allclose(out[sq].float(), dense[0].float(), rtol=2 * eps, atol=2 * eps)
        assert torch.allclose(lse[:, sq], dense_lse[0], atol=1e-5, rtol=1e-5, equal_nan=True)
        ref, (qf, kf, vf) = _sdpa_reference(qb, kb, vb, causal)
        ref.backward(dout[None, sq].float())
        for got, want in ((q.grad[sq], qf.grad), (k.grad[sk], kf.grad), (v.grad[sk], vf.grad)):
            want = want.transpose(1, 2)[0]
            err = (got.float() - want).abs().max().item() / max(1.0, want.abs().max().item())
            assert err < 4 * tol, (b, err)
    # keys of the sequence without queries get zero gradients
    empty = slice(int(cu_k[2]), int(cu_k[3]))
    assert not k.grad[empty].any() and not v.grad[empty].any()


def test_varlen_opcheck_on_cuda():
    import cuflash.torch  # noqa: F401
    q, k, v, cu_q, cu_k = _packed(torch.float16)
    args = (q, k, v, cu_q, cu_k, None, None, max(LENS_Q), max(LENS_K), None, True, -1, -1, 0.0, False, 0.0)
    torch.library.opcheck(torch.ops.cuflash.attention_varlen_fwd.default, args)
    out, lse = torch.ops.cuflash.attention_varlen_fwd(*args)
    q, k, v = (x.detach() for x in (q, k, v))
    # dk, dv rows outside every sequence are unspecified: cover every key with a sequence here
    torch.library.opcheck(torch.ops.cuflash.attention_varlen_bwd.default,
                          (torch.randn_like(out), q, k, v, out.detach(), lse, *args[3:]),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_varlen_torch_compile_has_no_graph_break():
    import cuflash.torch
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = _packed(torch.bfloat16)

    def f(q, k, v):
        return cuflash.torch.attention_varlen(q * 2, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=True)

    explain = torch._dynamo.explain(f)(q, k, v)
    assert explain.graph_break_count == 0, explain.break_reasons
    got = torch.compile(f, fullgraph=True)(q, k, v)
    got.float().sum().backward()
    want = f(q.detach(), k.detach(), v.detach())
    assert torch.equal(got, want) and q.grad is not None


# --------------------------------------------------------------------------------------------
# attention_with_kvcache
# --------------------------------------------------------------------------------------------

def _host(t):
    """A float64 or int64 NumPy copy (bf16 through float32)."""
    t = t.detach().cpu()
    return (t.double() if t.is_floating_point() else t.long()).numpy()


def _kvcache_case(dtype, b=3, sq=1, s_new=2, capacity=300, h=8, hk=2, d=128, page_size=None, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=gen)

    q, k, v = rand(b, sq, h, d), rand(b, s_new, hk, d), rand(b, s_new, hk, d)
    lens = torch.tensor([0, 157, capacity - s_new][:b], dtype=torch.int32, device="cuda")
    if page_size is None:
        return q, rand(b, capacity, hk, d), rand(b, capacity, hk, d), k, v, lens, None
    pages = -(-capacity // page_size)
    table = torch.randperm(b * pages, device="cuda", generator=gen).to(torch.int32).view(b, pages)
    return q, rand(b * pages, page_size, hk, d), rand(b * pages, page_size, hk, d), k, v, lens, table


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("page_size", [None, 48])
@pytest.mark.parametrize("num_splits", [0, 1, 5])
def test_kvcache_appends_in_place_and_matches_the_reference(dtype, page_size, num_splits):
    import cuflash.torch
    from cuflash import reference
    dt = getattr(torch, dtype)
    q, k_cache, v_cache, k, v, lens, table = _kvcache_case(dt, page_size=page_size)
    if page_size is not None:
        lens = lens.clamp(max=table.shape[1] * page_size - k.shape[1])
    want_k, want_v = _host(k_cache), _host(v_cache)
    want, want_lse = reference.attention_with_kvcache(
        _host(q), want_k, want_v, k=_host(k), v=_host(v), cache_seqlens=_host(lens),
        block_table=None if table is None else _host(table), causal=True, return_lse=True)
    out, lse = cuflash.torch.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens,
                                                    block_table=table, causal=True, num_splits=num_splits,
                                                    return_lse=True)
    torch.cuda.synchronize()
    assert np.array_equal(_host(k_cache), want_k) and np.array_equal(_host(v_cache), want_v)  # the append, exactly
    assert out.shape == q.shape and out.dtype == dt and lse.shape == (3, 8, 1) and lse.dtype == torch.float32
    tol = 2e-2 if dtype == "bfloat16" else 4e-3
    assert np.abs(_host(out) - want).max() < tol
    assert np.abs(_host(lse) - want_lse).max() < 1e-3


def test_kvcache_int_seqlens_options_and_no_append():
    """cache_seqlens as an int, no k/v (the cache is left alone), every option: bitwise the CuPy API's result."""
    import cuflash
    import cuflash.torch
    q, k_cache, v_cache, _, _, _, _ = _kvcache_case(torch.bfloat16)
    before = k_cache.clone()
    slopes = torch.linspace(0.1, 1.0, 8, device="cuda")
    opts = dict(cache_seqlens=211, causal=True, window_size=(64, 0), softcap=5.0, softmax_scale=0.1, num_splits=3)
    out = cuflash.torch.attention_with_kvcache(q, k_cache, v_cache, alibi_slopes=slopes, **opts)
    want = cuflash.attention_with_kvcache(*(_as_cupy(x) for x in (q, k_cache, v_cache)),
                                          alibi_slopes=_as_cupy(slopes), **opts)
    torch.cuda.synchronize()
    assert torch.equal(k_cache, before)
    assert torch.equal(out.view(torch.int16), torch.from_dlpack(want.view(np.int16)))


def test_kvcache_output_comes_from_torch():
    import cupy
    import cuflash.torch
    q, k_cache, v_cache, k, v, lens, _ = _kvcache_case(torch.float16)
    cuflash.torch.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens, num_splits=4)  # compile

    def refuse(size):
        raise AssertionError(f"CuPy allocator asked for {size} bytes")

    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(refuse)
    try:
        out, lse = cuflash.torch.attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, cache_seqlens=lens,
                                                        num_splits=4, return_lse=True)
    finally:
        cupy.cuda.set_allocator(previous)
    assert out.is_contiguous() and torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert out.untyped_storage().data_ptr() != lse.untyped_storage().data_ptr()


def test_kvcache_opcheck_on_cuda():
    import cuflash.torch  # noqa: F401
    q, k_cache, v_cache, k, v, lens, table = _kvcache_case(torch.float16, page_size=32)
    lens = lens.clamp(max=table.shape[1] * 32 - 2)
    torch.library.opcheck(torch.ops.cuflash.attention_with_kvcache.default,
                          (q, k_cache, v_cache, k, v, lens, -1, None, table, None, None, True, -1, -1, 0.0, 0, True))


def test_kvcache_torch_compile_has_no_graph_break():
    import cuflash.torch
    torch._dynamo.reset()
    q, k_cache, v_cache, k, v, lens, _ = _kvcache_case(torch.bfloat16)

    def step(q, k_cache, v_cache, k, v, lens):
        return cuflash.torch.attention_with_kvcache(q * 2, k_cache, v_cache, k=k, v=v, cache_seqlens=lens,
                                                    causal=True)

    explain = torch._dynamo.explain(step)(q, k_cache.clone(), v_cache.clone(), k, v, lens)
    assert explain.graph_break_count == 0, explain.break_reasons
    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    want = step(q, eager_k, eager_v, k, v, lens)
    got = torch.compile(step, fullgraph=True)(q, k_cache, v_cache, k, v, lens)
    assert torch.equal(got, want) and torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)
