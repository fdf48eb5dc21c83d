"""cuflash.flash_attn and head dims that are not multiples of 8, without a GPU.

The launches of cuflash.torch are swapped for cuflash.reference on CPU tensors (test_torch_cpu's ``on_host``), so
everything between flash-attn's names and the launch runs as on a GPU: argument mapping, packed views, the
zero-padding of odd head dims and its autograd, the KV-cache copy-back, the return conventions and the errors.
Results are compared with float64 math on the caller's (unpadded) tensors.
"""
import inspect
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import cuflash.torch  # noqa: E402
from cuflash import api, reference  # noqa: E402
from cuflash import flash_attn as fa  # noqa: E402
from test_torch_cpu import on_host  # noqa: E402,F401  (a fixture)

TOL = {torch.float16: 3e-3, torch.bfloat16: 2.5e-2}


def _rand(*shape, dtype=torch.float16, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_(requires_grad)


def _f64(t):
    return None if t is None else t.detach().double().numpy()


def _close(got, want, tol, what):
    err = np.abs(got.detach().double().numpy() - want).max()
    assert err < tol, f"{what}: max error {err} > {tol}"


def _dense_case(d, dtype=torch.float16, b=2, sq=9, sk=13, h=4, hk=2):
    return tuple(_rand(b, s, n, d, dtype=dtype, seed=i, requires_grad=True)
                 for i, (s, n) in enumerate(((sq, h), (sk, hk), (sk, hk))))


def _check_dense(q, k, v, out, lse, grads, options):
    """out, lse and dq, dk, dv (from dout = 1) against the float64 reference of the unpadded call."""
    tol = TOL[q.dtype]
    ref_out, ref_lse = reference.attention(_f64(q), _f64(k), _f64(v), return_lse=True, **options)
    _close(out, ref_out, tol, "out")
    if lse is not None:
        _close(lse, ref_lse, 1e-4 if q.dtype == torch.float16 else 1e-2, "lse")
    if grads is not None:
        dout = np.ones(ref_out.shape)
        want = reference.attention_backward(dout, _f64(q), _f64(k), _f64(v), ref_out, ref_lse, **options)
        for name, g, w in zip(("dq", "dk", "dv"), grads, want):
            _close(g, w, 8 * tol * max(1.0, np.abs(w).max()), name)


# --------------------------------------------------------------------------------------------
# Dense: flash_attn_func, qkvpacked, kvpacked
# --------------------------------------------------------------------------------------------

OPTIONS = [dict(causal=True), dict(window_size=(5, 2)), dict(causal=True, softcap=3.0), dict(alibi=True),
           dict(softmax_scale=0.3)]


@pytest.mark.parametrize("d", [59, 111, 200, 64])
@pytest.mark.parametrize("case", range(len(OPTIONS)))
def test_flash_attn_func_matches_float64(on_host, d, case):
    options = dict(OPTIONS[case])
    dtype = torch.bfloat16 if case % 2 else torch.float16
    q, k, v = _dense_case(d, dtype)
    slopes = torch.tensor([0.3, 0.1, 0.5, 0.2]) if options.pop("alibi", False) else None
    out, lse, s_dmask = fa.flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True, **options)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (2, 4, 9) and lse.dtype == torch.float32
    assert s_dmask.shape == (0,) and s_dmask.dtype == dtype and not lse.requires_grad
    out.sum().backward()
    _check_dense(q, k, v, out, lse, (q.grad, k.grad, v.grad), dict(options, alibi_slopes=_f64(slopes)))
    assert q.grad.shape == q.shape and k.grad.shape == k.shape
    # a padded launch gets the caller's default scale, 1 / sqrt(d); others get the scale as given
    scale = options.get("softmax_scale", 1 / math.sqrt(d) if d % 8 else None)
    assert on_host[0][1]["softmax_scale"] == (None if scale is None else pytest.approx(scale))


@pytest.mark.parametrize("d", [59, 64])
def test_qkvpacked_takes_views_and_returns_one_gradient(on_host, monkeypatch, d):
    qkv = _rand(2, 11, 3, 4, d, requires_grad=True)
    seen = []
    attention = cuflash.flash_attn.attention
    monkeypatch.setattr(cuflash.flash_attn, "attention", lambda *a, **kw: seen.append(a) or attention(*a, **kw))
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True, deterministic=True)
    q, k, v = seen[0]
    assert all(x._base is qkv and x.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
               for x in (q, k, v))  # views, no copies
    assert k.data_ptr() - q.data_ptr() == 4 * d * qkv.element_size()
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape
    _check_dense(q, k, v, out, None, (qkv.grad[:, :, 0], qkv.grad[:, :, 1], qkv.grad[:, :, 2]), dict(causal=True))
    assert on_host[1][1]["deterministic"] is True


