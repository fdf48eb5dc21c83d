"""The public functions reject bad input before anything touches a GPU (runs without one)."""
import dataclasses

import numpy as np
import pytest

import cuflash
from cuflash import checks, options, tma
from cuflash.ops import backward, backward_sm90, decode, forward, forward_sm90
from tests.fixtures import configure, no_gpu_kernels  # noqa: F401  (fixtures)


def _qkv(d=64, dtype=np.float16):
    q = np.zeros((1, 8, 2, d), dtype)
    return q, q.copy(), q.copy()


def test_host_arrays_are_refused_with_a_clear_message():
    with pytest.raises(TypeError, match=r"q: expected a cupy\.ndarray, got numpy\.ndarray.*from_dlpack"):
        cuflash.attention(*_qkv())


def test_shape_errors_come_before_the_array_type_check():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"k: head dim \(axis 3\) is 32 but q's is 64"):
        cuflash.attention(q, k[..., :32], v[..., :32])


def test_backward_rejects_bad_input_before_launch():
    q, k, v = _qkv()
    lse = np.zeros((1, 2, 8), np.float32)
    with pytest.raises(TypeError, match="cupy.ndarray"):
        cuflash.attention_backward(q, q, k, v, q, lse)
    with pytest.raises(ValueError, match="lse"):
        cuflash.attention_backward(q, q, k, v, q, lse[:, :1])


def test_public_names():
    assert set(cuflash.__all__) >= {"attention", "attention_backward", "precompile", "reference"}


def _varlen_args(total_q=10, total_k=12, h=2, d=64):
    q = np.zeros((total_q, h, d), np.float16)
    k = np.zeros((total_k, 1, d), np.float16)
    cu_q, cu_k = np.array([0, 4, total_q], np.int32), np.array([0, 0, total_k], np.int32)
    return q, k, k.copy(), cu_q, cu_k


def test_varlen_rejects_bad_input_before_launch():
    q, k, v, cu_q, cu_k = _varlen_args()
    with pytest.raises(TypeError, match=r"q: expected a cupy\.ndarray"):
        cuflash.attention_varlen(q, k, v, cu_q, cu_k, 6, 12)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        cuflash.attention_varlen(q, k, v, cu_q.astype(np.int64), cu_k, 6, 12)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        cuflash.attention_varlen(q, k, v, cu_q, cu_k, 0, 12)
    lse = np.zeros((2, 10), np.float32)
    with pytest.raises(TypeError, match="cupy.ndarray"):
        cuflash.attention_varlen_backward(q, q, k, v, q, lse, cu_q, cu_k, 6, 12)
    with pytest.raises(ValueError, match="lse"):
        cuflash.attention_varlen_backward(q, q, k, v, q, lse[:, :9], cu_q, cu_k, 6, 12)


def test_packed_arrays_pass_the_row_stride_as_batch_stride():
    """Kernels address row r of sequence b at begin * batch_stride + r * row_stride (seqlen.cuh), begin = b padded
    and cu_seqlens[b] packed: packed arrays pass their row stride as the batch stride."""
    from cuflash import checks
    padded = np.zeros((3, 5, 4, 64), np.float16)
    assert checks.seq_strides(padded) == (5 * 4 * 64, 4 * 64, 64)
    assert checks.seq_strides(np.zeros((7, 3, 2, 4, 64), np.float16)[:, :, 0]) == (3 * 2 * 4 * 64, 2 * 4 * 64, 64)
    packed = np.zeros((17, 4, 64), np.float16)
    assert checks.seq_strides(packed) == (4 * 64, 4 * 64, 64)
    assert checks.seq_strides(np.zeros((17, 3, 4, 64), np.float16)[:, 1]) == (3 * 4 * 64, 3 * 4 * 64, 64)  # qkv view
    assert checks.lse_strides(np.zeros((3, 4, 5), np.float32)) == (20, 5)
    assert checks.lse_strides(np.zeros((4, 17), np.float32)) == (1, 17)
    assert checks.lse_strides(None) == (0, 0)


def test_public_varlen_names():
    assert {"attention_varlen", "attention_varlen_backward"} <= set(cuflash.__all__)


def test_kvcache_rejects_bad_input_before_launch():
    q = np.zeros((2, 1, 4, 64), np.float16)
    kc = np.zeros((2, 32, 2, 64), np.float16)
    with pytest.raises(TypeError, match=r"q: expected a cupy\.ndarray"):
        cuflash.attention_with_kvcache(q, kc, kc)
    with pytest.raises(ValueError, match="page_size"):
        cuflash.attention_with_kvcache(q, kc[:, :24], kc[:, :24], block_table=np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="cache_seqlens"):
        cuflash.attention_with_kvcache(q, kc, kc, k=kc[:, :1], v=kc[:, :1], cache_seqlens=32)
    with pytest.raises(ValueError, match="num_splits"):
        cuflash.attention_with_kvcache(q, kc, kc, num_splits=-1)
    assert "attention_with_kvcache" in cuflash.__all__


class _FakeDeviceArray:
    """What the params builders read from a CuPy array: shape, strides, dtype, itemsize, ndim and data.ptr."""

    def __init__(self, host, ptr):
        self.shape, self.strides, self.itemsize, self.ndim = host.shape, host.strides, host.itemsize, host.ndim
        self.dtype = host.dtype
        self.data = type("Ptr", (), {"ptr": ptr})()


def _forward_call(problem, q, k, v, out, lse, *, device_id, alibi_slopes=None, **kw):
    """forward.forward_call with the public keywords resolved into AttentionOptions."""
    opts = options.resolve(problem, alibi_slopes=alibi_slopes, **kw)
    return forward.forward_call(problem, q, k, v, out, lse, opts, device_id=device_id, alibi_slopes=alibi_slopes)


def _backward_call(problem, dout, q, k, v, out, lse, dq, dk, dv, *, device_id, alibi_slopes=None, deterministic,
                   packed, **kw):
    """backward.backward_call with the public keywords resolved into AttentionOptions."""
    opts = options.resolve(problem, alibi_slopes=alibi_slopes, **kw)
    return backward.backward_call(problem, dout, q, k, v, out, lse, dq, dk, dv, opts, device_id=device_id,
                                  alibi_slopes=alibi_slopes, deterministic=deterministic, packed=packed)


def _struct(call, dtype, *pointers):
    """The parameter struct a KernelCall passes for these pointers, as a NumPy structured scalar."""
    return np.frombuffer(call.params(*pointers), dtype)[0]


def test_kernel_call_puts_each_pointer_in_its_field():
    from cuflash.ops import forward
    from cuflash.launcher import KernelCall
    p = np.zeros((), forward.PARAMS_DTYPE)
    p["seqlen_q"], p["softcap"] = 77, 1.5
    call = KernelCall((), p, forward.PARAMS_DTYPE.names[:8])
    got = _struct(call, forward.PARAMS_DTYPE, *range(1, 9))
    assert [int(got[n]) for n in forward.PARAMS_DTYPE.names[:8]] == list(range(1, 9))
    assert got["seqlen_q"] == 77 and got["softcap"] == 1.5
    with pytest.raises(ValueError, match="leading uint64"):
        KernelCall((), p, ("k", "q"))


