"""cuflash.flash_attn called the way flash-attn's own suite (tests/test_flash_attn.py) calls flash-attn.

Each case checks flash-attn's error rule: cuflash's error against a float64 reference is at most twice the error
of the same math computed in the inputs' dtype by PyTorch, plus a small floor. Parameters are sampled (not a full
cross product) to keep the file to well under a minute on a GPU: every function, packed and unpacked, GQA/MQA,
causal/local/ALiBi/softcap, head dims that are not multiples of 8 (59, 111, 200) beside 64/128, varlen with and
without block_table and seqused_k, the KV cache with appends, pages, cache_batch_idx, num_splits, rotary embedding
and cache_leftpad.
"""
import math

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

DTYPES = (torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------------------------
# Reference: attention in float64 (ref) or in the inputs' dtype (pt), as flash-attn's attention_ref
# --------------------------------------------------------------------------------------------

def _attention_ref(q, k, v, *, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                   softmax_scale=None, upcast=True, key_lengths=None):
    """(b, sq, h, d) attention with bottom-right masks; ``key_lengths`` (b,) keeps keys ``j < key_lengths[b]`` (and
    aligns the masks to that length). ``upcast``: float64; else the inputs' dtype, softmax in float32."""
    dtype = q.dtype
    if upcast:
        q, k, v = q.double(), k.double(), v.double()
    b, sq, h, d = q.shape
    sk, g = k.shape[1], h // k.shape[2]
    k, v = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    scale = 1 / math.sqrt(d) if softmax_scale is None else softmax_scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q * scale, k).float() if not upcast else \
        torch.einsum("bqhd,bkhd->bhqk", q * scale, k)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    lengths = torch.full((b,), sk, device=q.device) if key_lengths is None else key_lengths.to(q.device).long()
    i = torch.arange(sq, device=q.device)[None, :, None] + lengths[:, None, None] - sq  # query's key position
    j = torch.arange(sk, device=q.device)[None, None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.reshape(-1, h).expand(b, h).to(scores.dtype)
        scores = scores - slopes[:, :, None, None] * (i - j).abs()[:, None].to(scores.dtype)
    left, right = window_size
    right = 0 if causal else right
    visible = j < lengths[:, None, None]
    if right >= 0:
        visible = visible & (j <= i + right)
    if left >= 0:
        visible = visible & (j >= i - left)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no visible key: 0
    probs = probs if upcast else probs.to(dtype)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v).to(dtype if not upcast else torch.float64)


def _check(name, got, ref, pt, atol=1e-4):
    err, err_pt = (got.double() - ref).abs().max().item(), (pt.double() - ref).abs().max().item()
    assert err <= 2 * err_pt + atol, f"{name}: error {err:.3g} > 2 x PyTorch's {err_pt:.3g} + {atol}"


