"""CPU tests of the FP8 forward's interface (cuflash.attention_fp8): its checks raise before any launch, naming the
argument, and its specializations, parameter struct, V^T key order and in-kernel transpose are what the kernels
expect."""
import dataclasses

import numpy as np
import pytest

from cuflash import checks, settings
from cuflash.ops import forward_fp8

U8 = np.uint8


def arrays(b=2, sq=33, sk=70, h=4, hk=2, d=64, dtype=U8):
    return (np.zeros((b, sq, h, d), dtype), np.zeros((b, sk, hk, d), dtype), np.zeros((b, sk, hk, d), dtype))


def test_check_accepts_uint8_and_descales():
    q, k, v = arrays()
    problem = checks.check_attention_fp8(q, k, v, q_descale=np.ones((2, 2), np.float32),
                                         k_descale=np.ones((2, 2), np.float32), causal=True)
    checks.check_attention_fp8(q, k, v, q_descale=np.ones((), np.float32), v_descale=np.ones((1,), np.float32))
    assert (problem.batch, problem.seqlen_q, problem.seqlen_k, problem.nheads, problem.nheads_k,
            problem.headdim) == (2, 33, 70, 4, 2, 64)


@pytest.mark.parametrize("bad, error, match", [
    (dict(dtype=np.float16), TypeError, "q: dtype float16 is not supported; expected uint8"),
    (dict(d=72), ValueError, "multiples of 16"),
    (dict(h=3), ValueError, "not a multiple of nheads_k"),
])
def test_check_rejects_bad_arrays(bad, error, match):
    with pytest.raises(error, match=match):
        checks.check_attention_fp8(*arrays(**bad))


def test_check_rejects_bad_descales():
    q, k, v = arrays()
    with pytest.raises(TypeError, match="q_descale: dtype float64"):
        checks.check_attention_fp8(q, k, v, q_descale=np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"v_descale: expected shape \(\) or \(1,\).*\(2, 2\), got \(2, 4\)"):
        checks.check_attention_fp8(q, k, v, v_descale=np.ones((2, 4), np.float32))


def test_check_rejects_strides_tma_cannot_load():
    q, k, v = arrays(d=64)
    wide = np.zeros((2, 70, 2, 72), U8)[..., :64]  # row stride 144 bytes: fine; head stride 72: not
    with pytest.raises(ValueError, match="k: stride of axis 2 is 72 bytes"):
        checks.check_attention_fp8(q, wide, v)


def test_specs_and_params():
    specs = forward_fp8.all_specs()
    assert {s.name for s in specs} == {f"fwd_fp8_sm90_d{d}{form}{vt}" for d in (64, 128) for vt in ("", "_vt")
                                       for form in ("_w3", "_pp", "_band", "_pp_band")} | {
        f"fwd_fp8_sm90_d256{band}{vt}" for band in ("", "_band") for vt in ("", "_vt")} | {"fp8_transpose_v"}
    forms = [(s.warpgroups, s.pipelined) for d in (64, 128, 256) for s in (forward_fp8.kernel_spec(d, False, 1024),
                                                                            forward_fp8.kernel_spec(d, True, 1024))]
    assert forms == [(3, False), (2, True), (3, False), (2, True), (2, False), (2, False)]
    assert [forward_fp8.quantized_sums(d) for d in (16, 64, 80, 128, 256)] == [True, True, True, True, False]
    assert [forward_fp8.quantized_sums(d, band=True) for d in (64, 128, 256)] == [True, False, False]
    with settings.override(fp8_pipelined=1):
        assert [(s.warpgroups, s.pipelined) for s in (forward_fp8.kernel_spec(128, False, 1024),
                                                      forward_fp8.kernel_spec(256, False, 1024))] == [
            (2, True), (2, False)]
        assert not forward_fp8.quantized_sums(128)  # the pipelined form keeps the fp32 sums
    with settings.override(fp8_pipelined=0):
        assert [(s.warpgroups, s.pipelined) for s in (forward_fp8.kernel_spec(64, False, 1024),
                                                      forward_fp8.kernel_spec(64, True, 1024))] == [
            (3, False), (2, False)]
        assert forward_fp8.quantized_sums(128, band=True)  # the simple form under a band: the tensor-core sums
    assert [(s.threads, s.block_m) for s in (forward_fp8.kernel_spec(64, False, 1024),
                                             forward_fp8.kernel_spec(64, True, 1024))] == [(512, 192), (384, 128)]
    assert forward_fp8.PARAMS_DTYPE.itemsize == 640 and forward_fp8.TRANSPOSE_DTYPE.itemsize == 72
    assert [forward_fp8.compiled_headdim(d) for d in (16, 64, 80, 128, 144, 256)] == [64, 64, 128, 128, 256, 256]