def test_packed_forward_params(no_gpu_kernels):
    """The forward's params for a packed call: cu_seqlens pointers in their fields, row strides as batch strides,
    lse (nheads, total_q) with batch stride 1; a padded call's strides are the arrays' own."""
    from cuflash import checks
    from cuflash.ops import forward
    q = _FakeDeviceArray(np.zeros((30, 4, 64), np.float16), 0x1000)
    k = _FakeDeviceArray(np.zeros((50, 2, 64), np.float16), 0x2000)
    lse = _FakeDeviceArray(np.zeros((4, 30), np.float32), 0x3000)
    problem = checks.Problem(2, 20, 40, 4, 2, 64, np.dtype(np.float16))
    opts = dict(device_id=0, softmax_scale=0.125, causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None)
    call = _forward_call(problem, q, k, k, q, lse, **opts)
    p = _struct(call, forward.PARAMS_DTYPE, 0x1000, 0x2000, 0x2000, 0x1000, 0x3000, 0, 0x4000, 0x5000, 0, 0x6000, 7, 9,
                0x7000)
    assert (int(p["cu_seqlens_q"]), int(p["cu_seqlens_k"]), int(p["seqused_k"])) == (0x4000, 0x5000, 0x6000)
    assert (int(p["dropout_seed"]), int(p["dropout_offset"])) == (7, 9) and p["dropout_threshold"] == options.DROPOUT_LEVELS
    assert int(p["dropout_state"]) == 0x7000
    assert (p["q_batch_stride"], p["q_row_stride"], p["q_head_stride"]) == (256, 256, 64)
    assert (p["k_batch_stride"], p["k_row_stride"], p["k_head_stride"]) == (128, 128, 64)
    assert (p["lse_batch_stride"], p["lse_head_stride"]) == (1, 30)
    assert (p["seqlen_q"], p["seqlen_k"], p["heads_per_kv"]) == (20, 40, 2)

    qp = _FakeDeviceArray(np.zeros((2, 20, 4, 64), np.float16), 0x1000)
    lsep = checks.contiguous("lse", (2, 4, 20), np.float32)  # a TensorSpec works as well as an array
    p = _struct(_forward_call(problem, qp, qp, qp, qp, lsep, **opts), forward.PARAMS_DTYPE, *range(13))
    assert (p["q_batch_stride"], p["q_row_stride"]) == (20 * 256, 256)
    assert (p["lse_batch_stride"], p["lse_head_stride"]) == (80, 20)


def _paged_call(arch, monkeypatch, headdim=64, page_size=32, dropout_p=0.0, seqused_k=None):
    """forward.forward_call of a paged varlen problem (9 pages of page_size rows, a (2, 5) block table) on `arch`."""
    from cuflash import build
    monkeypatch.setattr(build, "device_arch", lambda device_id: arch)
    monkeypatch.setattr(build, "sm_count", lambda device_id: 132)
    q = _FakeDeviceArray(np.zeros((30, 4, headdim), np.float16), 0x1000)
    pool = _FakeDeviceArray(np.zeros((9, page_size, 2, headdim), np.float16), 0x2000)
    table = _FakeDeviceArray(np.zeros((2, 5), np.int32), 0x7000)
    lse = _FakeDeviceArray(np.zeros((4, 30), np.float32), 0x3000)
    problem = checks.check_varlen(q, pool, pool, _FakeDeviceArray(np.zeros(3, np.int32), 0x4000),
                                  _FakeDeviceArray(np.zeros(3, np.int32), 0x5000), 20, 160, block_table=table,
                                  seqused_k=seqused_k, dropout_p=dropout_p)
    opts = options.resolve(problem, softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None, dropout_p=dropout_p)
    call = forward.forward_call(problem, q, pool, pool, q, lse, opts, device_id=0, block_table=table,
                                seqused_k=seqused_k)
    return call, problem


def test_paged_varlen_forward_params(no_gpu_kernels, configure, monkeypatch):
    """block_table on the portable kernel (sm_80, or a dropout call on sm_90a): the pools' page stride as the k/v
    batch stride, the pages' geometry, the table's row stride."""
    from cuflash.launcher import KernelCall
    configure(sm90=True)
    for arch, dropout_p in (("sm_80", 0.0), ("sm_90a", 0.1)):
        call, problem = _paged_call(arch, monkeypatch, dropout_p=dropout_p)
        assert isinstance(call, KernelCall)
        p = _struct(call, forward.PARAMS_DTYPE, *range(1, 14))
        assert int(p["block_table"]) == 9 and (p["page_size"], p["num_pages"], p["max_pages"]) == (32, 9, 5)
        assert (p["k_batch_stride"], p["k_row_stride"], p["k_head_stride"]) == (32 * 128, 128, 64)
        assert p["block_table_stride"] == 5 and problem.nheads_k == 2


@pytest.mark.parametrize("headdim, page_size, box", [(64, 32, 32), (128, 16, 16), (128, 256, 128), (128, 48, 16),
                                                     (256, 256, 64), (256, 32, 32)])
def test_paged_varlen_forward_on_hopper(no_gpu_kernels, configure, monkeypatch, headdim, page_size, box):
    """block_table on sm_90a: the Hopper kernel's PAGED variant, the table and seqused_k in the call's head, the
    pools' geometry, and K/V maps over (d, heads_k, page rows, pages) in boxes of a divisor of the page size and of
    the block's keys."""
    configure(sm90=True)
    call, _ = _paged_call("sm_90a", monkeypatch, headdim=headdim, page_size=page_size,
                          seqused_k=_FakeDeviceArray(np.zeros(2, np.int32), 0x6000))
    assert isinstance(call, forward_sm90.ForwardCall)
    assert call.spec == forward_sm90.variant_spec(forward_sm90.PAGED_VARIANT, "fp16", headdim, True, False,
                                                  paged=True)
    assert not call.spec.warp_specialized and call.spec in forward_sm90.all_specs()
    p = np.frombuffer(call.kernel_call.params(), forward_sm90.PARAMS_DTYPE)[0]
    assert (p["page_size"], p["num_pages"], p["max_pages"], p["block_table_stride"]) == (page_size, 9, 5, 5)
    assert p["page_box"] == box and call.spec.block_n % box == 0 and page_size % box == 0
    assert forward_sm90.PARAMS_DTYPE.fields["seqused_k"][1] + 8 == 4 * 128 + 10 * 8  # the call's head
    pool = np.zeros((9, page_size, 2, headdim), np.float16)
    dtype, dims, strides, rows_box = tma.map_layout(pool, box)
    assert dims == (headdim, 2, page_size, 9) and rows_box == (64, 1, box, 1)
    tma.check_tiled(0x10000, dtype, dims, strides, rows_box, 128)
    # seqused_k without pages stays on the portable kernel
    from cuflash.launcher import KernelCall
    monkeypatch.setattr(forward, "sm90_variant", lambda *a, **k: "lockstep")
    q = _FakeDeviceArray(np.zeros((30, 4, headdim), np.float16), 0x1000)
    kv = _FakeDeviceArray(np.zeros((40, 2, headdim), np.float16), 0x2000)
    used = _FakeDeviceArray(np.zeros(2, np.int32), 0x6000)
    cu = _FakeDeviceArray(np.zeros(3, np.int32), 0x4000)
    problem = checks.check_varlen(q, kv, kv, cu, cu, 20, 40, seqused_k=used)
    opts = options.resolve(problem, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                           alibi_slopes=None)
    assert isinstance(forward.forward_call(problem, q, kv, kv, q, None, opts, device_id=0, seqused_k=used),
                      KernelCall)


