"""cuflash.torch: gradients against SDPA's math backend in float32; a call on a side stream."""
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