def _grads(fn, inputs, dout):
    """Gradients of fn(*inputs) . dout with respect to the inputs (leaf copies)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    out.backward(dout.to(out.dtype))
    return out, [x.grad for x in leaves]


def _randn(*shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)


def _check_fwd_bwd(fa_fn, fa_inputs, unpack, options, dtype, seed=99):
    """fa_fn(*fa_inputs) against the references of the unpacked q, k, v; gradients through ``unpack`` too."""
    q, k, v = unpack(*fa_inputs)
    dout = _randn(*q.shape, dtype=dtype, seed=seed)
    out, grads = _grads(fa_fn, fa_inputs, dout)
    ref, ref_grads = _grads(lambda *xs: _attention_ref(*xs, upcast=True, **options), (q.double(), k.double(),
                                                                                      v.double()), dout)
    pt, pt_grads = _grads(lambda *xs: _attention_ref(*xs, upcast=False, **options), (q, k, v), dout)
    _check("out", out, ref, pt)
    for name, got, r, p in zip(("dq", "dk", "dv"), unpack(*grads), ref_grads, pt_grads):
        _check(name, got, r, p, atol=3e-4)


# --------------------------------------------------------------------------------------------
# Dense: flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func
# --------------------------------------------------------------------------------------------

DENSE = [  # d, dtype, (seqlen_q, seqlen_k), (nheads, nheads_k), options
    (59, 0, (113, 203), (4, 4), dict(causal=True)),
    (111, 1, (128, 128), (6, 2), dict(window_size=(32, 8))),
    (200, 0, (97, 256), (4, 1), dict(softcap=30.0, causal=True)),
    (64, 1, (239, 113), (4, 2), dict(alibi=True)),
    (128, 0, (1, 239), (8, 8), dict(causal=True, window_size=(64, 0))),
    (40, 1, (17, 17), (2, 2), dict(softmax_scale=0.2)),
    (1, 0, (33, 65), (2, 2), {}),
    (256, 1, (64, 96), (4, 4), dict(causal=True)),
]


def _options(options, nheads, batch):
    options = dict(options)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.rand(batch, nheads, device="cuda", dtype=torch.float32) * 0.3
    return options


@pytest.mark.parametrize("d, dtype, seqlens, heads, options", DENSE)
def test_flash_attn_func(d, dtype, seqlens, heads, options):
    from cuflash.flash_attn import flash_attn_func
    dtype, (sq, sk), (h, hk) = DTYPES[dtype], seqlens, heads
    options = _options(options, h, 2)
    q, k, v = (_randn(2, s, n, d, dtype=dtype, seed=i) for i, (s, n) in enumerate(((sq, h), (sk, hk), (sk, hk))))
    _check_fwd_bwd(lambda q, k, v: flash_attn_func(q, k, v, deterministic=True, **options), (q, k, v),
                   lambda q, k, v: (q, k, v), options, dtype)


@pytest.mark.parametrize("d, dtype, causal", [(59, 0, True), (64, 1, False), (200, 1, True)])
def test_flash_attn_qkvpacked_func(d, dtype, causal):
    from cuflash.flash_attn import flash_attn_qkvpacked_func
    dtype = DTYPES[dtype]
    qkv = _randn(2, 150, 3, 4, d, dtype=dtype, seed=1)
    _check_fwd_bwd(lambda qkv: flash_attn_qkvpacked_func(qkv, causal=causal), (qkv,), lambda qkv: qkv.unbind(2),
                   dict(causal=causal), dtype)


@pytest.mark.parametrize("d, dtype, heads", [(111, 0, (6, 2)), (128, 1, (8, 1)), (59, 1, (4, 4))])
def test_flash_attn_kvpacked_func(d, dtype, heads):
    from cuflash.flash_attn import flash_attn_kvpacked_func
    dtype, (h, hk) = DTYPES[dtype], heads
    q, kv = _randn(2, 77, h, d, dtype=dtype, seed=2), _randn(2, 130, 2, hk, d, dtype=dtype, seed=3)
    options = dict(causal=True, softcap=20.0)
    _check_fwd_bwd(lambda q, kv: flash_attn_kvpacked_func(q, kv, **options), (q, kv),
                   lambda q, kv: (q, *kv.unbind(2)), options, dtype)


def test_return_attn_probs_and_lse():
    from cuflash.flash_attn import flash_attn_func
    q = _randn(2, 100, 4, 59, dtype=torch.float16, seed=4)
    out, lse, s_dmask = flash_attn_func(q, q, q, causal=True, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (2, 4, 100) and lse.dtype == torch.float32
    assert s_dmask.numel() == 0  # flash-attn gives the probabilities only with dropout
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), q.double()) / math.sqrt(59)
    scores = scores.masked_fill(torch.ones(100, 100, dtype=torch.bool, device="cuda").triu(1), float("-inf"))
    assert (lse.double() - scores.logsumexp(-1)).abs().max().item() < 1e-3


def test_dropout_follows_torch_manual_seed():
    """flash_attn_func's dropout_p draws its mask from torch's CUDA generator: a seed repeats the output and the
    gradients bitwise, and p = 0.3 changes the output."""
    from cuflash.flash_attn import flash_attn_func
    q = _randn(2, 70, 4, 64, dtype=torch.float16, seed=5).requires_grad_()

    def run(p):
        torch.manual_seed(11)
        q.grad = None
        out = flash_attn_func(q, q, q, dropout_p=p, causal=True)
        out.float().square().sum().backward()
        return out.detach(), q.grad.clone()

    out1, grad1 = run(0.3)
    out2, grad2 = run(0.3)
    plain, _ = run(0.0)
    assert torch.equal(out1, out2) and torch.equal(grad1, grad2)
    assert torch.isfinite(grad1).all()
    assert (out1.float() - plain.float()).abs().max().item() > 1e-2


# --------------------------------------------------------------------------------------------
# Varlen
# --------------------------------------------------------------------------------------------

def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _varlen_ref_check(out, grads, q, k, v, cu_q, cu_k, dout, options):
    """Per sequence: float64 and low-precision references with batch 1, flash-attn's rule on the worst sequence."""
    errs = {}
    for b in range(len(cu_q) - 1):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if sq.stop == sq.start:  # no queries: nothing to compare (its keys' gradients are zero)
            continue
        opts = dict(options)
        if opts.get("alibi_slopes") is not None:
            opts["alibi_slopes"] = opts["alibi_slopes"][b]
        part = [x[sq][None] if i == 0 else x[sk][None] for i, x in enumerate((q, k, v))]
        d = dout[sq][None]
        ref, ref_grads = _grads(lambda *xs: _attention_ref(*xs, upcast=True, **opts), [x.double() for x in part], d)
        pt, pt_grads = _grads(lambda *xs: _attention_ref(*xs, upcast=False, **opts), part, d)
        got = [out[sq]] + ([] if grads is None else [grads[0][sq], grads[1][sk], grads[2][sk]])
        for name, g, r, p in zip(("out", "dq", "dk", "dv"), got, [ref, *ref_grads], [pt, *pt_grads]):
            e, e_pt = (g[None].double() - r).abs().max().item(), (p.double() - r).abs().max().item()
            worst = errs.get(name, (0.0, 0.0))
            errs[name] = (max(worst[0], e), max(worst[1], e_pt))
    for name, (e, e_pt) in errs.items():
        atol = 1e-4 if name == "out" else 3e-4
        assert e <= 2 * e_pt + atol, f"{name}: error {e:.3g} > 2 x PyTorch's {e_pt:.3g} + {atol}"


