"""CUDA graphs: each cuflash.torch op captured in torch.cuda.graph, replayed on new data copied into the same
buffers (and new cache_seqlens, cu_seqlens and block_table values, which the kernels read from device memory), is
bitwise equal to an eager call on that data, replay after replay; a dropout call draws a new mask at each replay;
torch.compile(mode="reduce-overhead") of a decode step and of a forward; cuflash.jax under XLA's command buffers
equals the same jitted function without them.

Capture follows torch's recipe: a few eager calls on a side stream first (kernels compile, launches are planned,
anything kept across calls is allocated), then the capture, on torch's own capture stream.
"""
import gc
import os

import numpy as np
import pytest

from tests.fixtures import configure  # noqa: F401  (a fixture)

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

try:
    import torch
except ImportError:
    torch = None
try:
    import jax
    import jax.numpy as jnp
except ImportError:
    jax = jnp = None

pytestmark = pytest.mark.gpu
needs_torch = pytest.mark.skipif(torch is None, reason="No module named 'torch'")


# --------------------------------------------------------------------------------------------
# Capture, replay, compare
# --------------------------------------------------------------------------------------------

def _warm_up(step, calls=2):
    """`step()` a few times on a side stream, as torch prescribes before a capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(calls):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def _capture(step, stream=None, warm_up=True):
    """(graph, what `step()` returned while captured): its outputs, which every replay rewrites."""
    if warm_up:
        _warm_up(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outputs = step()
    return graph, outputs


def _assert_bitwise(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, got.dtype, want.shape, want.dtype)
    if got.dtype == torch.float8_e4m3fn:  # compared as bits
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    if not torch.equal(got, want):
        diff = (got.float() - want.float()).abs()
        raise AssertionError(f"{what}: {int((got != want).sum())} of {got.numel()} elements differ, max |diff| "
                             f"{diff.nan_to_num(float('inf')).max().item():.3g}; NaN {int(got.isnan().sum())} "
                             f"(want {int(want.isnan().sum())}), shape {tuple(got.shape)}")


def _assert_close(got, want, what, rel=1e-2):
    """Within `rel` of want's largest magnitude: for gradients whose dQ is summed by atomics in an order that changes
    from run to run (the backward's default mode), so that no two runs, eager or replayed, need agree bitwise."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    err = (got.float() - want.float()).abs().max().item()
    scale = max(1.0, want.float().abs().max().item())
    assert err <= rel * scale, f"{what}: max |diff| {err:.3g} > {rel} x {scale:.3g}"


def _generator(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _randn(gen, shape, dtype):
    if dtype == torch.float8_e4m3fn:  # an e4m3 cache: normal values, rounded
        return torch.randn(shape, device="cuda", generator=gen).to(dtype)
    return torch.randn(shape, device="cuda", dtype=dtype, generator=gen)


def _refill(gen, *tensors):
    """New random values in the same buffers (the static inputs of a captured graph)."""
    with torch.no_grad():
        for t in tensors:
            t.copy_(_randn(gen, t.shape, t.dtype))


# --------------------------------------------------------------------------------------------
# attention: forward, and forward + backward
# --------------------------------------------------------------------------------------------

# dtype, batch, seqlen_q, seqlen_k, heads, kv heads, head dim, causal: off the tile grid, GQA, sq != sk; d 128 bf16
# runs the Hopper kernel on sm_90a (the default kernels there at d 64 too; "portable" switches them off)
FORWARD_CASES = [
    ("float16", 2, 97, 97, 4, 2, 64, False),
    ("float16", 2, 97, 130, 4, 2, 64, True),
    ("bfloat16", 2, 200, 200, 8, 2, 128, True),
    ("bfloat16", 1, 1, 300, 4, 4, 128, False),
]


@needs_torch
@pytest.mark.parametrize("kernels", ["default", "portable"])
@pytest.mark.parametrize("case", FORWARD_CASES, ids=lambda c: "-".join(map(str, c)))
def test_forward_graph_replays_new_data(configure, case, kernels):
    import cuflash.torch
    if kernels == "portable":
        configure(sm90=False, bwd_sm90=False)
    dtype, b, sq, sk, h, hk, d, causal = case
    dt = getattr(torch, dtype)
    gen = _generator(0)
    q, k, v = _randn(gen, (b, sq, h, d), dt), _randn(gen, (b, sk, hk, d), dt), _randn(gen, (b, sk, hk, d), dt)

    def step():
        return cuflash.torch.attention(q, k, v, causal=causal, return_lse=True)

    graph, (out, lse) = _capture(step)
    for trial in range(2):
        _refill(gen, q, k, v)
        want, want_lse = step()
        graph.replay()
        _assert_bitwise(out, want, f"out, trial {trial}")
        _assert_bitwise(lse, want_lse, f"lse, trial {trial}")
        first = out.clone()
        graph.replay()
        _assert_bitwise(out, first, f"out, trial {trial}, second replay")


@needs_torch
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic_dq"])
@pytest.mark.parametrize("case", [("bfloat16", 2, 97, 97, 4, 2, 64), ("float16", 1, 97, 130, 4, 2, 64),
                                  ("bfloat16", 2, 200, 200, 8, 2, 128)], ids=lambda c: "-".join(map(str, c)))
def test_forward_backward_graph_replays_new_data(case, deterministic):
    """Whole-step capture (torch's recipe for a network): gradients set to None before the capture, forward and
    backward in the graph, whose replays then write the same gradient tensors."""
    import cuflash.torch
    dtype, b, sq, sk, h, hk, d = case
    dt = getattr(torch, dtype)
    gen = _generator(1)
    q = _randn(gen, (b, sq, h, d), dt).requires_grad_()
    k, v = (_randn(gen, (b, sk, hk, d), dt).requires_grad_() for _ in range(2))
    dout = _randn(gen, q.shape, dt)

    def step(q=q, k=k, v=v):
        for x in (q, k, v):
            x.grad = None
        out = cuflash.torch.attention(q, k, v, causal=True, deterministic=deterministic)
        out.backward(dout)
        return out

    graph, out = _capture(step)
    grads = (q.grad, k.grad, v.grad)  # allocated in the capture: the graph's own
    # deterministic: bitwise. The default mode adds dQ with atomics in an order that varies from run to run, so
    # there the gradients are compared within a tolerance; the forward is compared bitwise either way.
    check = _assert_bitwise if deterministic else _assert_close
    for trial in range(2):
        _refill(gen, q, k, v, dout)
        eager = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        want = [step(*eager).detach(), *(x.grad for x in eager)]
        graph.replay()
        got = [out.detach().clone(), *(g.clone() for g in grads)]
        _assert_bitwise(got[0], want[0], f"out, trial {trial}")
        for name, g, w in zip(("dq", "dk", "dv"), got[1:], want[1:]):
            check(g, w, f"{name}, trial {trial}")
        graph.replay()
        for name, g, w in zip(("out", "dq", "dk", "dv"), (out.detach(), *grads), got):
            check(g, w, f"{name}, trial {trial}, second replay")


# --------------------------------------------------------------------------------------------
# Dropout: the seed and offset drawn on the device at each replay
# --------------------------------------------------------------------------------------------

@needs_torch
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
def test_dropout_graph_draws_a_new_mask_per_replay(backward, monkeypatch):
    """A torch dropout call captured in a CUDA graph draws its mask's seed and offset on the device, from torch's
    generator, at every replay: two replays drop differently, torch.manual_seed before a replay repeats it
    bitwise, and a replay equals the CuPy API's call with the seed and offset it drew (the gradients too, in
    deterministic mode)."""
    import cupy
    import cuflash
    import cuflash.torch as cft
    states = []  # the state tensors the capture draws into (the graph rewrites them at each replay)
    draw = cft._device_dropout_state
    monkeypatch.setattr(cft, "_device_dropout_state", lambda *a: states.append(draw(*a)) or states[-1])
    gen = _generator(7)
    q, k, v, dout = (_randn(gen, (2, 97, 4, 64), torch.bfloat16) for _ in range(4))
    leaves = [x.clone().requires_grad_(backward) for x in (q, k, v)]

    def step():
        out = cft.attention(*leaves, causal=True, dropout_p=0.3, deterministic=True)
        if backward:
            out.backward(dout)
        return out

    _warm_up(step)
    for x in leaves:
        x.grad = None  # the captured backward allocates the gradients in the graph's pool
    graph, out = _capture(step, warm_up=False)
    assert len(states) == 1, "one state drawn in the capture, none in the eager warm-up"

    def replay():
        graph.replay()
        torch.cuda.synchronize()
        grads = [x.grad.clone() for x in leaves] if backward else []
        return out.clone(), grads, tuple(states[0].tolist())

    torch.manual_seed(11)
    first, first_grads, (seed, offset) = replay()
    second, _, state = replay()
    assert state != (seed, offset) and not torch.equal(first, second), "a new mask at each replay"
    torch.manual_seed(11)
    again, again_grads, state = replay()
    assert state == (seed, offset)
    _assert_bitwise(again, first, "the same seed before the replay")
    for g, w in zip(again_grads, first_grads):
        _assert_bitwise(g, w, "the same seed before the replay")

    cq, ck, cv, cdout = (cupy.from_dlpack(x.detach()) for x in (q, k, v, dout))
    drop = dict(causal=True, dropout_p=0.3, dropout_seed=seed, dropout_offset=offset)
    want, lse = cuflash.attention(cq, ck, cv, return_lse=True, **drop)
    cupy.cuda.runtime.deviceSynchronize()
    bits = lambda x: torch.from_dlpack(x.view(cupy.int16))  # noqa: E731  (bf16 as its 16-bit patterns)
    _assert_bitwise(first.view(torch.int16), bits(want), "the CuPy API with the replay's seed and offset")
    if backward:
        want_grads = cuflash.attention_backward(cdout, cq, ck, cv, want, lse, deterministic=True, **drop)
        cupy.cuda.runtime.deviceSynchronize()
        for g, w in zip(first_grads, want_grads):
            _assert_bitwise(g.view(torch.int16), bits(w), "the CuPy API's gradients")


# --------------------------------------------------------------------------------------------
# attention_varlen: forward + backward; new cu_seqlens values between replays
# --------------------------------------------------------------------------------------------

LENS_Q, LENS_K = (97, 1, 0, 130, 17), (130, 33, 5, 130, 17)
# the same totals and maxima (the grid and every buffer stay valid), other sequence boundaries
LENS_Q2, LENS_K2 = (130, 17, 97, 1, 0), (130, 17, 130, 33, 5)


def _cu(lens):
    return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")


@needs_torch
@pytest.mark.parametrize("d", [64, 128])
def test_varlen_graph_replays_new_data_and_new_cu_seqlens(d):
    import cuflash.torch
    assert sum(LENS_Q) == sum(LENS_Q2) and max(LENS_Q) == max(LENS_Q2)
    assert sum(LENS_K) == sum(LENS_K2) and max(LENS_K) == max(LENS_K2)
    gen = _generator(2)
    dt = torch.bfloat16
    q = _randn(gen, (sum(LENS_Q), 4, d), dt).requires_grad_()
    k, v = (_randn(gen, (sum(LENS_K), 2, d), dt).requires_grad_() for _ in range(2))
    dout = _randn(gen, q.shape, dt)
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)
    max_q, max_k = max(LENS_Q), max(LENS_K)

    def step(q=q, k=k, v=v):
        for x in (q, k, v):
            x.grad = None
        out, lse = cuflash.torch.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True,
                                                  deterministic=True)
        out.backward(dout)
        return out, lse

    graph, (out, lse) = _capture(step)
    grads = (q.grad, k.grad, v.grad)
    for trial, (lens_q, lens_k) in enumerate(((LENS_Q, LENS_K), (LENS_Q2, LENS_K2))):
        cu_q.copy_(_cu(lens_q))
        cu_k.copy_(_cu(lens_k))
        _refill(gen, q, k, v, dout)
        eager = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        want_out, want_lse = step(*eager)
        want = [want_out.detach(), want_lse, *(x.grad for x in eager)]
        graph.replay()
        got = [out.detach().clone(), lse.clone(), *(g.clone() for g in grads)]
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            _assert_bitwise(g, w, f"{name}, lengths {lens_q} / {lens_k}")
        graph.replay()
        for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), (out.detach(), lse, *grads), got):
            _assert_bitwise(g, w, f"{name}, lengths {lens_q} / {lens_k}, second replay")