def _fake_backward_call(b, sq, sk, h, hk, d, rows_k_packed, packed, deterministic, rows_packed):
    """backward.backward_call on fake device arrays (causal): the call, the query rows (total_q when packed), the
    problem."""
    from cuflash import checks
    rows = rows_packed if packed else b * sq
    lead_q, lead_k = ((rows,), (rows_k_packed,)) if packed else ((b, sq), (b, sk))
    q = _FakeDeviceArray(np.zeros(lead_q + (h, d), np.float16), 0)
    k = _FakeDeviceArray(np.zeros(lead_k + (hk, d), np.float16), 0)
    lse = _FakeDeviceArray(np.zeros((h, rows) if packed else (b, h, sq), np.float32), 0)
    problem = checks.Problem(b, sq, sk, h, hk, d, np.dtype(np.float16))
    call = _backward_call(problem, q, q, k, k, q, lse, q, k, k, device_id=0, softmax_scale=None, causal=True,
                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=deterministic,
                          packed=packed)
    return call, rows, problem


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_call_layout(configure, no_gpu_kernels, packed, deterministic):
    """The backward's three structs: every pointer in its field, the workspace pieces where
    backward.workspace puts them, lse/dsum strides of (b, h, sq) or packed (h, total_q), dq strides.
    (The portable main kernel; the Hopper one, chosen on sm_90a by default, is
    test_sm90_backward_main_behind_the_same_call's.)"""
    from cuflash.ops import backward
    configure(bwd_sm90=False)
    b, sq, sk, h, hk, d = 3, 20, 400, 4, 2, 64  # several KV blocks: deterministic mode gets several slices
    call, rows, problem = _fake_backward_call(b, sq, sk, h, hk, d, 555, packed, deterministic, rows_packed=37)
    slices = backward.plan_backward(problem, -1, 0, False, deterministic, "sm_90a", 132).slices
    assert (slices > 1) == deterministic
    lse_off, dq_off, total = backward.workspace(rows, h, d, slices)
    assert (call.lse_log2_offset, call.dq_offset, call.workspace_bytes) == (lse_off, dq_off, total)
    assert call.dq_bytes == slices * rows * h * d * 4 and dq_off + call.dq_bytes <= total

    main = _struct(call.main, backward.PARAMS_DTYPE, *range(101, 118))
    assert [int(main[n]) for n in backward.PARAMS_DTYPE.names[:17]] == list(range(101, 118))
    assert main["dropout_threshold"] == options.DROPOUT_LEVELS and main["dropout_scale"] == 1.0
    assert (main["lse_batch_stride"], main["lse_head_stride"]) == ((1, rows) if packed else (h * sq, sq))
    assert main["dq_batch_stride"] == (h * d if packed else sq * h * d) and main["dq_slice_stride"] == rows * h * d
    assert (main["batch"], main["seqlen_q"], main["seqlen_k"], main["heads_per_kv"]) == (b, sq, sk, 2)
    assert (main["q_row_stride"], main["k_row_stride"], main["deterministic"]) == (h * d, hk * d, deterministic)
    pre = _struct(call.preprocess, backward.PRE_PARAMS_DTYPE, *range(1, 13))
    assert [int(pre[n]) for n in ("out", "dout", "lse", "dsum", "lse_log2", "dq_accum", "dq_scale", "kv_bound",
                                  "k", "v", "cu_seqlens_q", "cu_seqlens_k")] == list(range(1, 13))
    assert pre["sequences"] == b
    assert len(call.preprocess.launches) == 1 and pre["fixed_point"] == 0 and call.fixed_offsets is None
    assert (pre["batch"], pre["seqlen_q"], pre["nheads"]) == ((1, rows, h) if packed else (b, sq, h))
    assert (pre["dq_slice_stride"], pre["slices"]) == (rows * h * d, slices)  # it zeroes every slice
    conv = _struct(call.convert, backward.CONVERT_PARAMS_DTYPE, 8, 9, 10)
    assert (int(conv["dq_accum"]), int(conv["dq"]), conv["slice_stride"], conv["slices"]) == (
        8, 9, rows * h * d, slices)
    assert conv["fixed_point"] == 0


