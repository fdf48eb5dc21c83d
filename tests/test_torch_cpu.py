"""cuflash.torch without a GPU: the torch.library ops, their fake implementations, autograd and torch.compile.

CPU tensors stand in for CUDA ones: the launcher is swapped for cuflash.reference on host memory, and the
device check is relaxed. Everything between the public function and the launch runs as on a GPU.
"""
import contextlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cuflash.torch  # noqa: E402
from cuflash import api, reference  # noqa: E402


def _host(t):
    if t is None:
        return None
    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


@pytest.fixture
def on_host(monkeypatch):
    """Launch into torch-allocated CPU tensors with the float64 reference; count launches."""
    calls = []

    def forward(problem, q, k, v, out, lse, *, alibi_slopes, **options):
        calls.append(("fwd", options))
        o, l = reference.attention(*(x.astype(np.float64) for x in (q, k, v)), alibi_slopes=alibi_slopes,
                                   return_lse=True, **options)
        out[...], lse[...] = o.astype(out.dtype), l

    def backward(problem, dout, q, k, v, out, lse, dq, dk, dv, *, alibi_slopes, deterministic, **options):
        calls.append(("bwd", dict(options, deterministic=deterministic)))
        grads = reference.attention_backward(*(x.astype(np.float64) for x in (dout, q, k, v, out)), lse,
                                             alibi_slopes=alibi_slopes, **options)
        for dst, g in zip((dq, dk, dv), grads):
            dst[...] = g.astype(dst.dtype)

    monkeypatch.setattr(api, "launch_forward", forward)
    monkeypatch.setattr(api, "launch_backward", backward)
    monkeypatch.setattr(cuflash.torch, "_view", _host)
    monkeypatch.setattr(cuflash.torch, "_on_torch_stream", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(cuflash.torch, "_require_cuda", lambda **tensors: None)
    monkeypatch.setattr(cuflash.torch, "_require_aligned", lambda **tensors: None)
    monkeypatch.setattr(cuflash.torch, "_checked", {})
    return calls


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
    args = (q, k, v, None, None, True, -1, -1, 0.0, False)
    torch.library.opcheck(torch.ops.cuflash.attention_fwd.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    out, lse = torch.ops.cuflash.attention_fwd(*args)
    bwd_args = (torch.randn_like(out), q, k, v, out.detach(), lse, None, None, True, -1, -1, 0.0, False)
    torch.library.opcheck(torch.ops.cuflash.attention_bwd.default, bwd_args,
                          test_utils=("test_schema", "test_faketensor"))


def test_fake_tensors_give_shapes_and_run_the_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(2, 5, 8, 64, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 9, 2, 64, dtype=torch.bfloat16, device="cuda")
        out, lse = torch.ops.cuflash.attention_fwd(q, k, k, None, None, False, -1, -1, 0.0, False)
        assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (2, 8, 5)
        assert lse.dtype == torch.float32 and out.device.type == "cuda"
        dq, dk, dv = torch.ops.cuflash.attention_bwd(out, q, k, k, out, lse, None, None, False, -1, -1, 0.0,
                                                     False)
        assert dq.shape == q.shape and dk.shape == k.shape and dv.dtype == k.dtype
        with pytest.raises(ValueError, match=r"k: head dim \(axis 3\) is 32 but q's is 64"):
            torch.ops.cuflash.attention_fwd(q, k[..., :32], k[..., :32], None, None, False, -1, -1, 0.0, False)


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
    monkeypatch.setattr(cuflash.torch, "_checked", {})
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