@pytest.mark.parametrize("d", [111, 64])
def test_kvpacked_gqa(on_host, d):
    q = _rand(2, 7, 6, d, seed=1, requires_grad=True)
    kv = _rand(2, 12, 2, 2, d, seed=2, requires_grad=True)  # 2 KV heads for 6 query heads
    out = fa.flash_attn_kvpacked_func(q, kv, window_size=[3, 0], softcap=2.0)
    out.sum().backward()
    assert kv.grad.shape == kv.shape
    _check_dense(q, kv[:, :, 0], kv[:, :, 1], out, None, (q.grad, kv.grad[:, :, 0], kv.grad[:, :, 1]),
                 dict(window_size=(3, 0), softcap=2.0))


def test_strided_last_dim_is_made_contiguous(on_host):
    """flash-attn accepts any strides (it copies when the last dim is not contiguous); so does the drop-in."""
    q, k, v = _dense_case(32)
    q_t = q.detach().transpose(1, 3).contiguous().transpose(1, 3)  # same values, last-dim stride > 1
    assert q_t.stride(-1) != 1
    out = fa.flash_attn_func(q_t, k.detach(), v.detach())
    _check_dense(q, k, v, out, None, None, {})


# --------------------------------------------------------------------------------------------
# Head dims that are not multiples of 8 (cuflash.torch)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [1, 3, 59, 255])
def test_every_head_dim_through_cuflash_torch(on_host, d):
    q, k, v = _dense_case(d, sq=5, sk=6)
    out = cuflash.torch.attention(q, k, v, causal=True)
    out.float().sum().backward()
    _check_dense(q, k, v, out, None, (q.grad, k.grad, v.grad), dict(causal=True))
    assert out.shape == q.shape and out.stride(-1) == 1


def test_multiple_of_8_takes_todays_path(on_host, monkeypatch):
    fail = lambda *a, **kw: pytest.fail("padding branch taken")  # noqa: E731
    monkeypatch.setattr(cuflash.torch, "_padded_attention", fail)
    monkeypatch.setattr(cuflash.torch, "_padded_kvcache", fail)
    q, k, v = _dense_case(64)
    out = fa.flash_attn_func(q, k, v)
    assert out.is_contiguous() and out.shape == q.shape  # a new tensor, not a slice of a padded one
    cuflash.torch.attention_with_kvcache(q.detach(), k.detach(), v.detach(), cache_seqlens=3)


def test_odd_head_dim_errors_name_the_callers_shapes(monkeypatch):
    monkeypatch.setattr(cuflash.torch, "_plans", {})
    q, k, v = (x.detach() for x in _dense_case(59))
    with pytest.raises(ValueError, match=r"k: head dim \(axis 3\) is 64 but q's is 59"):
        cuflash.torch.attention(q, _rand(2, 13, 2, 64), _rand(2, 13, 2, 64))
    with pytest.raises(ValueError, match=r"q: head dim \(axis 3\) is 260; must be between 1 and 256"):
        cuflash.torch.attention(*(_rand(1, 3, 2, 260) for _ in range(3)))
    with pytest.raises(ValueError, match="q: expected a CUDA tensor, got one on cpu"):
        cuflash.torch.attention(q, k, v)  # the padded call still runs every check
    with pytest.raises(TypeError, match="v: dtype float32 differs from q's float16"):
        cuflash.torch.attention(q, k, v.float())
    with pytest.raises(ValueError, match=r"q: head dim \(axis 3\) is 59; the kernels take multiples of 8"):
        torch.ops.cuflash.attention_fwd(q, k, v, None, None, None, False, -1, -1, 0.0, False, 0.0)  # pads nothing
    with pytest.raises(ValueError, match=r"qkv: expected shape \(batch, seqlen, 3, nheads, headdim\)"):
        fa.flash_attn_qkvpacked_func(_rand(2, 5, 2, 4, 59))


def test_odd_head_dim_compiles_without_graph_break(on_host):
    q, k, v = (x.detach() for x in _dense_case(59))

    def f(q, k, v):
        return fa.flash_attn_func(q * 2, k, v, causal=True).float().sum()

    explain = torch._dynamo.explain(f)(q, k, v)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    torch._dynamo.reset()
    qg = q.clone().requires_grad_()
    torch.compile(f, backend="aot_eager", fullgraph=True)(qg, k, v).backward()
    assert qg.grad.shape == q.shape


