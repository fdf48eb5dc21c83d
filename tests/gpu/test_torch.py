"""cuflash.torch: gradients against SDPA's math backend in float32; a call on a side stream."""
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
    torch.library.opcheck(torch.ops.cuflash.attention_fwd.default, (q, k, v, None, None, True, -1, -1, 0.0, False))
    out, lse = torch.ops.cuflash.attention_fwd(q, k, v, None, None, True, -1, -1, 0.0, False)
    torch.library.opcheck(torch.ops.cuflash.attention_bwd.default,
                          (torch.randn_like(out), q, k, v, out.detach(), lse, None, None, True, -1, -1, 0.0, False),
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
