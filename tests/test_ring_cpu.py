"""Ring attention without a GPU: the schedule's masks, the merge, and the ring itself against attention on the
gathered sequence -- N ranks simulated in one process, and real processes over torch.distributed's gloo backend.

cuflash.torch's launches are swapped for cuflash.reference on CPU tensors (test_torch_cpu's ``on_host``), so the
ring's programs, the block slicing, the merge and the gradient accumulators run exactly as on GPUs.
"""
import math
import os
import socket

import numpy as np
import pytest

from cuflash import reference, ring
from cuflash.reference import _visible

try:
    import torch
except ImportError as err:  # the schedule's tests run without torch; the ring's skip, naming the missing module
    torch, missing = None, str(err)
else:
    import cuflash.torch_distributed as cfd
    from test_torch_cpu import on_host  # noqa: F401  (the fixture)
needs_torch = pytest.mark.skipif(torch is None, reason=missing if torch is None else "")


# --------------------------------------------------------------------------------------------
# The schedule (pure Python)
# --------------------------------------------------------------------------------------------

def _global_mask(n, left, right):
    p = np.arange(n)
    keep = np.ones((n, n), dtype=bool)
    if left >= 0:
        keep &= p[None, :] >= p[:, None] - left
    if right >= 0:
        keep &= p[None, :] <= p[:, None] + right
    return keep


@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_blocks_cover_the_global_mask_exactly_once(layout, world):
    """Every visible (query, key) pair of the sequence is computed in exactly one block, every hidden one in none,
    for causal, full and sliding windows of every size around the chunk length."""
    for local in (2, 4, 6, 8):
        for left in (-1, 0, 1, 3, 5, 9, 20):
            for right in (-1, 0, 1, 2, 7, 30):
                seen = np.zeros((world * local,) * 2, dtype=int)
                for r in range(world):
                    rows = np.array(ring.positions(layout, world, r, local))
                    for s in range(world):
                        cols = np.array(ring.positions(layout, world, s, local))
                        for b in ring.blocks(layout, world, r, s, local, left, right):
                            block = np.zeros((local, local), dtype=bool)
                            block[b.q_start:b.q_stop, b.k_start:b.k_stop] = _visible(
                                b.q_stop - b.q_start, b.k_stop - b.k_start, False, (b.left, b.right))
                            seen[np.ix_(rows, cols)] += block
                assert seen.max() <= 1 and ((seen == 1) == _global_mask(world * local, left, right)).all(), \
                    (layout, world, local, left, right)


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    world, local = 4, 64
    zigzag = ring.schedule("zigzag", world, local, -1, 0)
    contiguous = ring.schedule("contiguous", world, local, -1, 0)
    for step in zigzag[1:]:
        assert len({ring.work([rank]) for rank in step}) == 1           # every rank the same work per step
    assert [ring.work([contiguous[t][0]]) for t in range(world)][1:] == [0] * (world - 1)  # rank 0 idles
    assert {b for b in zigzag[0][2]} == {ring.Block(0, local, 0, local, -1, 0)}  # the diagonal: one causal call