# --------------------------------------------------------------------------------------------
# Varlen
# --------------------------------------------------------------------------------------------

LENS_Q, LENS_K = (5, 1, 8), (7, 3, 8)


def _cu(lens):
    return torch.tensor(np.cumsum((0,) + lens), dtype=torch.int32)


def _check_varlen(q, k, v, out, grads, cu_q, cu_k, options):
    for b in range(len(cu_q) - 1):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        _check_dense(q[None, sq], k[None, sk], v[None, sk], out[None, sq], None,
                     None if grads is None else tuple(g[None, s] for g, s in zip(grads, (sq, sk, sk))), options)


@pytest.mark.parametrize("d", [59, 200, 64])
def test_flash_attn_varlen_func(on_host, d):
    q = _rand(sum(LENS_Q), 4, d, seed=3, requires_grad=True)
    k, v = (_rand(sum(LENS_K), 2, d, seed=s, requires_grad=True) for s in (4, 5))
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)
    out, lse, s_dmask = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=True,
                                                  return_attn_probs=True)
    assert lse.shape == (4, sum(LENS_Q)) and s_dmask.numel() == 0
    out.sum().backward()
    _check_varlen(q, k, v, out, (q.grad, k.grad, v.grad), cu_q, cu_k, dict(causal=True))


@pytest.mark.parametrize("d", [111, 64])
def test_varlen_packed(on_host, d):
    lens = (6, 2, 9)
    cu = _cu(lens)
    qkv = _rand(sum(lens), 3, 4, d, seed=6, requires_grad=True)
    out = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), window_size=torch.tensor([2, 1]))
    out.sum().backward()
    assert qkv.grad.shape == qkv.shape
    parts = qkv.unbind(1)
    _check_varlen(*parts, out, qkv.grad.unbind(1), cu, cu, dict(window_size=(2, 1)))

    q = _rand(sum(LENS_Q), 4, d, seed=7, requires_grad=True)
    kv = _rand(sum(LENS_K), 2, 1, d, seed=8, requires_grad=True)  # MQA
    cu_q, cu_k = _cu(LENS_Q), _cu(LENS_K)
    slopes = torch.tensor([[0.1, 0.2, 0.3, 0.4]] * 3)
    out = fa.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max(LENS_Q), max(LENS_K), alibi_slopes=slopes,
                                             causal=True)
    out.sum().backward()
    assert kv.grad.shape == kv.shape
    k, v = kv.unbind(1)
    for b in range(3):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        _check_dense(q[None, sq], k[None, sk], v[None, sk], out[None, sq], None, None,
                     dict(causal=True, alibi_slopes=_f64(slopes[b:b + 1])))


# --------------------------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------------------------

def _kv_case(d, b=3, sq=2, s_new=2, max_len=24, h=4, hk=2):
    q = _rand(b, sq, h, d, seed=10)
    k_cache, v_cache = _rand(b, max_len, hk, d, seed=11), _rand(b, max_len, hk, d, seed=12)
    k, v = _rand(b, s_new, hk, d, seed=13), _rand(b, s_new, hk, d, seed=14)
    return q, k_cache, v_cache, k, v


@pytest.mark.parametrize("d", [59, 64])
@pytest.mark.parametrize("layout", ["contiguous", "batch_idx", "paged"])
def test_flash_attn_with_kvcache_appends_and_matches(on_host, d, layout):
    q, k_cache, v_cache, k, v = _kv_case(d)
    lens = torch.tensor([3, 0, 20], dtype=torch.int32)
    extra = {}
    if layout == "batch_idx":
        extra["cache_batch_idx"] = torch.tensor([2, 0, 1], dtype=torch.int32)
    elif layout == "paged":  # 6 pages of 16 rows; each row's sequence on 2 pages
        k_cache, v_cache = _rand(6, 16, 2, d, seed=15), _rand(6, 16, 2, d, seed=16)
        extra["block_table"] = torch.tensor([[5, 0], [1, 4], [2, 3]], dtype=torch.int32)
    want_k, want_v = _f64(k_cache).copy(), _f64(v_cache).copy()
    want, want_lse = reference.attention_with_kvcache(
        _f64(q), want_k, want_v, k=_f64(k), v=_f64(v), cache_seqlens=lens.numpy(), causal=True, return_lse=True,
        **{n: x.numpy() for n, x in extra.items()})
    before = k_cache.clone()
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True,
                                          num_splits=2, return_softmax_lse=True, **extra)
    assert out.shape == q.shape and lse.shape == (3, 4, 2)
    assert np.array_equal(_f64(k_cache), want_k) and np.array_equal(_f64(v_cache), want_v)
    assert not torch.equal(before, k_cache)  # the append reached the caller's cache
    _close(out, want, TOL[q.dtype], "out")
    _close(lse, want_lse, 1e-4, "lse")
    assert on_host[0][1]["num_splits"] == 2