VARLEN = [  # d, dtype, query lengths, key lengths, (nheads, nheads_k), options
    (59, 0, (1, 17, 113), (1, 40, 113), (4, 2), dict(causal=True)),
    (64, 1, (64, 0, 97), (128, 5, 97), (4, 4), dict(window_size=(16, 16))),
    (111, 1, (33, 200), (33, 150), (6, 1), dict(alibi=True, causal=True)),
    (128, 0, (256,), (256,), (2, 2), dict(softcap=10.0)),
]


@pytest.mark.parametrize("d, dtype, lens_q, lens_k, heads, options", VARLEN)
def test_flash_attn_varlen_func(d, dtype, lens_q, lens_k, heads, options):
    from cuflash.flash_attn import flash_attn_varlen_func
    dtype, (h, hk) = DTYPES[dtype], heads
    options = _options(options, h, len(lens_q))
    q = _randn(sum(lens_q), h, d, dtype=dtype, seed=6)
    k, v = (_randn(sum(lens_k), hk, d, dtype=dtype, seed=s) for s in (7, 8))
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    dout = _randn(*q.shape, dtype=dtype, seed=9)
    out, grads = _grads(lambda q, k, v: flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                               **options), (q, k, v), dout)
    _varlen_ref_check(out, grads, q, k, v, cu_q, cu_k, dout, options)