def test_vt_pass_from_its_table_or_the_setting():
    """V^T comes from the pass from VT_PASS_FROM keys on (per compiled head dim, band), with its workspace's shape;
    below, the kernel transposes V and there is no workspace. The setting forces either."""
    for d, call_d in ((64, 48), (128, 128), (256, 200)):
        for band in (False, True):
            start = forward_fp8.VT_PASS_FROM[d][band]
            assert not forward_fp8.kernel_spec(call_d, band, start - 1).vt_pass
            assert forward_fp8.kernel_spec(call_d, band, start).vt_pass
            problem = checks.Problem(2, 100, start + 5, 8, 4, call_d, np.dtype(np.uint8))
            assert forward_fp8.vt_shape(problem, band) == (2, 4, call_d, -(-(start + 5) // 32) * 32)
            assert forward_fp8.vt_shape(dataclasses.replace(problem, seqlen_k=start - 1), band) is None
    with settings.override(fp8_vt_pass=0):
        assert not forward_fp8.kernel_spec(128, False, 1 << 20).vt_pass
    with settings.override(fp8_vt_pass=1):
        assert forward_fp8.kernel_spec(128, True, 1).vt_pass


def chunk_key(s):
    """The key V^T slot s of a 32-key chunk holds (fwd_fp8_sm90.cu, the top)."""
    c, i = (s % 16) // 4, s % 4
    return 16 * (s // 16) + 2 * c + (i & 1) + 8 * (i >> 1)


def test_vt_key_order_matches_p_fragments():
    """Slot 4c + i of A register a[0] (and +16 for a[2]) must hold the key whose score the thread's accumulators
    give it in that position: keys 2c, 2c + 1, 2c + 8, 2c + 9 of each 16 (the m64nN accumulator layout)."""
    assert sorted(chunk_key(s) for s in range(32)) == list(range(32))
    for c in range(4):
        for half in range(2):
            accumulator_keys = [16 * half + x for x in (2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9)]
            assert [chunk_key(16 * half + 4 * c + i) for i in range(4)] == accumulator_keys


def swizzled(row, byte):
    """A byte's offset in a tile of 128-byte rows with the 128-byte swizzle (16-byte chunk c at c ^ (row % 8))."""
    return row * 128 + (((byte // 16) ^ (row % 8)) * 16) + byte % 16


def ldmatrix_x4_trans(smem, addresses):
    """ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: lane 8m + i gives the address of row i of matrix m (eight
    16-bit elements); lane t receives in r[m] elements (2 (t % 4), t / 4) and (2 (t % 4) + 1, t / 4) of matrix m,
    the first in the low half. Returns r as [m][lane] -> 4 bytes."""
    r = [[None] * 32 for _ in range(4)]
    for m in range(4):
        rows = addresses[8 * m:8 * m + 8]
        for t in range(32):
            j, c = t // 4, t % 4
            r[m][t] = bytes(smem[rows[2 * c] + 2 * j:rows[2 * c] + 2 * j + 2]) + bytes(
                smem[rows[2 * c + 1] + 2 * j:rows[2 * c + 1] + 2 * j + 2])
    return r


def stmatrix_x4(smem, addresses, regs):
    """stmatrix.sync.aligned.m8n8.x4.shared.b16: lane 8m + i gives the address of row i of matrix m; lane t's
    register m (4 bytes, regs[t][m]) is matrix m's row t / 4, bytes 4 (t % 4) ... Each matrix's 8 rows of 16 bytes
    must meet 32 different banks (one phase)."""
    for m in range(4):
        rows = addresses[8 * m:8 * m + 8]
        assert len({(a // 4 + x) % 32 for a in rows for x in range(4)}) == 32, f"matrix {m}: bank conflict"
        for t in range(32):
            at = rows[t // 4] + 4 * (t % 4)
            smem[at:at + 4] = np.frombuffer(regs[t][m], np.uint8)


def prmt(a, b, selector):
    pool = a + b
    return bytes(pool[(selector >> (4 * n)) & 7] for n in range(4))


def transpose_walk(walk, d, transposers=3):
    """The (g, q) units each transposing warp takes in FwdFp8::transpose_units / transpose_groups."""
    units = (128 // 16) * (d // 32)
    if walk == "units":
        return [[(u % 8, u // 8) for u in range(w, units, transposers)] for w in range(transposers)]
    return [[(g, q) for g in range(w, 8, transposers) for q in range(d // 32)] for w in range(transposers)]


@pytest.mark.parametrize("walk", ["units", "groups"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_in_kernel_v_transpose_model(d, walk):
    """FwdFp8::transpose, step for step on the CPU with ldmatrix.trans, prmt and stmatrix as PTX defines them: a V
    block (128 keys, TMA's swizzled rows of 128 bytes, d / 128 panels) becomes V^T (d rows of 128 keys, swizzled) with
    each 32-key chunk in chunk_key's order; every ldmatrix and stmatrix phase meets 32 different banks. Both walks
    (24 and 32 producer registers) take every unit once."""
    keys, panels, k_panel, transposers = 128, max(d // 128, 1), 128 * 128, 3
    v = np.random.default_rng(d).integers(0, 256, (keys, d), dtype=np.uint8)
    staging = np.zeros(panels * k_panel, np.uint8)
    for key in range(keys):
        for byte in range(d):
            staging[(byte // 128) * k_panel + swizzled(key, byte % 128)] = v[key, byte]
    vt = np.full(d * 128, 0xEE, np.uint8)
    walks = transpose_walk(walk, d, transposers)
    assert sorted(unit for units in walks for unit in units) == [(g, q) for g in range(8) for q in range(d // 32)]
    for units in walks:
        for g, q in units:
            addresses = []
            for lane in range(32):
                m = lane // 8
                ld_at = (8 * (m % 2) + lane % 8) * 128 + (((m // 2) ^ (lane % 8)) << 4)
                addresses.append((q // 4) * k_panel + g * 2048 + (ld_at ^ ((2 * (q % 4)) << 4)))
            for m in range(4):  # a phase: 8 rows of 16 bytes
                assert len({(a // 4 + x) % 32 for a in addresses[8 * m:8 * m + 8] for x in range(4)}) == 32
            r = ldmatrix_x4_trans(staging, addresses)
            regs, targets = [], []
            for lane in range(32):
                odd_first, m, i = lane >= 16, lane // 8, lane % 8
                words = []
                for h in range(2):
                    even, odd = (prmt(r[2 * h][lane], r[2 * h + 1][lane], sel) for sel in (0x6420, 0x7531))
                    words += [odd, even] if odd_first else [even, odd]
                regs.append(words)
                row = 16 * (m // 2) + 2 * i + ((m % 2) ^ (i >= 4))
                st_at = row * 128 + ((row % 8) << 4)
                targets.append(q * 4096 + (st_at ^ (g << 4)))
            stmatrix_x4(vt, targets, regs)
    expected = np.array([[v[32 * (s // 32) + chunk_key(s % 32), row] for s in range(keys)] for row in range(d)])
    got = np.array([[vt[swizzled(row, s)] for s in range(keys)] for row in range(d)])
    np.testing.assert_array_equal(got, expected)


def test_map_strides_replace_unit_axes():
    """An axis of extent 1 may have any stride (a view); its map stride is the contiguous one."""
    assert forward_fp8._map_strides((1, 70, 2, 64), (7, 256, 64, 1)) == (64, 256, 70 * 2 * 64)
    assert forward_fp8._map_strides((2, 70, 2, 64), (70 * 256, 256, 64, 1)) == (64, 256, 70 * 256)


def packed_arrays(total_q=90, total_k=130, h=4, hk=2, d=64, dtype=U8):
    cu = np.array([0, 40, 90], np.int32), np.array([0, 100, 130], np.int32)
    return (np.zeros((total_q, h, d), dtype), np.zeros((total_k, hk, d), dtype), np.zeros((total_k, hk, d), dtype),
            *cu, 50, 100)


def test_check_varlen_accepts_packed_uint8():
    problem = checks.check_varlen_fp8(*packed_arrays(), k_descale=np.ones((2, 2), np.float32), causal=True)
    assert (problem.batch, problem.seqlen_q, problem.seqlen_k, problem.nheads, problem.nheads_k,
            problem.headdim) == (2, 50, 100, 4, 2, 64)


@pytest.mark.parametrize("bad, error, match", [
    (dict(dtype=np.float16), TypeError, "q: dtype float16 is not supported; expected uint8"),
    (dict(d=72), ValueError, r"q: head dim \(axis 2\) is 72; the FP8 kernel takes multiples of 16"),
    (dict(h=3), ValueError, "not a multiple of nheads_k"),
])
def test_check_varlen_rejects_bad_arrays(bad, error, match):
    with pytest.raises(error, match=match):
        checks.check_varlen_fp8(*packed_arrays(**bad))


def test_check_varlen_rejects_descales_of_another_batch():
    with pytest.raises(ValueError, match=r"q_descale: expected shape \(\) or \(1,\).*\(2, 2\), got \(3, 2\)"):
        checks.check_varlen_fp8(*packed_arrays(), q_descale=np.ones((3, 2), np.float32))
    args = list(packed_arrays())
    args[3] = np.array([0, 40], np.float32)
    with pytest.raises(TypeError, match="cu_seqlens_q: dtype float32"):
        checks.check_varlen_fp8(*args)


def test_varlen_call_params():
    """Packed sequences: the call's head is the four maps, then the seven pointers, cu_seqlens_k last."""
    problem = checks.check_varlen_fp8(*packed_arrays())
    p = np.zeros((), forward_fp8.PARAMS_DTYPE)
    assert p.dtype.fields["cu_seqlens_k"][1] + 8 == 4 * 128 + 7 * 8
    assert forward_fp8.PARAMS_DTYPE.names[:4] == ("q", "k", "v", "o") and problem.seqlen_k == 100
    assert forward_fp8.TRANSPOSE_DTYPE.names[:3] == ("v", "vt", "cu_seqlens_k")


# ---- an e4m3 KV cache (cuflash.attention_with_kvcache with uint8 caches) ----

def cache_arrays(b=2, sq=1, cap=300, h=8, hk=2, d=128, cache_dtype=U8, q_dtype=np.float16):
    return (np.zeros((b, sq, h, d), q_dtype), np.zeros((b, cap, hk, d), cache_dtype),
            np.zeros((b, cap, hk, d), cache_dtype))


def test_kvcache_check_accepts_an_e4m3_cache_with_descales():
    q, kc, vc = cache_arrays()
    kn = np.zeros((2, 3, 2, 128), U8)
    problem = checks.check_kvcache(q, kc, vc, k=kn, v=kn, cache_seqlens=np.zeros(2, np.int32),
                                   k_descale=np.ones((2, 2), np.float32), v_descale=np.ones((2, 2), np.float32))
    assert (problem.batch, problem.seqlen_k, problem.nheads_k, problem.headdim, problem.dtype) == \
        (2, 300, 2, 128, np.float16)


@pytest.mark.parametrize("change, error, match", [
    (dict(v_cache=np.zeros((2, 300, 2, 128), np.float16)), TypeError, "v_cache: dtype float16 differs from k_cache's"),
    (dict(k=np.zeros((2, 3, 2, 128), np.float16), v=np.zeros((2, 3, 2, 128), np.float16)), TypeError,
     "k: dtype float16 differs from k_cache's uint8"),
    (dict(q=np.zeros((2, 1, 8, 128), U8)), TypeError, "q: dtype uint8 is not supported"),
    (dict(k_descale=np.ones((2, 8), np.float32)), ValueError, r"k_descale: expected shape .*\(2, 2\), got \(2, 8\)"),
    (dict(v_descale=np.ones((1,), np.float64)), TypeError, "v_descale: dtype float64"),
    (dict(rotary_cos=np.zeros((400, 32), np.float16), rotary_sin=np.zeros((400, 32), np.float16)), ValueError,
     "rotary_cos: not supported with an e4m3"),
])
def test_kvcache_check_rejects_bad_e4m3_arguments(change, error, match):
    q, kc, vc = cache_arrays()
    args = dict(q=q, k_cache=kc, v_cache=vc, k=np.zeros((2, 3, 2, 128), U8), v=np.zeros((2, 3, 2, 128), U8))
    args.update(change)
    with pytest.raises(error, match=match):
        checks.check_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"),
                             cache_seqlens=np.zeros(2, np.int32), **args)


def test_kvcache_check_e4m3_head_dim_and_strides():
    q, kc, vc = cache_arrays(d=72)
    with pytest.raises(ValueError, match=r"k_cache: head dim \(axis 3\) is 72; an e4m3 cache takes multiples of 16"):
        checks.check_kvcache(q, kc, vc, headdim_multiple=1)
    q, kc, vc = cache_arrays(hk=1, d=152)
    with pytest.raises(ValueError, match="k_cache: stride of axis 1 is 152 bytes; the decode kernel's 16-byte loads"):
        checks.check_kvcache(q[..., :144], kc[..., :144], vc[..., :144])  # rows 152 bytes apart


def test_kvcache_check_descales_only_for_an_e4m3_cache():
    q, kc, vc = cache_arrays(cache_dtype=np.float16)
    with pytest.raises(ValueError, match="k_descale: only for an e4m3"):
        checks.check_kvcache(q, kc, vc, k_descale=np.ones((1,), np.float32))


def test_kvcache_e4m3_specs_and_configs():
    from cuflash.ops import decode
    specs = [s for s in decode.all_specs("sm_90a") if isinstance(s, decode.DecodeSpec) and s.fp8]
    assert specs and all(s.name.endswith("_e4m3") and s.template.endswith(", true>") for s in specs)
    assert {s.headdim for s in specs if s.config.tma} == set(decode.TMA_HEADDIMS)  # and the TMA kernel's
    assert all(dataclasses.replace(s.config, page_boxes=1) in decode.TMA_FP8_CONFIGS[s.headdim]  # (a box per page
               for s in specs if s.config.tma)                                               # in small pages)
    for d in (32, 64, 96, 128, 160, 192, 224, 256):
        for rows in (1, 64):
            fp8, bf16 = decode.decode_config(d, rows, True), decode.decode_config(d, rows)
            bf16_spec = decode.DecodeSpec("bf16", d, bf16, False)
            fp8_spec = decode.DecodeSpec("bf16", d, fp8, False, True)
            assert fp8_spec.smem_bytes <= bf16_spec.smem_bytes  # as many CTAs per SM as the 16-bit cache
            assert fp8.stages >= 2 and fp8.row_warps == bf16.row_warps


def test_descales_of_both_forms_are_refused():
    q, kc, vc = cache_arrays()
    with pytest.raises(ValueError, match="k_descale, v_descale: per-tensor and per-head descales cannot be mixed"):
        checks.check_kvcache(q, kc, vc, k_descale=np.ones((2, 2), np.float32), v_descale=np.ones((), np.float32))
    q, k, v = arrays()
    with pytest.raises(ValueError, match="q_descale, v_descale: per-tensor and per-head descales cannot be mixed"):
        checks.check_attention_fp8(q, k, v, q_descale=np.ones((1,), np.float32), v_descale=np.ones((2, 2), np.float32))