def test_kvcache_without_append_and_int_seqlens(on_host):
    q, k_cache, v_cache, _, _ = _kv_case(111)
    before = k_cache.clone()
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=17, window_size=(4, 0), softcap=5.0)
    assert torch.equal(before, k_cache)
    want = reference.attention_with_kvcache(_f64(q), _f64(k_cache), _f64(v_cache), cache_seqlens=17,
                                            window_size=(4, 0), softcap=5.0)
    _close(out, want, TOL[q.dtype], "out")


@pytest.mark.parametrize("seqlens", ["int", "tensor", "clamped"])
def test_appended_rows_torch_and_cupy_api_agree(seqlens):
    """The copy-back indices, for torch tensors and (through the CuPy API's helper) NumPy arrays, clamped."""
    cache = torch.zeros(3, 10, 1, 1)
    lens = {"int": 4, "tensor": torch.tensor([0, 3, 8], dtype=torch.int32),
            "clamped": torch.tensor([9, -2, 30], dtype=torch.int32)}[seqlens]
    host = lens if isinstance(lens, int) else lens.numpy()
    for batch_idx in (None, torch.tensor([2, 0, 1], dtype=torch.int32)):
        got = cuflash.torch._appended_rows(cache, 3, 2, lens, batch_idx, None)
        want = api._appended_rows(cache.numpy(), 3, 2, host, None if batch_idx is None else batch_idx.numpy(), None)
        assert all(np.array_equal(g.numpy(), w) for g, w in zip(got, want))
        assert all(int(g.min()) >= 0 for g in got) and int(got[1].max()) <= 9
    table = torch.tensor([[4, 1], [0, 2], [3, 5]], dtype=torch.int32)
    pool = torch.zeros(6, 8, 1, 1)
    got = cuflash.torch._appended_rows(pool, 3, 2, lens, None, table)
    want = api._appended_rows(pool.numpy(), 3, 2, host, None, table.numpy())
    assert all(np.array_equal(g.numpy(), w) for g, w in zip(got, want))
    if seqlens == "tensor":  # row 2 appends at 8, 9: page table[2, 1] = 5, rows 0, 1
        assert got[0][2].tolist() == [5, 5] and got[1][2].tolist() == [0, 1]


# --------------------------------------------------------------------------------------------
# Signatures, window_size forms, what is not supported yet
# --------------------------------------------------------------------------------------------

FLASH_ATTN_SIGNATURES = {  # flash-attn 2.x's parameters and defaults, in order
    "flash_attn_func": "q k v dropout_p=0.0 softmax_scale=None causal=False window_size=(-1, -1) softcap=0.0 "
                       "alibi_slopes=None deterministic=False return_attn_probs=False",
    "flash_attn_qkvpacked_func": "qkv dropout_p=0.0 softmax_scale=None causal=False window_size=(-1, -1) "
                                 "softcap=0.0 alibi_slopes=None deterministic=False return_attn_probs=False",
    "flash_attn_kvpacked_func": "q kv dropout_p=0.0 softmax_scale=None causal=False window_size=(-1, -1) "
                                "softcap=0.0 alibi_slopes=None deterministic=False return_attn_probs=False",
    "flash_attn_varlen_func": "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p=0.0 "
                              "softmax_scale=None causal=False window_size=(-1, -1) softcap=0.0 alibi_slopes=None "
                              "deterministic=False return_attn_probs=False block_table=None",
    "flash_attn_varlen_qkvpacked_func": "qkv cu_seqlens max_seqlen dropout_p=0.0 softmax_scale=None causal=False "
                                        "window_size=(-1, -1) softcap=0.0 alibi_slopes=None deterministic=False "
                                        "return_attn_probs=False",
    "flash_attn_varlen_kvpacked_func": "q kv cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p=0.0 "
                                       "softmax_scale=None causal=False window_size=(-1, -1) softcap=0.0 "
                                       "alibi_slopes=None deterministic=False return_attn_probs=False",
    "flash_attn_with_kvcache": "q k_cache v_cache k=None v=None rotary_cos=None rotary_sin=None cache_seqlens=None "
                               "cache_batch_idx=None cache_leftpad=None block_table=None softmax_scale=None "
                               "causal=False window_size=(-1, -1) softcap=0.0 rotary_interleaved=True "
                               "alibi_slopes=None num_splits=0 return_softmax_lse=False",
}