@pytest.mark.parametrize("packed", [False, True])
def test_backward_fixed_point_layout(configure, no_gpu_kernels, packed):
    """Deterministic mode's fixed point (the bwd_sm90_det setting "auto", where the slot rule gives a head several
    slots): the Hopper kernel on the atomic grid with deterministic = 2 and an int32 dq_accum map of one slice; the
    preprocess, bwd_kv_bound over every K row (packed: one sequence of total_k rows) per KV head, then
    bwd_fixed_scale; the pieces where backward.fixed_point_offsets puts them; the convert's rows as the preprocess's,
    grid (row groups, rows)."""
    from cuflash import build
    from cuflash.ops import backward, backward_sm90
    configure(bwd_sm90=True)
    configure(bwd_sm90_det="auto")
    b, sq, sk, h, hk, d = 3, 20, 400, 4, 2, 64
    call, rows, problem = _fake_backward_call(b, sq, sk, h, hk, d, 555, packed, True, rows_packed=37)
    launch = backward.plan_backward(problem, -1, 0, False, True, "sm_90a", 132)
    assert launch.fixed_point and launch.slices == 1 and launch.grid == (4, hk, b)  # 400 keys: 4 blocks
    assert backward.slots_sm90(4, b * hk, 132) > 1
    blocks = 0 if packed else -(-sq // call.main.spec.block_m)  # first stores: a padded batch only
    counters = 2 * b * h * blocks
    lse_off, dq_off, total = backward.workspace(rows, h, d, 1, hk, counters)
    scale_off, kvb_off = backward.fixed_point_offsets(rows, h, d, counters)
    assert (call.lse_log2_offset, call.dq_offset, call.workspace_bytes) == (lse_off, dq_off, total)
    assert dq_off + call.dq_bytes + counters * 4 <= scale_off
    assert call.fixed_offsets == (scale_off, kvb_off)
    assert dq_off + call.dq_bytes <= scale_off and scale_off + rows * h * 4 <= kvb_off
    assert kvb_off + hk * 2 * 4 <= total
    main = np.frombuffer(call.main.kernel_call.params(), backward.SM90_PARAMS_DTYPE)[0]
    assert main["deterministic"] == 2 and call.main.kernel_call.launches[0][1:4] == (4, hk, b)
    assert main["dq_first_store"] == blocks
    assert call.main.spec.fixed and call.main.spec.name.endswith("_fixed")  # the kernel that runs mode 2 only
    assert call.main.spec in backward_sm90.all_specs()
    with pytest.raises(ValueError, match="wrong kernel"):  # mode 2 on a kernel without the fixed point's code
        backward_sm90.backward_main(dataclasses.replace(call.main.spec, fixed=False), main, None, None, None, None,
                                    launch.grid, 0)
    dtype, dims, _, _ = backward_sm90.dq_accum_layout(main, launch.grid)
    assert dtype == np.int32 and dims == (d, h, rows, 1)
    pre = _struct(call.preprocess, backward.PRE_PARAMS_DTYPE, *range(1, 13))
    assert pre["fixed_point"] == 1 and pre["nheads_k"] == hk
    rows_k = (1, 555) if packed else (b, sk)
    assert (pre["kv_batch"], pre["seqlen_k"]) == rows_k and pre["k_row_stride"] == hk * d
    per_block = 256 // backward.pre_lanes(d)
    blocks = backward.kv_bound_blocks(rows_k[1], per_block, hk * rows_k[0], build.sm_count(0))
    assert call.preprocess.launches[1][1:4] == (blocks, hk, rows_k[0]) and blocks <= -(-rows_k[1] // per_block)
    pre_b, pre_sq = (1, rows) if packed else (b, sq)  # then bwd_fixed_scale: a row per thread, over the preprocess's
    assert call.preprocess.launches[2][1:4] == (-(-pre_sq // 256), h, pre_b) and len(call.preprocess.launches) == 3
    assert pre["softmax_scale"] == np.float32(d ** -0.5)
    conv = _struct(call.convert, backward.CONVERT_PARAMS_DTYPE, *range(8, 11))
    assert (conv["fixed_point"], conv["seqlen_q"], conv["nheads"], conv["headdim"]) == (
        1, rows if packed else sq, h, d)
    assert call.convert.launches[0][1:3] == (1, rows)  # h d / 8 = 32 chunks: one block per token
    configure(bwd_sm90_det="slices")
    assert not backward.plan_backward(problem, -1, 0, False, True, "sm_90a", 132).fixed_point
    configure(bwd_sm90_det="auto")
    configure(bwd_sm90_det_slots=2)  # a fixed slot count keeps the slices
    assert backward.plan_backward(problem, -1, 0, False, True, "sm_90a", 132).slices == 2


@pytest.mark.parametrize("deterministic", [False, True])
def test_sm90_backward_main_behind_the_same_call(configure, no_gpu_kernels, monkeypatch, deterministic):
    """The bwd_sm90 setting on (the default): the backward's main launch is the Hopper kernel (d 64/128, no score mod)
    with BwdParams after its four tensor maps, 128 keys per CTA (atomic) or backward.slots_sm90 (deterministic); off, or
    with a score mod, the portable one."""
    from cuflash import checks, tma
    from cuflash.ops import backward, backward_sm90
    b, sq, sk, h, hk, d = 3, 20, 400, 4, 2, 64
    q = _FakeDeviceArray(np.zeros((b, sq, h, d), np.float16), 0)
    k = _FakeDeviceArray(np.zeros((b, sk, hk, d), np.float16), 0)
    lse = _FakeDeviceArray(np.zeros((b, h, sq), np.float32), 0)
    problem = checks.Problem(b, sq, sk, h, hk, d, np.dtype(np.float16))

    def call(**kw):
        return _backward_call(problem, q, q, k, k, q, lse, q, k, k, device_id=0, softmax_scale=None,
                              causal=True, window_size=(-1, -1), deterministic=deterministic, packed=False,
                              **dict(dict(softcap=0.0, alibi_slopes=None), **kw))

    assert isinstance(call().main, backward_sm90.BackwardMain)  # on by default (no_gpu_kernels: an sm_90a device)
    configure(bwd_sm90=False)
    assert not isinstance(call().main, backward_sm90.BackwardMain)
    configure(bwd_sm90=True)
    main, capped = call(), call(softcap=5.0)
    block_m = backward_sm90.block_m(64, False)  # the table's rows per step at d = 64
    assert isinstance(main.main, backward_sm90.BackwardMain)
    fixed = np.frombuffer(main.main.kernel_call.params(), backward.SM90_PARAMS_DTYPE)[0]["deterministic"] == 2
    assert main.main.spec == backward_sm90.BwdSm90Spec("fp16", 64, True, block_m=block_m, fixed=fixed)
    assert capped.main.spec == backward_sm90.BwdSm90Spec("fp16", 64, True, score_mod=True,  # causal: the slices
                                                         block_m=backward_sm90.block_m(64, True))
    monkeypatch.setattr(backward_sm90, "SCORE_MOD_HEADDIMS", ())  # no Hopper score-mod kernel: the portable one
    portable = call(softcap=5.0)
    assert not isinstance(portable.main, backward_sm90.BackwardMain)
    configure(bwd_sm90_det="slices")  # the fixed point: test_backward_fixed_point_layout
    main, capped = call(), call(softcap=5.0)
    launch = backward.plan_backward(problem, -1, 0, False, deterministic, "sm_90a", 132)
    slots = backward.slots_sm90(4, b * hk, 132) if deterministic else 4  # 400 keys: four 128-key blocks
    assert launch.grid[0] == slots and launch.slices == (slots if deterministic else 1)
    assert main.dq_bytes == launch.slices * b * sq * h * d * 4
    threads = 384 if block_m == 128 else 256  # warp-specialized with 128 rows
    assert main.main.kernel_call.launches[0][1:5] == (slots, hk, b, threads)
    got = np.frombuffer(main.main.kernel_call.params(), backward.SM90_PARAMS_DTYPE)[0]
    want = np.frombuffer(call(softcap=0.0).main.kernel_call.params(), backward.SM90_PARAMS_DTYPE)[0]
    ref = _struct(portable.main, backward.PARAMS_DTYPE, *([0] * 17))
    for name in backward.PARAMS_DTYPE.names[14:]:
        if name not in ("mod_scale", "softcap", "scale_log2", "dq_first_store"):  # the score-mod kernel's
            assert got[name] == ref[name] == want[name], name                   # natural-log scores; Hopper's own
    # first stores: one accumulator (atomic mode), each whole block of block_m query rows; never the portable kernel
    assert got["dq_first_store"] == (0 if launch.slices > 1 else -(-sq // main.main.spec.block_m))
    assert ref["dq_first_store"] == 0
    assert backward.SM90_PARAMS_DTYPE.fields["q"][1] == 640 and backward.SM90_PARAMS_DTYPE.itemsize % 64 == 0
    for x, rows in ((q, backward_sm90.BLOCK_M), (k, backward_sm90.BLOCK_N)):
        tma.check_tiled(0x10000, *tma.map_layout(x, rows), 128)
    # dq_accum's map: fp32 (d, heads, rows of all sequences, slices), 32-column boxes of 64 rows
    dtype, dims, strides, box = backward_sm90.dq_accum_layout(got, launch.grid)
    assert dims == (d, h, b * sq, launch.slices) and strides == (d * 4, h * d * 4, b * sq * h * d * 4)
    assert dtype == np.float32 and box == (32, 1, 64, 1)
    tma.check_tiled(0x10000, dtype, dims, strides, box, 128)


def test_sm90_backward_128_query_rows_at_d64(configure, no_gpu_kernels):
    """bwd_sm90_block_m {64: 128}: d = 64 steps over 128 query rows (the spec, its shared memory, the Q/dO tensor
    maps' box), with a score mod too; with a score mod and dropout together, and at d = 128, 64."""
    from cuflash import checks, tma
    from cuflash.ops import backward_sm90
    configure(bwd_sm90=True)
    configure(bwd_sm90_block_m={64: 128})
    assert backward_sm90.block_m(64, False) == 128
    assert backward_sm90.block_m(64, True) == 128 and backward_sm90.block_m(64, False, dropout=True) == 128
    assert backward_sm90.block_m(64, True, dropout=True) == 64 and backward_sm90.block_m(128, False) == 64
    b, sq, sk, h, hk, d = 2, 300, 400, 4, 2, 64
    q = _FakeDeviceArray(np.zeros((b, sq, h, d), np.float16), 0)
    k = _FakeDeviceArray(np.zeros((b, sk, hk, d), np.float16), 0)
    lse = _FakeDeviceArray(np.zeros((b, h, sq), np.float32), 0)
    problem = checks.Problem(b, sq, sk, h, hk, d, np.dtype(np.float16))
    call = _backward_call(problem, q, q, k, k, q, lse, q, k, k, device_id=0, softmax_scale=None, causal=False,
                          window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, packed=False)
    spec = call.main.spec
    assert spec == backward_sm90.BwdSm90Spec("fp16", 64, False, False, 128) and spec.name.endswith("_m128")
    assert spec.template == "cuflash::bwd_sm90_kernel<cuflash::half_t, 64, 128, false, false, false, false>"
    assert tma.map_layout(q, spec.block_m)[3][2] == 128
    assert spec in backward_sm90.all_specs()
    specs = backward_sm90.all_specs()
    assert backward_sm90.BwdSm90Spec("fp16", 64, False, True, 128) in specs
    assert backward_sm90.BwdSm90Spec("fp16", 64, False, True, 128, fixed=True) in specs  # deterministic mode
    assert backward_sm90.BwdSm90Spec("fp16", 64, False, True, 128, dropout=True) not in specs  # 64 rows


def test_sm90_forward_is_chosen_only_where_it_applies(configure):
    from cuflash import checks
    from cuflash.ops import forward
    problem = checks.Problem(2, 300, 16384, 8, 2, 128, np.dtype(np.float16))  # past SM90_SHORT_SEQLEN keys
    configure(sm90=True)
    assert forward.sm90_variant(problem, "sm_90a") == forward.sm90_variants()[128]
    assert forward.sm90_variant(problem, "sm_80") is None       # not Hopper
    between = checks.Problem(2, 300, 300, 8, 2, 96, np.dtype(np.float16))
    assert forward.sm90_variant(between, "sm_90a") == forward.sm90_variant(
        checks.Problem(2, 300, 300, 8, 2, 128, np.dtype(np.float16)), "sm_90a")  # runs on the d = 128 kernel
    for d in (32, 36, 100):  # below plan.HOPPER_MIN_HEADDIM, or not a multiple of 8
        assert forward.sm90_variant(checks.Problem(2, 300, 300, 8, 2, d, np.dtype(np.float16)), "sm_90a") is None
    configure(sm90=False)
    assert forward.sm90_variant(problem, "sm_90a") is None      # opt-in


def test_sm90_forward_short_sequences_take_their_own_variant(configure, monkeypatch):
    """forward.SM90_SHORT_VARIANTS: up to SM90_SHORT_SEQLEN keys, per (head dim, band, most keys), the entry with the
    fewest keys that covers the call; longer, the head dim's variant; the short table drops the head dims
    CUFLASH_SM90_VARIANTS names."""
    from cuflash import checks
    from cuflash.ops import forward, forward_sm90
    configure(sm90=True)
    monkeypatch.setattr(forward, "SM90_DEFAULT_VARIANTS", {64: "ws3_n128", 128: "pingpong_n128"})
    short = {(64, False, 512): "ws", (64, False, forward.SM90_SHORT_SEQLEN): "lockstep", (64, True, 2048): "ws_n128_p",
             (128, True, 1024): "ws_n128"}
    monkeypatch.setattr(forward, "SM90_SHORT_VARIANTS", short)
    at = lambda d, seqlen_k: checks.Problem(2, 1000, seqlen_k, 8, 2, d, np.dtype(np.float16))  # noqa: E731
    assert forward.sm90_variant(at(64, 512), "sm_90a") == "ws"
    assert forward.sm90_variant(at(64, 513), "sm_90a") == "lockstep"
    assert forward.sm90_variant(at(64, forward.SM90_SHORT_SEQLEN), "sm_90a") == "lockstep"
    assert forward.sm90_variant(at(64, 100), "sm_90a", band=True) == "ws_n128_p"
    long = at(64, forward.SM90_SHORT_SEQLEN + 1)
    assert forward.sm90_variant(long, "sm_90a") == forward.sm90_variant(long, "sm_90a", True) == "ws3_n128"
    assert forward.sm90_variant(at(128, 1024), "sm_90a", band=True) == "ws_n128"
    assert forward.sm90_variant(at(128, 1025), "sm_90a", band=True) == "pingpong_n128"
    assert forward.sm90_variant(at(128, 1000), "sm_90a") == "pingpong_n128"
    for (d, band, bound), variant in forward.SM90_SHORT_VARIANTS.items():
        assert d in forward.SM90_DEFAULT_VARIANTS and variant in forward_sm90.VARIANTS
        assert 0 < bound <= forward.SM90_SHORT_SEQLEN


def test_sm90_short_table_settings(configure):
    """CUFLASH_SM90_SHORT_VARIANTS replaces the short-sequence table ("c": causal or local, "@N": up to N keys; ""
    empties it); the head dims CUFLASH_SM90_VARIANTS names leave it."""
    from cuflash import settings
    from cuflash.ops import forward

    def table(env):
        s = settings.Settings.from_env(env)
        configure(sm90_variants=s.sm90_variants, sm90_short_variants=s.sm90_short_variants)
        return forward.sm90_short_variants()

    assert table({}) == forward.SM90_SHORT_VARIANTS
    assert all(d != 64 for d, _, _ in table({"CUFLASH_SM90_VARIANTS": "64:ws"}))
    assert table({"CUFLASH_SM90_VARIANTS": "128:ws"})
    text = "64:ws_n128_p,128c@1024:pingpong_n128_p"
    assert table({"CUFLASH_SM90_SHORT_VARIANTS": text}) == {(64, False, forward.SM90_SHORT_SEQLEN): "ws_n128_p",
                                                            (128, True, 1024): "pingpong_n128_p"}
    assert table({"CUFLASH_SM90_VARIANTS": "128:ws", "CUFLASH_SM90_SHORT_VARIANTS": text}) == {
        (64, False, forward.SM90_SHORT_SEQLEN): "ws_n128_p"}
    assert table({"CUFLASH_SM90_SHORT_VARIANTS": ""}) == {}
    with pytest.raises(ValueError, match="bounds the keys"):
        table({"CUFLASH_SM90_SHORT_VARIANTS": f"64@{forward.SM90_SHORT_SEQLEN + 1}:ws"})


@pytest.mark.parametrize("variant", list(forward_sm90.VARIANTS))
def test_sm90_forward_call_params_and_maps(configure, no_gpu_kernels, monkeypatch, variant):
    """forward.forward_call routes an eligible call to the Hopper kernel: its struct holds out's strides, the sizes,
    the window and the scale; the tensor maps' layouts pass TMA's rules, also for extent-1 axes with odd
    strides (a sliced view), which are replaced by contiguous ones."""
    from cuflash import checks, options, tma
    from cuflash.ops import forward, forward_sm90
    configure(sm90=True)
    monkeypatch.setattr(forward, "SM90_DEFAULT_VARIANTS", {64: variant, 128: variant, 256: variant})
    monkeypatch.setattr(forward, "SM90_SHORT_VARIANTS", {})  # every length
    problem = checks.Problem(1, 200, 333, 8, 2, 128, np.dtype(np.float16))
    q = _FakeDeviceArray(np.zeros((1, 200, 8, 128), np.float16), 0)
    kv = checks.TensorSpec("k", (1, 333, 2, 128), np.dtype(np.float16), (7, 3 * 128, 128, 1), 0)  # batch stride odd
    out = checks.contiguous("out", q.shape, np.float16)
    call = _forward_call(problem, q, kv, kv, out, None, device_id=0, softmax_scale=0.5, causal=True,
                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None)
    assert isinstance(call, forward_sm90.ForwardCall)
    assert call.spec == forward_sm90.variant_spec(variant, "fp16", 128, True, False)
    p = np.frombuffer(call.kernel_call.params(), forward_sm90.PARAMS_DTYPE)[0]
    assert (p["o_batch_stride"], p["o_row_stride"], p["o_head_stride"]) == (200 * 8 * 128, 8 * 128, 128)
    assert (p["seqlen_q"], p["seqlen_k"], p["nheads"], p["heads_per_kv"]) == (200, 333, 8, 4)
    assert (p["window_left"], p["window_right"]) == (-1, 0) and np.isclose(p["scale_log2"], 0.5 * options.LOG2E)
    # softcap and (batch, heads) ALiBi slopes: the score-mod kernel, natural-log scores, the slopes' row stride
    slopes = checks.contiguous("alibi_slopes", (1, 8), np.float32)
    call = _forward_call(problem, q, kv, kv, out, None, device_id=0, softmax_scale=0.5, causal=False,
                         window_size=(-1, -1), softcap=20.0, alibi_slopes=slopes)
    assert isinstance(call, forward_sm90.ForwardCall) and call.spec.score_mod and not call.spec.band
    p = np.frombuffer(call.kernel_call.params(), forward_sm90.PARAMS_DTYPE)[0]
    assert np.isclose(p["scale_log2"], options.LOG2E) and np.isclose(p["mod_scale"], 0.5 / 20.0)
    assert p["softcap"] == 20.0 and p["alibi_batch_stride"] == 8
    assert forward_sm90.PARAMS_DTYPE.fields["cu_seqlens_k"][1] + 8 == 4 * 128 + 5 * 8  # the call's head
    assert p["o_tma"] == forward_sm90.o_tma(128)
    # packed sequences: 3-D maps over the tokens, row strides as batch strides, lse (nheads, total_q)
    qp = _FakeDeviceArray(np.zeros((500, 8, 128), np.float16), 0)
    kp = _FakeDeviceArray(np.zeros((700, 2, 128), np.float16), 0)
    call = _forward_call(problem, qp, kp, kp, checks.contiguous("out", qp.shape, np.float16),
                         checks.contiguous("lse", (8, 500), np.float32), device_id=0, softmax_scale=None,
                         causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None)
    assert isinstance(call, forward_sm90.ForwardCall)
    p = np.frombuffer(call.kernel_call.params(), forward_sm90.PARAMS_DTYPE)[0]
    assert (p["o_batch_stride"], p["o_row_stride"], p["o_head_stride"]) == (8 * 128, 8 * 128, 128)
    assert (p["lse_batch_stride"], p["lse_head_stride"]) == (1, 500)
    assert tma.map_layout(qp, forward_sm90.BLOCK_M)[1:] == ((128, 8, 500), (256, 8 * 256), (64, 1, 128))
    tma.check_tiled(0x10000, *tma.map_layout(kp, forward_sm90.BLOCK_N), 128)
    # ceil(200 / 128) query blocks, heads, batch; the persistent kernel: one CTA per tile up to one per SM
    assert call.kernel_call.launches[0][1:4] == ((16, 1, 1) if call.spec.persistent else (2, 8, 1))
    assert np.frombuffer(call.kernel_call.params(), forward_sm90.PARAMS_DTYPE)[0]["batch"] == 1
    for x, rows in ((q, forward_sm90.BLOCK_M), (kv, forward_sm90.BLOCK_N), (out, 64)):
        dtype, dims, strides, box = tma.map_layout(x, rows)
        tma.check_tiled(0x10000, dtype, dims, strides, box, 128)
    # rows as given, batch made valid
    assert tma.map_layout(kv, forward_sm90.BLOCK_N)[2] == (256, 3 * 256, 333 * 2 * 256)


def test_hopper_specs_are_distinct_and_fit_shared_memory():
    from cuflash.ops import forward_sm90
    specs = forward_sm90.all_specs()
    every = {forward_sm90.variant_spec(variant, dtype, d, band, mod)
             for variant in forward_sm90.VARIANTS for d in forward_sm90.HEADDIMS for dtype in ("fp16", "bf16")
             for band in (False, True) for mod in (False, True)}
    dropout = {forward_sm90.variant_spec(forward_sm90.DROPOUT_VARIANTS[d, band], dtype, d, band, mod, dropout=True)
               for d in forward_sm90.HEADDIMS for dtype in ("fp16", "bf16") for band in (False, True)
               for mod in (False, True)}
    paged = {forward_sm90.variant_spec(forward_sm90.PAGED_VARIANT, dtype, d, band, mod, paged=True)
             for d in forward_sm90.HEADDIMS for dtype in ("fp16", "bf16") for band in (False, True)
             for mod in (False, True)}
    assert set(specs) == every | dropout | paged and len(specs) == len(every) + len(dropout) + len(paged)
    assert {s.block_n for s in specs} == {64, 80, 128, 176}
    assert all(s.block_n in (64, 80) for s in specs if s.headdim == 256)
    assert all(s.headdim == 128 for s in specs if s.block_n == 176) and all(s.headdim == 256 for s in specs
                                                                           if s.block_n == 80)
    assert len({s.name for s in specs}) == len(specs) == len({s.template for s in specs})


def test_sm90_three_consumer_tile(configure, no_gpu_kernels, monkeypatch):
    """ws3_n128 at d = 64: 192 query rows per CTA (grid and Q's tensor-map box follow), 512 threads; with a score mod,
    or at d = 128, the two-warpgroup ws_n128 kernel. The persistent ws_n128_p launches one CTA per tile, at most
    one per SM, and passes the batch."""
    from cuflash import checks, tma
    from cuflash.ops import forward, forward_sm90
    spec = forward_sm90.variant_spec("ws3_n128", "bf16", 64, False, False)
    assert (spec.block_m, spec.threads, spec.block_n, spec.consumers) == (192, 512, 128, 3) and "_m192" in spec.name
    assert ", 4, 3, false, true, false, false, false, false, false, false>" in spec.template
    split = forward_sm90.variant_spec("ws3_n128_p_split", "bf16", 64, False, False)  # persistent, split tiles
    assert split.split and split.persistent and split.consumers == 3 and split.template.endswith(", true, true, false, false>")
    assert forward_sm90.variant_spec("ws3_n128_p_split", "bf16", 64, False, True) == forward_sm90.variant_spec(
        "ws_n128_p", "bf16", 64, False, True)  # a score mod: two warpgroups, no split
    assert (forward_sm90.variant_spec("ws3_n128", "bf16", 64, False, True)
            == forward_sm90.variant_spec("ws_n128", "bf16", 64, False, True))
    assert (forward_sm90.variant_spec("ws3_n128", "bf16", 128, True, False)
            == forward_sm90.variant_spec("ws_n128", "bf16", 128, True, False))
    configure(sm90=True)
    monkeypatch.setattr(forward, "SM90_DEFAULT_VARIANTS", {64: "ws3_n128"})
    monkeypatch.setattr(forward, "SM90_SHORT_VARIANTS", {})  # every length
    problem = checks.Problem(2, 400, 400, 4, 4, 64, np.dtype(np.float16))
    q = _FakeDeviceArray(np.zeros((2, 400, 4, 64), np.float16), 0)
    out = checks.contiguous("out", q.shape, np.float16)
    call = _forward_call(problem, q, q, q, out, None, device_id=0, softmax_scale=None, causal=False,
                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None)
    assert call.spec == spec.__class__("fp16", 64, False, **forward_sm90.variant_options("ws3_n128", 64))
    assert call.kernel_call.launches[0][1:5] == (3, 4, 2, 512)  # ceil(400 / 192) query blocks, heads, batch; threads
    assert tma.map_layout(q, call.spec.block_m)[3] == (64, 1, 192, 1)
    # persistent: 4 x 4 x 2 = 32 tiles, fewer than the SMs: one CTA each; a longer sequence: one CTA per SM
    monkeypatch.setattr(forward, "SM90_DEFAULT_VARIANTS", {64: "ws_n128_p"})
    monkeypatch.setattr(forward, "SM90_SHORT_VARIANTS", {})  # every length
    call = _forward_call(problem, q, q, q, out, None, device_id=0, softmax_scale=None, causal=False,
                         window_size=(-1, -1), softcap=0.0, alibi_slopes=None)
    assert call.spec.persistent and call.spec.consumers == 2 and call.kernel_call.launches[0][1:5] == (32, 1, 1, 384)
    long = checks.Problem(2, 40000, 400, 4, 4, 64, np.dtype(np.float16))
    ql = _FakeDeviceArray(np.zeros((2, 40000, 4, 64), np.float16), 0)
    call = _forward_call(long, ql, q, q, checks.contiguous("out", ql.shape, np.float16), None, device_id=0,
                         softmax_scale=None, causal=True, window_size=(-1, -1), softcap=0.0, alibi_slopes=None)
    assert call.kernel_call.launches[0][1:4] == (132, 1, 1) and call.spec.band
    p = np.frombuffer(call.kernel_call.params(), forward_sm90.PARAMS_DTYPE)[0]
    assert (p["seqlen_q"], p["nheads"], p["batch"]) == (40000, 4, 2)


def test_sm90_o_tma_per_variant(configure, no_gpu_kernels, monkeypatch):
    """p.o_tma is forward_sm90.o_tma's entry for the head dim whatever the variant: the
    split variant (ws3_n128_p_split) writes O from registers by itself (test_compile.py checks its PTX)."""
    from cuflash import checks
    from cuflash.ops import forward, forward_sm90
    configure(sm90=True)
    monkeypatch.setattr(forward, "SM90_SHORT_VARIANTS", {})
    problem = checks.Problem(2, 1024, 1024, 4, 4, 64, np.dtype(np.float16))
    q = _FakeDeviceArray(np.zeros((2, 1024, 4, 64), np.float16), 0)
    for table in (1, 0):
        configure(sm90_o_tma=table)
        for variant, want in (("ws3_n128_p_split", table), ("ws3_n128_p", table), ("ws_n128_p", table)):
            monkeypatch.setattr(forward, "SM90_DEFAULT_VARIANTS", {64: variant})
            call = _forward_call(problem, q, q, q, checks.contiguous("out", q.shape, np.float16), None,
                                 device_id=0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                 softcap=0.0, alibi_slopes=None)
            assert call.spec.split == (variant == "ws3_n128_p_split")
            assert np.frombuffer(call.kernel_call.params(), forward_sm90.PARAMS_DTYPE)[0]["o_tma"] == want, variant


def test_kernel_call_head_write_keeps_the_rest():
    """launch_head replaces the struct's first bytes (the Hopper kernel's tensor maps and pointers) and nothing else."""
    from cuflash.ops import forward_sm90
    from cuflash.launcher import KernelCall
    p = np.zeros((), forward_sm90.PARAMS_DTYPE)
    p["seqlen_q"], p["softcap"] = 123, 2.5
    call = KernelCall((), p, ())
    head = bytes(range(256)) * 1 + bytes(128) + bytes(range(128)) + forward_sm90._POINTERS.pack(*range(1, 11))
    call.launch_head(0, head)  # no launches: only the struct is written
    got = np.frombuffer(call.params(), forward_sm90.PARAMS_DTYPE)[0]
    assert bytes(got["q"]) + bytes(got["k"]) == bytes(range(256)) and bytes(got["v"]) == bytes(128)
    assert bytes(got["o_map"]) == bytes(range(128))
    assert [int(got[n]) for n in forward_sm90._POINTER_NAMES] == list(range(1, 11))
    assert got["seqlen_q"] == 123 and got["softcap"] == 2.5


def test_overlapped_launch_builds_the_driver_config():
    """A launch with `overlap` goes through cuLaunchKernelEx with programmatic stream serialization allowed: the
    ctypes structs match cuda.h's layout (CUlaunchAttribute 72 bytes, value at 8; CUlaunchConfig 56 bytes, stream
    at 32, attrs at 40, numAttrs at 48), and the plain launch's arguments are unchanged."""
    import ctypes
    from cuflash import launcher
    assert ctypes.sizeof(launcher._LaunchAttribute) == 72 and launcher._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(launcher._LaunchConfig) == 56
    assert (launcher._LaunchConfig.stream.offset, launcher._LaunchConfig.attrs.offset,
            launcher._LaunchConfig.num_attrs.offset) == (32, 40, 48)
    plain = launcher._Launch(7, (3, 2, 1), (256, 1, 1), 1024, 99, False)
    over = launcher._Launch(7, (3, 2, 1), (256, 1, 1), 1024, 99, True)
    assert tuple(plain) == tuple(over) == (7, 3, 2, 1, 256, 1, 1, 1024, 99) and plain[1:4] == (3, 2, 1)
    cfg = over._config
    assert list(cfg.grid) == [3, 2, 1] and list(cfg.block) == [256, 1, 1] and cfg.shared_mem_bytes == 1024
    assert cfg.num_attrs == 1 and cfg.attrs[0].id == 6 and cfg.attrs[0].value == 1


def test_kernel_call_overlaps_only_the_launches_that_ask():
    """KernelCall: a (kernel, grid, block, smem) launch is a plain one; a fifth element True makes that launch a
    programmatic dependent, False keeps it plain."""
    from types import SimpleNamespace
    from cuflash.ops import decode
    from cuflash.launcher import KernelCall
    kernel = SimpleNamespace(kernel=SimpleNamespace(ptr=7))
    call = KernelCall([(kernel, 2, 128, 0), (kernel, (3, 1), (256,), 64, True), (kernel, 1, 32, 0, False)],
                      np.zeros((), decode.PARAMS_DTYPE), ())
    assert [launch.overlap for launch in call.launches] == [False, True, False]
    assert call.launches[1][1:4] == (3, 1, 1) and call.launches[1][7] == 64


def test_decode_combine_overlaps_only_on_hopper(configure):
    """decode.pdl_applies: decode_combine is launched as a programmatic dependent on sm_90 only, and CUFLASH_PDL=0
    (PDL["enabled"] False) turns it off."""
    from cuflash.ops import decode
    assert decode.pdl_applies("sm_90a") and not decode.pdl_applies("sm_80") and not decode.pdl_applies("sm_86")
    configure(pdl=False)
    assert not decode.pdl_applies("sm_90a")


def test_decode_tma_params_extend_decode_params():
    """DecodeTmaParams: DecodeParams' fields at the same offsets (the append and combine kernels of a TMA call read
    that prefix of the same buffer), then the two tensor maps on 64-byte boundaries."""
    from cuflash.ops import decode
    base, ext = decode.PARAMS_DTYPE, decode.TMA_PARAMS_DTYPE
    assert ext.names[:len(base.names)] == base.names
    assert all(ext.fields[n][1] == base.fields[n][1] and ext.fields[n][0] == base.fields[n][0] for n in base.names)
    offset = decode.TMA_MAPS_OFFSET
    assert offset % 64 == 0 and offset >= base.itemsize
    assert (ext.fields["k_map"][1], ext.fields["v_map"][1], ext.itemsize) == (offset, offset + 128, offset + 256)


def test_decode_tma_applies_only_where_it_can(configure):
    from cuflash import plan
    from cuflash.ops import decode
    configure(decode_tma=True)
    assert decode.tma_applies("sm_90a", 128, 4, 0) and decode.tma_applies("sm_90a", 64, 16, 128)
    assert not decode.tma_applies("sm_80", 128, 4, 0)           # Hopper only
    assert not decode.tma_applies("sm_90a", 96, 4, 0)           # head dims exactly 64 / 128
    assert not decode.tma_applies("sm_90a", 128, 17, 0)         # more rows than one 16-row tile
    assert not decode.tma_applies("sm_90a", 128, 4, 48)         # a 64-row block would straddle pages
    assert not decode.tma_applies("sm_90a", 128, 4, 8)          # boxes under 16 rows
    assert decode.tma_applies("sm_90a", 128, 4, 16) and decode.tma_applies("sm_90a", 64, 4, 32)  # a box per page
    assert [decode.tma_config(3, page_size=ps).page_boxes for ps in (0, 16, 32, 64, 256)] == [1, 4, 2, 1, 1]
    assert [decode.page_boxes(ps, 64, 64) for ps in (0, 16, 32, 48, 64, 128)] == [1, 0, 2, 0, 1, 1]  # 2 KB boxes
    assert decode.page_boxes(32, 128, 128) == 0                # only 64-key blocks span pages
    configure(decode_tma=False)
    assert not decode.tma_applies("sm_90a", 128, 4, 0)
    spec = decode.DecodeSpec("bf16", 128, decode.tma_config(3), False)
    assert spec.name == "decode_bf16_d128_r1n64s3_tma" and spec.template.startswith("cuflash::decode_tma_kernel<")
    assert spec.smem_bytes <= plan.SMEM_PER_SM and spec in decode.all_specs("sm_90a")  # compiled ahead
    assert spec not in decode.all_specs("sm_80")
    assert decode.DecodeSpec("bf16", 128, decode.tma_config(6), False).smem_bytes <= plan.SMEM_PER_SM  # on demand
    configure(decode_tma=True)                                  # an e4m3 cache: 128-key blocks
    assert decode.tma_applies("sm_90a", 128, 4, 256, fp8=True) and decode.tma_applies("sm_90a", 64, 4, 0, fp8=True)
    assert decode.tma_applies("sm_90a", 128, 4, 64, fp8=True) and decode.tma_applies("sm_90a", 64, 4, 128, fp8=True)
    assert decode.tma_applies("sm_90a", 128, 4, 16, fp8=True) and decode.tma_applies("sm_90a", 64, 4, 32, fp8=True)
    assert not decode.tma_applies("sm_90a", 64, 4, 16, fp8=True)      # 1 KB boxes: the cp.async kernel
    assert not decode.tma_applies("sm_90a", 128, 4, 48, fp8=True)     # pages of 48 rows: the cp.async kernel
    for d in decode.TMA_HEADDIMS:   # blocks inside one page first, else 64 keys, a box per page
        configs = [decode.tma_config(fp8_headdim=d, page_size=ps) for ps in (0, 16, 32, 64, 128, 256, 512)]
        shapes = [(c.block_n, c.page_boxes) if c else None for c in configs]
        assert shapes == {64: [(256, 1), None, (64, 2), (64, 1), (64, 1), (256, 1), (256, 1)],
                          128: [(128, 1), (64, 4), (64, 2), (64, 1), (128, 1), (128, 1), (128, 1)]}[d]
        for config in decode.TMA_FP8_CONFIGS[d]:
            spec = decode.DecodeSpec("bf16", d, config, False, True)
            assert spec.name.endswith("_tma_e4m3") and spec.template.endswith(", true>")
            assert spec.smem_bytes <= plan.SMEM_PER_SM and spec in decode.all_specs("sm_90a")
    names = {s.name for s in decode.all_specs("sm_90a")}   # the kernels of pages of 16 and 32 rows compiled ahead
    assert {"decode_bf16_d128_r1n64s3_tma_b4", "decode_fp16_d64_r1n64s3_tma_b2_mod",
            "decode_bf16_d128_r1n64s6_tma_b4_e4m3", "decode_bf16_d64_r1n64s8_tma_b2_e4m3"} <= names
    assert "decode_bf16_d64_r1n64s8_tma_b4_e4m3" not in names


def test_decode_tma_maps_cover_the_cache(configure, monkeypatch):
    """The TMA kernel's maps: the cache as (d, KV heads, rows, cache rows or pages) with its own strides, boxes of
    one 64 x 64 panel; None where the planner's switch is off or the call is not covered."""
    from cuflash import checks, tma
    from cuflash.ops import decode
    seen = []
    monkeypatch.setattr(tma, "encoder", lambda *layout, swizzle: seen.append((layout, swizzle)) or len(seen))
    problem = checks.Problem(2, 1, 1024, 32, 8, 128, np.dtype(np.float16))
    storage = np.zeros((2, 8, 1024, 128), np.float16)            # SDPA's layout, viewed (b, len, hk, d)
    kc = _FakeDeviceArray(storage.transpose(0, 2, 1, 3), 0x10000)
    configure(decode_tma=True)
    assert decode.tma_maps(problem, kc, kc, None, "sm_90a") == (1, 2)
    (dtype, dims, strides, box), swizzle = seen[0]
    assert dims == (128, 8, 1024, 2) and strides == (1024 * 128 * 2, 128 * 2, 8 * 1024 * 128 * 2)
    assert box == (64, 1, 64, 1) and swizzle == 128
    pool = _FakeDeviceArray(np.zeros((10, 48, 8, 128), np.float16), 0x10000)
    assert decode.tma_maps(problem, pool, pool, object(), "sm_90a") is None   # 48-row pages
    assert decode.tma_maps(problem, kc, kc, None, "sm_80") is None
    configure(decode_tma=False)
    assert decode.tma_maps(problem, kc, kc, None, "sm_90a") is None
    configure(decode_tma=True)   # e4m3 caches: one box a whole row of d bytes, 128-byte or (d 64) 64-byte swizzle
    for d, swizzle in ((128, 128), (64, 64)):
        seen.clear()
        bits = _FakeDeviceArray(np.zeros((2, 1024, 8, d), np.uint8), 0x10000)
        fp8_problem = checks.Problem(2, 1, 1024, 32, 8, d, np.dtype(np.float16))
        assert decode.tma_maps(fp8_problem, bits, bits, None, "sm_90a", fp8=True) == (1, 2)
        (dtype, dims, strides, box), got_swizzle = seen[0]
        block_n = decode.TMA_FP8_CONFIGS[d][0].block_n
        assert dtype == np.uint8 and dims == (d, 8, 1024, 2) and box == (d, 1, block_n, 1) and got_swizzle == swizzle
    seen.clear()                 # 64-row pages: 64-key blocks (a 128-key one would straddle two pages)
    pages = _FakeDeviceArray(np.zeros((10, 64, 8, 128), np.uint8), 0x10000)
    paged_problem = checks.Problem(2, 1, 640, 32, 8, 128, np.dtype(np.float16))
    assert decode.tma_maps(paged_problem, pages, pages, object(), "sm_90a", fp8=True) is not None
    assert seen[0][0][3] == (128, 1, 64, 1)
    seen.clear()                 # 32-row pages: 64-key blocks of two boxes of 32 rows
    pages = _FakeDeviceArray(np.zeros((20, 32, 8, 128), np.uint8), 0x10000)
    assert decode.tma_maps(paged_problem, pages, pages, object(), "sm_90a", fp8=True) is not None
    assert seen[0][0][3] == (128, 1, 32, 1)
    seen.clear()                 # a 16-bit cache in 16-row pages: 64-key blocks of four boxes of 16 rows
    pages = _FakeDeviceArray(np.zeros((40, 16, 8, 128), np.float16), 0x10000)
    assert decode.tma_maps(paged_problem, pages, pages, object(), "sm_90a") is not None
    assert seen[0][0][3] == (64, 1, 16, 1)
    pages = _FakeDeviceArray(np.zeros((80, 8, 8, 128), np.float16), 0x10000)
    assert decode.tma_maps(paged_problem, pages, pages, object(), "sm_90a") is None   # 8-row pages


def test_kernel_call_with_tail_writes_pointers_and_tail():
    from cuflash.ops import decode
    from cuflash.launcher import KernelCall
    p = np.zeros((), decode.TMA_PARAMS_DTYPE)
    p["headdim"] = 128
    DECODE_POINTERS = decode.POINTERS
    assert DECODE_POINTERS[-1] == "v_descale" and len(DECODE_POINTERS) == 20
    call = KernelCall((), p, DECODE_POINTERS)
    tail = bytes(range(256))
    call.call_with_tail(0, decode.TMA_MAPS_OFFSET, tail, *range(1, 21))  # no launches: only the struct
    got = np.frombuffer(call.params(*range(1, 21)), decode.TMA_PARAMS_DTYPE)[0]
    assert [int(got[n]) for n in DECODE_POINTERS] == list(range(1, 21))
    assert bytes(got["k_map"]) + bytes(got["v_map"]) == tail and got["headdim"] == 128


def test_sm90_dropout_forward_takes_the_dropout_variant(configure, no_gpu_kernels):
    """On sm_90a a dropout call at d 64/128/256 takes its head dim's and mask kind's dropout variant (the kernel
    with dropout compiled in; with a score mod, that variant's score-mod kernel; three consumer warpgroups at d 64
    without a band) and its struct carries the threshold and the kept probabilities' scale."""
    from cuflash import checks, reference
    from cuflash.launcher import KernelCall
    from cuflash.ops import forward_sm90
    configure(sm90=True)
    for d in forward_sm90.HEADDIMS:
        problem = checks.Problem(2, 300, 300, 4, 2, d, np.dtype(np.float16))
        q = _FakeDeviceArray(np.zeros((2, 300, 4, d), np.float16), 0)
        k = _FakeDeviceArray(np.zeros((2, 300, 2, d), np.float16), 0)
        out = checks.contiguous("out", q.shape, np.float16)
        call = _forward_call(problem, q, k, k, out, None, device_id=0, softmax_scale=None, causal=True,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.3)
        want = forward_sm90.variant_spec(forward_sm90.DROPOUT_VARIANTS[d, True], "fp16", d, True, False, dropout=True)
        assert call.spec == want and call.spec.name.endswith("_drop") and call.spec in forward_sm90.all_specs()
        p = np.frombuffer(call.kernel_call.params(), forward_sm90.PARAMS_DTYPE)[0]
        threshold = reference.dropout_threshold(0.3)
        assert p["dropout_threshold"] == threshold and p["dropout_scale"] == np.float32(options.DROPOUT_LEVELS / threshold)
        plain = _forward_call(problem, q, k, k, out, None, device_id=0, softmax_scale=None, causal=True,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None)
        assert not plain.spec.dropout
        p = np.frombuffer(plain.kernel_call.params(), forward_sm90.PARAMS_DTYPE)[0]
        assert p["dropout_threshold"] == options.DROPOUT_LEVELS and p["dropout_scale"] == 1.0
        capped = _forward_call(problem, q, k, k, out, None, device_id=0, softmax_scale=None, causal=True,
                               window_size=(-1, -1), softcap=5.0, alibi_slopes=None, dropout_p=0.3)
        assert capped.spec == forward_sm90.variant_spec(forward_sm90.DROPOUT_VARIANTS[d, True], "fp16", d, True, True,
                                                        dropout=True)
        assert capped.spec in forward_sm90.all_specs()
        full = _forward_call(problem, q, k, k, out, None, device_id=0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None, dropout_p=0.3)
        assert full.spec == forward_sm90.variant_spec(forward_sm90.DROPOUT_VARIANTS[d, False], "fp16", d, False, False,
                                                      dropout=True)
        assert full.spec.consumers == (3 if d == 64 else 2) and full.spec in forward_sm90.all_specs()