@pytest.mark.parametrize("d, dtype", [(59, 1), (128, 0)])
def test_flash_attn_varlen_packed(d, dtype):
    from cuflash.flash_attn import flash_attn_varlen_kvpacked_func, flash_attn_varlen_qkvpacked_func
    dtype = DTYPES[dtype]
    lens = (17, 1, 130)
    cu = _cu(lens)
    qkv = _randn(sum(lens), 3, 4, d, dtype=dtype, seed=10)
    dout = _randn(sum(lens), 4, d, dtype=dtype, seed=11)
    out, (dqkv,) = _grads(lambda qkv: flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True), (qkv,), dout)
    assert dqkv.shape == qkv.shape
    _varlen_ref_check(out, dqkv.unbind(1), *qkv.unbind(1), cu, cu, dout, dict(causal=True))

    lens_k = (40, 9, 130)
    cu_k = _cu(lens_k)
    q, kv = _randn(sum(lens), 4, d, dtype=dtype, seed=12), _randn(sum(lens_k), 2, 2, d, dtype=dtype, seed=13)
    out, (dq, dkv) = _grads(lambda q, kv: flash_attn_varlen_kvpacked_func(q, kv, cu, cu_k, max(lens), max(lens_k),
                                                                          window_size=[8, 0]), (q, kv), dout)
    assert dkv.shape == kv.shape
    _varlen_ref_check(out, (dq, *dkv.unbind(1)), q, *kv.unbind(1), cu, cu_k, dout, dict(window_size=(8, 0)))