@pytest.mark.parametrize("name", sorted(FLASH_ATTN_SIGNATURES))
def test_signatures_are_flash_attns(name):
    params = [p for p in inspect.signature(getattr(fa, name)).parameters.values() if p.kind != p.KEYWORD_ONLY]
    got = " ".join(p.name if p.default is p.empty else f"{p.name}={p.default!r}" for p in params)
    assert got == FLASH_ATTN_SIGNATURES[name]
    assert name in fa.__all__


@pytest.mark.parametrize("window", [(4, 2), [4, 2], torch.tensor([4, 2]), torch.tensor([4, 2], dtype=torch.int32)])
def test_window_size_forms(on_host, window):
    q, k, v = (x.detach() for x in _dense_case(32))
    fa.flash_attn_func(q, k, v, window_size=window)
    cuflash.torch.attention_with_kvcache(q, k, v, cache_seqlens=10, window_size=window)
    assert on_host[0][1]["window_size"] == (4, 2) and on_host[1][1]["window_size"] == (4, 2)


@pytest.mark.parametrize("window", [torch.tensor([4.0, 2.0]), torch.tensor([1, 2, 3]), 5])
def test_window_size_bad_forms(monkeypatch, window):
    monkeypatch.setattr(cuflash.torch, "_plans", {})
    q, k, v = (x.detach() for x in _dense_case(32))
    with pytest.raises(TypeError, match="window_size: expected a pair of ints"):
        fa.flash_attn_func(q, k, v, window_size=window)


def test_dropout_p_reaches_the_kernels_from_every_function(on_host, monkeypatch):
    from test_torch_cpu import _FakeCudaGenerator
    generator = _FakeCudaGenerator(seed=11, offset=0)
    monkeypatch.setattr(cuflash.torch, "_generator", lambda q: generator)
    q, k, v = (x.detach() for x in _dense_case(64))
    qkv, kv = torch.stack((q, q, q), 2), torch.stack((k, v), 2)
    cu = torch.tensor([0, 9], dtype=torch.int32)
    vq, vk = q[0], k[0]
    calls = [lambda: fa.flash_attn_func(q, k, v, 0.1), lambda: fa.flash_attn_qkvpacked_func(qkv, 0.1),
             lambda: fa.flash_attn_kvpacked_func(q, kv, 0.1),
             lambda: fa.flash_attn_varlen_func(vq, vk, vk, cu, cu, 9, 9, 0.1),
             lambda: fa.flash_attn_varlen_qkvpacked_func(qkv[0], cu, 9, 0.1),
             lambda: fa.flash_attn_varlen_kvpacked_func(vq, kv[0], cu, cu, 9, 9, 0.1)]
    for n, call in enumerate(calls):
        call()
        assert on_host[n][0] == "fwd", on_host
        assert on_host[n][1]["dropout_p"] == 0.1 and on_host[n][1]["dropout_offset"] == 4 * n
    assert generator.offset == 4 * len(calls)


def test_not_supported_yet_raises_naming_the_argument():
    q, k, v = (x.detach() for x in _dense_case(64))
    vq, vk = q[0], k[0]
    cu = torch.tensor([0, 9], dtype=torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32)
    pool = torch.zeros(1, 16, *vk.shape[1:], dtype=vk.dtype)  # one page of 16 rows
    with pytest.raises(NotImplementedError, match="block_table: attention_varlen with paged keys or seqused_k has no"):
        fa.flash_attn_varlen_func(vq.clone().requires_grad_(), pool, pool, cu, cu, 9, 9, block_table=table)


def test_odd_head_dim_kvcache_compiles_and_appends(on_host):
    q, k_cache, v_cache, k, v = _kv_case(59)
    lens = torch.tensor([3, 0, 20], dtype=torch.int32)

    def f(q, k_cache, v_cache, k, v):
        return fa.flash_attn_with_kvcache(q * 2, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True).float()

    eager_k, eager_v = k_cache.clone(), v_cache.clone()
    want = f(q, eager_k, eager_v, k, v)
    got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k_cache, v_cache, k, v)
    assert torch.equal(got, want) and torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)