# --------------------------------------------------------------------------------------------
# attention_with_kvcache: one decode step with append; new cache_seqlens (and block_table) values
# --------------------------------------------------------------------------------------------

KV_CASES = {
    # batch 1, 32/8 heads, d 128, 8k keys, the split count the heuristic picks: on sm_90a the TMA decode kernel,
    # which merges its splits itself on split counters
    "b1_8k": dict(dtype="bfloat16", b=1, h=32, hk=8, d=128, capacity=8192),
    "b1_8k_splits16": dict(dtype="bfloat16", b=1, h=32, hk=8, d=128, capacity=8192, num_splits=16),
    "contiguous_splits4_lse": dict(dtype="float16", b=3, h=8, hk=2, d=128, capacity=4096, num_splits=4,
                                   return_lse=True),
    "paged16_splits4": dict(dtype="bfloat16", b=3, h=8, hk=2, d=128, capacity=4096, page_size=16, num_splits=4),
    "paged256_splits4": dict(dtype="bfloat16", b=3, h=8, hk=2, d=128, capacity=4096, page_size=256, num_splits=4),
    "speculative_d64": dict(dtype="float16", b=2, h=8, hk=2, d=64, capacity=1024, sq=4, page_size=256),
    # an e4m3 cache (per-(batch, KV head) descales), split and paged
    "e4m3_splits4": dict(dtype="bfloat16", b=3, h=8, hk=2, d=128, capacity=4096, num_splits=4, e4m3=True),
    "e4m3_paged64_lse": dict(dtype="float16", b=2, h=16, hk=2, d=128, capacity=2048, page_size=64, e4m3=True,
                             return_lse=True),
}