def _paged(k, lens, page_size, seed):
    """A page pool holding the packed sequences of ``k`` (total, hk, d) in shuffled pages, and its block table."""
    pages_per_seq = max(-(-n // page_size) for n in lens)
    num_pages = pages_per_seq * len(lens) + 3
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    table = order[:pages_per_seq * len(lens)].reshape(len(lens), pages_per_seq).to(torch.int32).cuda()
    pool = _randn(num_pages, page_size, *k.shape[1:], dtype=k.dtype, seed=seed)
    start = 0
    for b, n in enumerate(lens):
        for p in range(n):
            pool[table[b, p // page_size], p % page_size] = k[start + p]
        start += n
    return pool, table


@pytest.mark.parametrize("page_size", [16, 256])
def test_flash_attn_varlen_func_block_table(page_size):
    """Chunked prefill against a page pool: queries of each sequence attend to its keys in the pool."""
    from cuflash.flash_attn import flash_attn_varlen_func
    lens_q, lens_k = (5, 64, 1), (300, 64, 77)
    q = _randn(sum(lens_q), 8, 128, dtype=torch.bfloat16, seed=14)
    k, v = (_randn(sum(lens_k), 2, 128, dtype=torch.bfloat16, seed=s) for s in (15, 16))
    k_pool, table = _paged(k, lens_k, page_size, 17)
    v_pool, _ = _paged(v, lens_k, page_size, 17)  # the same seed: the same block table
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out = flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                 block_table=table)
    dout = torch.zeros_like(q)
    _varlen_ref_check(out, None, q, k, v, cu_q, cu_k, dout, dict(causal=True))


def test_flash_attn_varlen_func_seqused_k():
    from cuflash.flash_attn import flash_attn_varlen_func
    lens_q, lens_k = (3, 16), (50, 20)
    q = _randn(sum(lens_q), 4, 64, dtype=torch.float16, seed=18)
    k, v = (_randn(sum(lens_k), 4, 64, dtype=torch.float16, seed=s) for s in (19, 20))
    k_pool, table = _paged(k, lens_k, 16, 21)
    v_pool, _ = _paged(v, lens_k, 16, 21)
    seqused = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    out = flash_attn_varlen_func(q, k_pool, v_pool, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k), causal=True,
                                 block_table=table, seqused_k=seqused)
    _varlen_ref_check(out, None, q, k, v, _cu(lens_q), _cu(lens_k), torch.zeros_like(q), dict(causal=True))


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------

def _rotate(x, cos, sin, positions, interleaved):
    """flash-attn's rotary embedding of x (b, s, h, d) at ``positions`` (b, s): the first 2 * cos.shape[1] dims."""
    half = cos.shape[1]
    c, s = cos[positions][:, :, None].double(), sin[positions][:, :, None].double()
    x = x.double()
    rot, rest = x[..., :2 * half], x[..., 2 * half:]
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)
    else:
        a, b = rot[..., :half], rot[..., half:]
        rot = torch.cat((a * c - b * s, a * s + b * c), -1)
    return torch.cat((rot, rest), -1)


def _kvcache_case(d, dtype, *, batch=3, seqlen_q=1, seqlen_new=1, cache_len=300, h=8, hk=2, paged=None,
                  batch_idx=False, seed=30):
    """Inputs of a KV-cache call, and the cache's logical content per batch row (batch, cache_len, hk, d)."""
    q = _randn(batch, seqlen_q, h, d, dtype=dtype, seed=seed)
    k, v = (_randn(batch, seqlen_new, hk, d, dtype=dtype, seed=seed + i) for i in (1, 2))
    logical_k, logical_v = (_randn(batch, cache_len, hk, d, dtype=dtype, seed=seed + i) for i in (3, 4))
    extra = {}
    if paged:
        pages = -(-cache_len // paged)
        table = torch.randperm(batch * pages + 2, generator=torch.Generator().manual_seed(seed))[:batch * pages]
        table = table.reshape(batch, pages).to(torch.int32).cuda()
        k_cache = torch.zeros(batch * pages + 2, paged, hk, d, dtype=dtype, device="cuda")
        v_cache = torch.zeros_like(k_cache)
        for b in range(batch):
            for p in range(pages):
                rows = slice(p * paged, min((p + 1) * paged, cache_len))
                n = rows.stop - rows.start
                k_cache[table[b, p], :n], v_cache[table[b, p], :n] = logical_k[b, rows], logical_v[b, rows]
        extra["block_table"] = table
    elif batch_idx:
        perm = torch.tensor([2, 0, 1][:batch], dtype=torch.int32, device="cuda")
        k_cache, v_cache = torch.empty_like(logical_k), torch.empty_like(logical_v)
        k_cache[perm.long()], v_cache[perm.long()] = logical_k, logical_v
        extra["cache_batch_idx"] = perm
    else:
        k_cache, v_cache = logical_k.clone(), logical_v.clone()
    return q, k_cache, v_cache, k, v, logical_k, logical_v, extra


def _kvcache_check(out, q, logical_k, logical_v, k, v, cache_seqlens, options, leftpad=None):
    """flash-attn's rule for out, against the float64 and low-precision references over each row's keys."""
    lengths = cache_seqlens + (0 if k is None else k.shape[1])
    full_k, full_v = logical_k.clone(), logical_v.clone()
    if k is not None:
        for b in range(q.shape[0]):
            n = int(cache_seqlens[b])
            full_k[b, n:n + k.shape[1]], full_v[b, n:n + k.shape[1]] = k[b], v[b]
    if leftpad is not None:  # keys before leftpad[b] are not part of row b's sequence
        for b in range(q.shape[0]):
            p = int(leftpad[b])
            full_k[b], full_v[b] = full_k[b].roll(-p, 0), full_v[b].roll(-p, 0)
        lengths = lengths - leftpad
    ref = _attention_ref(q.double(), full_k.double(), full_v.double(), upcast=True, key_lengths=lengths, **options)
    pt = _attention_ref(q, full_k, full_v, upcast=False, key_lengths=lengths, **options)
    _check("out", out, ref, pt)


KVCACHE = [  # d, dtype, layout, seqlen_q, seqlen_new, num_splits, options
    (59, 0, "contiguous", 1, 1, 0, dict(causal=True)),
    (128, 1, "paged16", 4, 4, 0, dict(causal=True)),
    (111, 0, "batch_idx", 1, 0, 3, dict(window_size=(64, 0))),
    (64, 1, "paged256", 2, 2, 1, dict(softcap=15.0, causal=True)),
    (200, 1, "contiguous", 1, 1, 0, dict(alibi=True)),
    (256, 0, "paged16", 1, 1, 4, {}),
]


@pytest.mark.parametrize("d, dtype, layout, seqlen_q, seqlen_new, num_splits, options", KVCACHE)
def test_flash_attn_with_kvcache(d, dtype, layout, seqlen_q, seqlen_new, num_splits, options):
    from cuflash.flash_attn import flash_attn_with_kvcache
    dtype = DTYPES[dtype]
    options = _options(options, 8, 3)
    paged = int(layout[5:]) if layout.startswith("paged") else None
    q, k_cache, v_cache, k, v, logical_k, logical_v, extra = _kvcache_case(
        d, dtype, seqlen_q=seqlen_q, seqlen_new=max(seqlen_new, 1), paged=paged, batch_idx=layout == "batch_idx")
    if not seqlen_new:
        k = v = None
    cache_seqlens = torch.tensor([0, 17, 299 - seqlen_new], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, num_splits=num_splits,
                                       return_softmax_lse=True, **extra, **options)
    assert lse.shape == (3, 8, seqlen_q) and lse.dtype == torch.float32
    _kvcache_check(out, q, logical_k, logical_v, k, v, cache_seqlens, options)
    if k is not None:  # the new keys are in the caller's cache
        if paged:
            b, pos = 1, 17
            row = k_cache[extra["block_table"][b, pos // paged], pos % paged]
        else:
            b = 1
            row = k_cache[int(extra["cache_batch_idx"][b]) if layout == "batch_idx" else b, 17]
        assert torch.equal(row, k[b, 0])


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_with_kvcache_rotary(interleaved, causal):
    from cuflash.flash_attn import flash_attn_with_kvcache
    d, rotary_dim, dtype = 128, 64, torch.float16
    q, k_cache, v_cache, k, v, logical_k, logical_v, extra = _kvcache_case(d, dtype, seqlen_q=3, seqlen_new=3)
    cache_seqlens = torch.tensor([0, 40, 200], dtype=torch.int32, device="cuda")
    angle = torch.rand(512, rotary_dim // 2, device="cuda", dtype=torch.float64) * 2 * math.pi
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=cos, rotary_sin=sin,
                                  cache_seqlens=cache_seqlens, causal=causal, rotary_interleaved=interleaved)
    positions = cache_seqlens.long()[:, None] + torch.arange(3, device="cuda")
    q_positions = positions if causal else cache_seqlens.long()[:, None].expand(-1, 3)
    q_rot = _rotate(q, cos, sin, q_positions, interleaved).to(dtype)
    k_rot = _rotate(k, cos, sin, positions, interleaved).to(dtype)
    _kvcache_check(out, q_rot, logical_k, logical_v, k_rot, v, cache_seqlens, dict(causal=causal))
    assert torch.allclose(k_cache[1, 40:43].double(), k_rot[1].double(), atol=1e-2)


def test_flash_attn_with_kvcache_leftpad():
    from cuflash.flash_attn import flash_attn_with_kvcache
    q, k_cache, v_cache, k, v, logical_k, logical_v, extra = _kvcache_case(64, torch.bfloat16, seqlen_new=2)
    cache_seqlens = torch.tensor([10, 100, 250], dtype=torch.int32, device="cuda")
    leftpad = torch.tensor([0, 30, 249], dtype=torch.int32, device="cuda")
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, cache_leftpad=leftpad,
                                  causal=True)
    _kvcache_check(out, q, logical_k, logical_v, k, v, cache_seqlens, dict(causal=True), leftpad=leftpad)