def test_positions_of_the_layouts():
    assert [ring.positions("contiguous", 2, r, 4) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [ring.positions("zigzag", 2, r, 4) for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    with pytest.raises(ValueError, match="must be even"):
        ring.positions("zigzag", 2, 0, 3)
    with pytest.raises(ValueError, match="layout: expected one of"):
        ring.positions("striped", 2, 0, 4)


def test_run_local_reports_a_receive_with_no_send():
    def program():
        yield ring.Receive(0)
    with pytest.raises(RuntimeError, match="wait for messages never sent"):
        ring.run_local([program(), program()], lambda x: x)


# --------------------------------------------------------------------------------------------
# The merge
# --------------------------------------------------------------------------------------------

@needs_torch
def test_merge_is_reference_combine_with_empty_rows():
    g = torch.Generator().manual_seed(1)
    outs = torch.randn(3, 2, 5, 4, 8, generator=g, dtype=torch.float64)
    lses = torch.randn(3, 2, 4, 5, generator=g, dtype=torch.float64)
    lses[0, :, :, 0] = -math.inf          # a row that one split does not see
    lses[:, 1, 2, 3] = -math.inf          # a row no split sees
    outs[0, :, 0] = 0.0
    outs[:, 1, 3, 2] = 0.0
    out = torch.zeros(2, 5, 4, 8, dtype=torch.float32)
    lse = torch.full((2, 4, 5), -math.inf, dtype=torch.float32)
    for s in range(3):
        cfd._merge(out, lse, outs[s].float(), lses[s].float())
    want_out, want_lse = reference.combine(outs.numpy(), lses.transpose(2, 3).numpy())
    assert np.abs(out.numpy() - want_out).max() < 1e-5
    assert np.allclose(lse.transpose(1, 2).numpy(), want_lse, atol=1e-5, equal_nan=False)
    assert torch.isneginf(lse[1, 2, 3]) and not torch.isnan(out).any()


# --------------------------------------------------------------------------------------------
# The ring, simulated in one process, against attention on the gathered sequence
# --------------------------------------------------------------------------------------------

def _sequence(b=2, s=24, h=4, hk=2, d=32, dtype=None, seed=0):
    dtype = dtype or torch.float16
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g).to(dtype)
    k = torch.randn(b, s, hk, d, generator=g).to(dtype)
    v = torch.randn(b, s, hk, d, generator=g).to(dtype)
    dout = torch.randn(b, s, h, d, generator=g).to(dtype)
    return q, k, v, dout


def _want(q, k, v, dout, **options):
    """float64 reference on the whole sequence: out, lse, (dq, dk, dv)."""
    q64, k64, v64, d64 = (x.double().numpy() for x in (q, k, v, dout))
    out, lse = reference.attention(q64, k64, v64, return_lse=True, **options)
    grads = reference.attention_backward(d64, q64, k64, v64, out, lse, **options)
    return out, lse, grads


def _shards(x, world, layout):
    return [cfd.shard(x, layout=layout, rank=r, world=world) for r in range(world)]


def _ring(world, layout, q, k, v, dout, **options):
    qs, ks, vs = (_shards(x, world, layout) for x in (q, k, v))
    for x in (*qs, *ks, *vs):
        x.requires_grad_()
    results = cfd.ring_attention_local(qs, ks, vs, layout=layout, return_lse=True, **options)
    outs, lses = [o for o, _ in results], [l for _, l in results]
    torch.autograd.backward(outs, _shards(dout, world, layout))
    gather = lambda xs, dim=1: cfd.gather(xs, layout=layout, dim=dim).detach().double().numpy()  # noqa: E731
    return (gather(outs), gather(lses, 2), (gather([x.grad for x in qs]), gather([x.grad for x in ks]),
                                            gather([x.grad for x in vs])))


def _close(got, want, tol, what):
    err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
    assert err < tol, f"{what}: relative error {err:.3g} (tolerance {tol})"


@needs_torch
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("layout", ring.LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
def test_simulated_ring_matches_attention_on_the_gathered_sequence(on_host, world, layout, causal):
    q, k, v, dout = _sequence(s=8 * world)  # GQA: 4 query heads on 2 key heads
    got_out, got_lse, got_grads = _ring(world, layout, q, k, v, dout, causal=causal)
    want_out, want_lse, want_grads = _want(q, k, v, dout, causal=causal)
    _close(got_out, want_out, 4e-3, "out")
    _close(got_lse, want_lse, 1e-5, "lse")
    for name, got, want in zip(("dq", "dk", "dv"), got_grads, want_grads):
        _close(got, want, 1e-2, name)
    calls = [c[0] for c in on_host]
    assert calls.count("fwd") == calls.count("bwd") == sum(
        len(ring.blocks(layout, world, r, s, q.shape[1] // world, -1, 0 if causal else -1))
        for r in range(world) for s in range(world))


@needs_torch
def test_a_ring_that_drops_the_causal_mask_is_caught(on_host, monkeypatch):
    """A known-wrong schedule (every block unmasked) must fail the comparison the tests above make."""
    q, k, v, dout = _sequence(s=16)
    blocks = ring.blocks
    unmasked = lambda *args: tuple(b._replace(left=-1, right=-1) for b in blocks(*args))  # noqa: E731
    monkeypatch.setattr(cfd.ring, "blocks", unmasked)
    got_out, _, _ = _ring(2, "zigzag", q, k, v, dout, causal=True)
    want_out, _, _ = _want(q, k, v, dout, causal=True)
    with pytest.raises(AssertionError, match="out: relative error"):
        _close(got_out, want_out, 4e-3, "out")


@needs_torch
@pytest.mark.parametrize("options", [dict(window_size=(5, 3)), dict(causal=True, window_size=(7, -1)),
                                     dict(softcap=2.0, softmax_scale=0.3, causal=True)],
                         ids=["window", "causal-window", "softcap"])
@pytest.mark.parametrize("layout", ring.LAYOUTS)
def test_simulated_ring_options(on_host, layout, options):
    q, k, v, dout = _sequence(s=24, dtype=torch.bfloat16, seed=2)
    got_out, got_lse, got_grads = _ring(3, layout, q, k, v, dout, **options)
    want_out, want_lse, want_grads = _want(q, k, v, dout, **options)
    _close(got_out, want_out, 3e-2, "out")
    _close(got_lse, want_lse, 1e-5, "lse")
    for name, got, want in zip(("dq", "dk", "dv"), got_grads, want_grads):
        _close(got, want, 6e-2, name)


@needs_torch
def test_simulated_ring_pads_a_head_dim_not_a_multiple_of_8(on_host):
    q, k, v, dout = _sequence(s=16, d=20)
    got_out, _, got_grads = _ring(2, "zigzag", q, k, v, dout, causal=True)
    want_out, _, want_grads = _want(q, k, v, dout, causal=True)
    assert got_out.shape == want_out.shape and got_grads[0].shape == q.shape
    _close(got_out, want_out, 4e-3, "out")
    for name, got, want in zip(("dq", "dk", "dv"), got_grads, want_grads):
        _close(got, want, 1e-2, name)


@needs_torch
def test_one_rank_is_plain_attention(on_host):
    q, k, v, dout = _sequence(s=10)
    got_out, got_lse, got_grads = _ring(1, "contiguous", q, k, v, dout, causal=True)
    want_out, want_lse, want_grads = _want(q, k, v, dout, causal=True)
    _close(got_out, want_out, 4e-3, "out")
    for got, want in zip(got_grads, want_grads):
        _close(got, want, 1e-2, "grads")


@needs_torch
def test_errors_name_the_argument():
    q, k, v, _ = _sequence(s=12)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        cfd.ring_attention_local([q], [k], [v], alibi_slopes=torch.ones(4))
    with pytest.raises(ValueError, match=r"k, v: each rank holds the keys of its own queries"):
        cfd.ring_attention_local([q], [k[:, :6]], [v[:, :6]])
    with pytest.raises(ValueError, match="must be even"):
        cfd.ring_attention_local([q[:, :5]], [k[:, :5]], [v[:, :5]], layout="zigzag")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        cfd.ring_attention(q, k, v)


@needs_torch
def test_cuflash_torch_distributed_names_this_module():
    import importlib
    import cuflash.torch
    assert cuflash.torch.distributed is cfd
    assert importlib.import_module("cuflash.torch.distributed") is cfd


# --------------------------------------------------------------------------------------------
# Real processes: torch.distributed over gloo, each process with the same host launches
# --------------------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank, world, port, layout, causal, result_dir):
    """One process of the gloo ring: checks its shard of out, lse and the gradients against the float64
    reference on the whole sequence, and writes 'ok' or the error to its file."""
    import traceback
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
        torch.set_num_threads(1)
        with pytest.MonkeyPatch.context() as mp:
            _install_host(mp)
            q, k, v, dout = _sequence(s=8 * world)
            want_out, want_lse, want_grads = _want(q, k, v, dout, causal=causal)
            mine = lambda x: cfd.shard(x, layout=layout).requires_grad_()  # noqa: E731
            ql, kvl = mine(q), mine(torch.stack([k, v], dim=2))  # k and v as views of a packed kv (strided)
            out, lse = cfd.ring_attention(ql, kvl[:, :, 0], kvl[:, :, 1], causal=causal, layout=layout,
                                          return_lse=True)
            out.backward(cfd.shard(dout, layout=layout))
            where = torch.tensor(ring.positions(layout, world, rank, q.shape[1] // world))
            _close(out.detach().double().numpy(), want_out[:, where], 4e-3, "out")
            _close(lse.double().numpy(), want_lse[:, :, where], 1e-5, "lse")
            for name, grad, want in zip(("dq", "dk", "dv"), (ql.grad, kvl.grad[:, :, 0], kvl.grad[:, :, 1]),
                                        want_grads):
                _close(grad.double().numpy(), want[:, where], 1e-2, name)
        torch.distributed.destroy_process_group()
        message = "ok"
    except BaseException:  # noqa: BLE001  (reported through the file)
        message = traceback.format_exc()
    with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
        f.write(message)


def _install_host(monkeypatch):
    """test_torch_cpu's on_host fixture body, called outside pytest's fixture machinery."""
    import test_torch_cpu
    fixture = test_torch_cpu.on_host
    body = getattr(fixture, "__wrapped__", None) or fixture.__pytest_wrapped__.obj  # pytest >= 8.4, older
    body(monkeypatch)


@needs_torch
@pytest.mark.slow  # a process per rank, each importing torch
@pytest.mark.parametrize("world,layout,causal", [(2, "contiguous", False), (4, "zigzag", True)])
def test_gloo_ring_across_processes(tmp_path, world, layout, causal):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    torch.multiprocessing.spawn(_gloo_rank, args=(world, _free_port(), layout, causal, str(tmp_path)),
                                nprocs=world, join=True)
    for rank in range(world):
        assert (tmp_path / f"rank{rank}").read_text() == "ok", (tmp_path / f"rank{rank}").read_text()