class _Decode:
    """One decode step's static tensors (q, new k/v, caches, cache_seqlens, block_table) and the call on them."""

    def __init__(self, gen, dtype, b, h, hk, d, capacity, page_size=None, sq=1, num_splits=0, return_lse=False,
                 e4m3=False):
        dt = getattr(torch, dtype)
        self.gen, self.top = gen, capacity - sq  # the largest cache_seqlens that leaves room for the append
        self.options = dict(causal=True, num_splits=num_splits, return_lse=return_lse)
        if e4m3:  # the caches and new rows e4m3, with descales per (batch row, KV head)
            self.options.update(k_descale=torch.rand(b, hk, device="cuda", generator=gen) + 0.5,
                                v_descale=torch.rand(b, hk, device="cuda", generator=gen) + 0.5)
        kv_dt = torch.float8_e4m3fn if e4m3 else dt
        self.q = _randn(gen, (b, sq, h, d), dt)
        self.k, self.v = _randn(gen, (b, sq, hk, d), kv_dt), _randn(gen, (b, sq, hk, d), kv_dt)
        if page_size is None:
            self.table, cache_shape = None, (b, capacity, hk, d)
        else:
            pages = capacity // page_size
            self.table = torch.randperm(b * pages, device="cuda", generator=gen).to(torch.int32).view(b, pages)
            cache_shape = (b * pages, page_size, hk, d)
        self.k_cache, self.v_cache = _randn(gen, cache_shape, kv_dt), _randn(gen, cache_shape, kv_dt)
        self.lens = torch.full((b,), self.top, dtype=torch.int32, device="cuda")

    def __call__(self, k_cache=None, v_cache=None) -> tuple:
        import cuflash.torch
        result = cuflash.torch.attention_with_kvcache(
            self.q, self.k_cache if k_cache is None else k_cache, self.v_cache if v_cache is None else v_cache,
            k=self.k, v=self.v, cache_seqlens=self.lens, block_table=self.table, **self.options)
        return result if isinstance(result, tuple) else (result,)

    def new_step(self, trial: int) -> tuple:
        """New q, k, v, cache contents and cache_seqlens (the second trial: a full row and an empty one, and a new
        block table); returns copies of the starting caches."""
        _refill(self.gen, self.q, self.k, self.v, self.k_cache, self.v_cache)
        b = self.lens.shape[0]
        lens = torch.randint(0, self.top + 1, (b,), device="cuda", dtype=torch.int32, generator=self.gen)
        if trial == 1:
            lens[0] = self.top
            if b > 1:
                lens[-1] = 0
            if self.table is not None:
                perm = torch.randperm(self.table.numel(), device="cuda", generator=self.gen).to(torch.int32)
                self.table.copy_(perm.view(self.table.shape))
        self.lens.copy_(lens)
        return self.k_cache.clone(), self.v_cache.clone()

    def eager(self, start):
        """An eager call from the starting caches: (its outputs, the caches after its append)."""
        k_cache, v_cache = (c.clone() for c in start)
        return self(k_cache, v_cache), (k_cache, v_cache)

    def check(self, outputs, want, what):
        want_outputs, (want_k, want_v) = want
        for name, got, w in zip(("out", "lse"), outputs, want_outputs):
            _assert_bitwise(got, w, f"{name}, {what}")
        _assert_bitwise(self.k_cache, want_k, f"k_cache, {what}")
        _assert_bitwise(self.v_cache, want_v, f"v_cache, {what}")


@needs_torch
@pytest.mark.parametrize("case", list(KV_CASES))
def test_kvcache_graph_replays_new_data_and_new_seqlens(case):
    step = _Decode(_generator(3), **KV_CASES[case])
    graph, outputs = _capture(step)
    for trial in range(2):
        start = step.new_step(trial)
        want = step.eager(start)
        graph.replay()
        step.check(outputs, want, f"trial {trial}, lens {step.lens.tolist()}")
        first = [o.clone() for o in outputs]
        for cache, s in zip((step.k_cache, step.v_cache), start):
            cache.copy_(s)
        graph.replay()
        step.check(outputs, (first, want[1]), f"trial {trial}, second replay")


@needs_torch
def test_kvcache_capture_leaves_no_allocation_behind():
    """Everything a captured split-KV call allocates (out, its split workspace and counters) is the graph's: once
    the graph and its outputs are gone, torch holds exactly the memory it held before the capture."""
    step = _Decode(_generator(4), **KV_CASES["b1_8k_splits16"])
    _warm_up(step)
    step()  # an eager call on this stream too: what cuflash keeps per stream exists before the baseline
    scratch = torch.zeros(1, device="cuda")  # torch's own first-capture state, allocated before the baseline
    first = torch.cuda.CUDAGraph()
    with torch.cuda.graph(first):
        scratch.add_(1)
    del first
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graph, outputs = _capture(step, warm_up=False)
    start = step.new_step(0)
    want = step.eager(start)
    graph.replay()
    step.check(outputs, want, "replay")
    del want, start
    gc.collect()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    assert held > 0  # the graph's outputs, at least
    del graph, outputs
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before, (
        f"{torch.cuda.memory_allocated() - before} bytes allocated during the capture outlive the graph")


@needs_torch
def test_kvcache_graphs_on_two_streams_keep_their_split_state_apart():
    """Two graphs of the same split-KV call (separate data and caches), captured on two streams and replayed on two
    other streams at once, round after round: each replay equals its eager result bitwise. Split counters or
    workspaces shared between the graphs would let one graph's CTAs count or merge the other's splits."""
    gen = _generator(5)
    steps = [_Decode(gen, **KV_CASES["b1_8k_splits16"]) for _ in range(2)]
    wants, graphs = [], []
    for step, capture_stream in zip(steps, (torch.cuda.Stream(), torch.cuda.Stream())):
        start = step.new_step(0)
        wants.append(step.eager(start))
        graph, outputs = _capture(step, stream=capture_stream)  # the warm-up appends again: same values, same rows
        graphs.append((graph, outputs))
        for cache, s in zip((step.k_cache, step.v_cache), start):
            cache.copy_(s)
    torch.cuda.synchronize()
    replay_streams = (torch.cuda.Stream(), torch.cuda.Stream())
    results = ([], [])
    for s in replay_streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(10):
        for (graph, outputs), s, got in zip(graphs, replay_streams, results):
            with torch.cuda.stream(s):
                graph.replay()  # appends the same keys at the same rows each round: the caches end as eager's
                got.append(outputs[0].clone())
    for s in replay_streams:
        torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    for i, (step, want, got) in enumerate(zip(steps, wants, results)):
        for n, out in enumerate(got):
            _assert_bitwise(out, want[0][0], f"graph {i}, round {n}")
        step.check([], want, f"graph {i}")


# --------------------------------------------------------------------------------------------
# torch.compile(mode="reduce-overhead"): inductor's CUDA graph trees
# --------------------------------------------------------------------------------------------

def _decode_layer(k_cache, v_cache, num_splits):
    """A decode step of one attention layer whose KV cache is two module buffers at fixed addresses (as a serving
    engine's preallocated cache; marked static so CUDA graph trees may mutate them in the graph)."""

    class DecodeLayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("k_cache", k_cache)
            self.register_buffer("v_cache", v_cache)
            for cache in (self.k_cache, self.v_cache):
                torch._dynamo.mark_static_address(cache)

        def forward(self, q, k, v, cache_seqlens):
            import cuflash.torch
            out = cuflash.torch.attention_with_kvcache(q * 0.5, self.k_cache, self.v_cache, k=k, v=v,
                                                       cache_seqlens=cache_seqlens, causal=True,
                                                       num_splits=num_splits)
            return out * 2  # scalings by powers of two: exact, so compiled and eager agree bitwise

    return DecodeLayer()


def _split_counter_state() -> str:
    """What the KV-cache op keeps per stream (cuflash.ops.decode.split_counters): a counter left non-zero by one call
    would make the next call on that stream merge its splits early. For the message of a failed comparison."""
    from cuflash.ops import decode
    torch.cuda.synchronize()
    state = {stream: int((buf != 0).sum()) for (_, stream), buf in decode._counters.items()}
    return (f"split counters per stream (non-zero entries): {state}; current stream "
            f"{torch.cuda.current_stream().cuda_stream:#x}")


def _run_reduce_overhead(compiled, eager, make_inputs, calls=5):
    """`compiled` (mode="reduce-overhead") and `eager` on the same new inputs, call after call: bitwise equal.
    Inductor warms up on the first call, records a CUDA graph on the second and replays it after; a skipped graph
    raises (cudagraph_or_error) and a recorded one shows in the tree manager."""
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config
    from torch._inductor.cudagraph_trees import get_manager
    counters.clear()
    with inductor_config.patch({"triton.cudagraph_or_error": True}):
        for n in range(calls):
            inputs = make_inputs(n)
            torch.compiler.cudagraph_mark_step_begin()
            got = compiled(*inputs).clone()  # the graph's output is rewritten by the next replay
            try:
                _assert_bitwise(got, eager(*inputs), f"call {n}")
            except AssertionError as e:
                raise AssertionError(f"{e}; {_split_counter_state()}") from None
    assert counters["inductor"]["cudagraph_skips"] == 0
    manager = get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    assert manager is not None and any(manager.roots.values()), "no CUDA graph was recorded"


@needs_torch
def test_reduce_overhead_decode_step_matches_eager():
    torch._dynamo.reset()
    gen = _generator(6)
    dt, b, capacity, h, hk, d = torch.bfloat16, 2, 1024, 8, 2, 128
    k_cache, v_cache = _randn(gen, (b, capacity, hk, d), dt), _randn(gen, (b, capacity, hk, d), dt)
    eager = _decode_layer(k_cache.clone(), v_cache.clone(), num_splits=4)
    model = _decode_layer(k_cache, v_cache, num_splits=4)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True, dynamic=False)

    def inputs(n):  # a token per step: the lengths grow, new q, k, v
        lens = torch.tensor([100 + n, 1000 + n], dtype=torch.int32, device="cuda")
        return _randn(gen, (b, 1, h, d), dt), _randn(gen, (b, 1, hk, d), dt), _randn(gen, (b, 1, hk, d), dt), lens

    try:
        _run_reduce_overhead(compiled, eager, inputs)
        _assert_bitwise(model.k_cache, eager.k_cache, "k_cache")
        _assert_bitwise(model.v_cache, eager.v_cache, "v_cache")
    finally:
        torch._dynamo.reset()  # frees the graphs' memory pool


@needs_torch
def test_reduce_overhead_forward_matches_eager():
    import cuflash.torch
    torch._dynamo.reset()
    gen = _generator(7)

    def f(q, k, v):
        return cuflash.torch.attention(q * 0.5, k, v, causal=True) * 2

    compiled = torch.compile(f, mode="reduce-overhead", fullgraph=True, dynamic=False)

    def inputs(n):
        return (_randn(gen, (2, 200, 8, 128), torch.bfloat16),
                *(_randn(gen, (2, 200, 2, 128), torch.bfloat16) for _ in range(2)))

    try:
        _run_reduce_overhead(compiled, f, inputs)
    finally:
        torch._dynamo.reset()


# --------------------------------------------------------------------------------------------
# JAX: jit and grad under XLA command buffers (CUDA graphs)
# --------------------------------------------------------------------------------------------

# Per-compilation XLA options (jax.jit's compiler_options; the same DebugOptions fields as XLA_FLAGS, checked by name
# and value when jit compiles). Command buffers for fusions, cuBLAS, cuDNN and custom calls, from one command up.
# cuflash's FFI handlers report no command-buffer trait, so XLA keeps their calls outside the graphs and runs them on
# a live stream between them; should they report it, XLA would trace them into the graphs instead.
COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUDNN,CUSTOM_CALL",
                   "xla_gpu_graph_min_graph_size": 1}
NO_COMMAND_BUFFERS = {"xla_gpu_enable_command_buffer": ""}  # an empty list: every command runs on the stream


@pytest.fixture(scope="module")
def jax_gpu():
    if jax is None:
        pytest.skip("No module named 'jax'")
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        devices = []
    if not devices:
        pytest.skip("JAX sees no GPU")
    return devices[0]


def _bits(x):
    a = np.asarray(x)
    return a.view(f"u{a.dtype.itemsize}")


def _jax_models():
    """name -> (function of (q, k, v, w): elementwise work, cuflash attention, elementwise work; inputs(seed))."""
    import cuflash.jax
    lens = (0, 1, 70, 200)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)

    def scaled(q):
        return (q.astype(jnp.float32) * 0.5).astype(q.dtype)

    def dense(q, k, v, w):
        out = cuflash.jax.attention(scaled(q), k, v, causal=True, deterministic=True)
        return jnp.tanh(out.astype(jnp.float32)) * w

    def varlen(q, k, v, w):
        out = cuflash.jax.attention_varlen(scaled(q), k, v, cu, cu, max(lens), max(lens), causal=True,
                                           deterministic=True)
        return jnp.tanh(out.astype(jnp.float32)) * w

    def inputs(shapes):
        def make(seed):
            keys = jax.random.split(jax.random.PRNGKey(seed), 4)
            dts = (jnp.bfloat16,) * 3 + (jnp.float32,)
            return tuple(jax.random.normal(key, s, jnp.float32).astype(dt) for key, s, dt in zip(keys, shapes, dts))
        return make

    n = sum(lens)
    return {"dense": (dense, inputs([(2, 97, 4, 64), (2, 97, 2, 64), (2, 97, 2, 64), (2, 97, 4, 64)])),
            "varlen": (varlen, inputs([(n, 4, 128), (n, 2, 128), (n, 2, 128), (n, 4, 128)]))}


@pytest.mark.parametrize("model", ["dense", "varlen"])
@pytest.mark.parametrize("what", ["forward", "grad"])
def test_jax_jit_under_command_buffers_matches_plain_run(jax_gpu, model, what):
    """The same function compiled with and without command buffers, called on new data each time: bitwise equal
    outputs (forward) or gradients (grad; deterministic backward)."""
    fn, inputs = _jax_models()[model]
    if what == "grad":
        fn = jax.grad(lambda q, k, v, w, fn=fn: jnp.sum(fn(q, k, v, w)), argnums=(0, 1, 2))
    with_graphs = jax.jit(fn, compiler_options=COMMAND_BUFFERS)
    plain = jax.jit(fn, compiler_options=NO_COMMAND_BUFFERS)
    for seed in range(4):
        args = inputs(seed)
        got, want = jax.tree.leaves(with_graphs(*args)), jax.tree.leaves(plain(*args))
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert g.shape == w.shape and g.dtype == w.dtype
            assert np.array_equal(_bits(g), _bits(w)), (
                f"{model} {what}, call {seed}, result {i}: {int((_bits(g) != _bits(w)).sum())} elements differ")
            assert np.isfinite(np.asarray(g, np.float32)).all()
