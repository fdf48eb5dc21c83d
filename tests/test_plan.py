"""The planner (pure Python): table entries are valid, launches cover every row, params match params.cuh."""
import math
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cuflash import build, checks, ops, options, plan, reference, settings as cuflash_settings
from cuflash.ops import backward, backward_sm90, decode, forward, forward_fp8, forward_sm90
from tests.fixtures import configure  # noqa: F401  (a fixture)


def _all_configs():
    tables = list(forward.FWD_TABLE.items()) + list(forward.FWD_TABLE_SM90.items())
    for (arch, d, band), entries in tables:
        for bound, config in entries:
            yield arch, d, band, bound, config


@pytest.mark.parametrize("arch,d,band,bound,config", list(_all_configs()))
def test_table_entries_are_launchable(arch, d, band, bound, config):
    assert d in plan.COMPILED_HEADDIMS
    assert config.block_m % (config.warps * 16) == 0, "each warp owns whole 16-row mma tiles"
    assert config.block_n % 16 == 0
    spec = forward.FwdSpec("bf16", d, config, band, False)
    assert spec.smem_bytes <= 227 * 1024, "over the per-CTA shared-memory limit of sm_80/sm_90"


def test_every_table_has_a_catch_all_last():
    for table in (forward.FWD_TABLE, forward.FWD_TABLE_SM90):
        for key, entries in table.items():
            bounds = [b for b, _ in entries]
            assert bounds[-1] is None, key
            assert all(a < b for a, b in zip(bounds[:-2], bounds[1:-1])), f"{key}: bounds must increase"


def test_every_head_dim_and_band_is_covered():
    for arch in plan.ARCHS:
        for d in plan.COMPILED_HEADDIMS:
            for band in (False, True):
                assert forward.fwd_configs(arch, d, band)


@pytest.mark.parametrize("headdim,compiled",
                         [(8, 32), (32, 32), (40, 64), (72, 96), (128, 128), (136, 160), (256, 256)])
def test_head_dims_pad_up(headdim, compiled):
    assert plan.compiled_headdim(headdim) == compiled


@given(sq=st.integers(1, 5000), sk=st.integers(1, 5000), b=st.integers(1, 4), h=st.integers(1, 16),
       d=st.sampled_from([8, 40, 64, 96, 128, 200, 256]), band=st.booleans(), arch=st.sampled_from(plan.ARCHS))
def test_launch_covers_every_query_row(sq, sk, b, h, d, band, arch):
    problem = checks.Problem(b, sq, sk, h, 1, d, np.dtype(np.float16))
    launch = forward.plan_forward(problem, -1, 0 if band else -1, False, arch)
    m_blocks, heads, batch = launch.grid
    assert (heads, batch) == (h, b)
    assert (m_blocks - 1) * launch.spec.config.block_m < sq <= m_blocks * launch.spec.config.block_m
    assert launch.spec.headdim >= d and launch.smem == launch.spec.smem_bytes
    assert launch.block == (launch.spec.threads, 1, 1)


@settings(max_examples=200)
@given(sq=st.integers(1, 40), sk=st.integers(1, 40), left=st.integers(-1, 45), right=st.integers(-1, 45))
def test_window_normalization_keeps_the_mask(sq, sk, left, right):
    """Dropping a window side that hides nothing (to run the unmasked kernel) never changes what is visible."""
    nl, nr = options.normalize_window(left, right, sq, sk)
    assert reference._visible(sq, sk, False, (left, right)).tolist() == \
        reference._visible(sq, sk, False, (nl, nr)).tolist()


def _c_fields(struct: str, source: str = "params.cuh") -> list:
    """(name, C type) of each field of `struct` in cuda_src/`source`, in order."""
    src = (build.SOURCE_DIR / source).read_text()
    body = src[src.index(f"struct {struct} {{") + len(f"struct {struct} {{"):]
    body = re.sub(r"//[^\n]*", "", body[:body.index("};")])
    fields = []
    for decl in body.split(";"):
        decl = decl.strip()
        if decl:
            ctype, names = re.match(r"((?:const\s+)?[\w:]+\*?)\s+(.*)", decl).groups()
            fields += [(name.strip().lstrip("*"), ctype.replace("const", "").strip()) for name in names.split(",")]
    return fields


@pytest.mark.parametrize("struct,dtype,source", [
    ("FwdParams", forward.PARAMS_DTYPE, "params.cuh"), ("BwdParams", backward.PARAMS_DTYPE, "params.cuh"),
    ("BwdPreParams", backward.PRE_PARAMS_DTYPE, "params.cuh"),
    ("BwdConvertParams", backward.CONVERT_PARAMS_DTYPE, "params.cuh"),
    ("DecodeParams", decode.PARAMS_DTYPE, "params.cuh"),
    ("FwdFp8Params", forward_fp8.PARAMS_DTYPE, "fwd_fp8_sm90.cu"),
    ("Fp8TransposeParams", forward_fp8.TRANSPOSE_DTYPE, "fwd_fp8_aux.cu")])
def test_params_dtypes_match_params_cuh(struct, dtype, source):
    """Each NumPy params dtype mirrors its C struct field by field, with C alignment (a tensor map: 128 bytes,
    aligned to 64)."""
    fields = _c_fields(struct, source)
    assert [n for n, _ in fields] == list(dtype.names)
    sizes = {"int": 4, "float": 4, "i64": 8, "sm90::TmaMap": 128}
    offset = align = 0
    for name, ctype in fields:
        size = 8 if ctype.endswith("*") else sizes[ctype]
        step = 64 if size == 128 else size
        offset, align = -(-offset // step) * step, max(align, step)
        assert dtype.fields[name][1] == offset, name
        assert dtype.fields[name][0].itemsize == size, name
        offset += size
    assert dtype.itemsize == -(-offset // align) * align


def test_backward_plan(configure):
    problem = checks.Problem(2, 300, 500, 8, 2, 72, np.dtype(np.float16))
    hopper = backward.plan_backward(problem, -1, 0, False, False, "sm_90a", 132)  # d 72 on the d 128 Hopper kernel
    assert hopper.sm90 == backward_sm90.BwdSm90Spec("fp16", 128, True) and hopper.grid == (4, 2, 2)
    assert [backward_sm90.compiled_headdim(d) for d in (32, 40, 56, 64, 72, 100, 128, 136, 248, 256)] == [
        None, 64, 64, 64, 128, None, 128, 256, 256, 256]
    # d 40..56 on the d 64 kernels, each of them: the stores and dQ's vector reductions bounded at the head dim
    d40 = checks.Problem(2, 300, 5000, 8, 2, 40, np.dtype(np.float16))
    narrow = backward.plan_backward(d40, -1, 0, False, False, "sm_90a", 132)
    assert narrow.sm90 == backward_sm90.BwdSm90Spec("fp16", 64, True, block_m=128) and narrow.sm90.tma_dq
    det = backward.plan_backward(d40, -1, 0, False, True, "sm_90a", 132)  # 40 key blocks: the ordered mode
    assert det.sm90 == backward_sm90.BwdSm90Spec("fp16", 64, True, block_m=128) and det.ordered
    longer = checks.Problem(2, 300, 9000, 8, 2, 40, np.dtype(np.float16))  # 71 key blocks: the fixed point
    det = backward.plan_backward(longer, -1, 0, False, True, "sm_90a", 132)
    assert det.sm90 == backward_sm90.BwdSm90Spec("fp16", 64, True, block_m=128, fixed=True) and det.fixed_point
    mod = backward.plan_backward(d40, -1, 0, True, False, "sm_90a", 132, dropout=True)  # softcap / ALiBi, dropout
    assert mod.sm90 == backward_sm90.BwdSm90Spec("fp16", 64, True, True, 64, dropout=True) and not mod.sm90.tma_dq
    assert backward.plan_backward(d40, -1, 0, False, False, "sm_90a", 132, dropout=True).sm90 == (
        backward_sm90.BwdSm90Spec("fp16", 64, True, block_m=128, dropout=True))
    capped = backward.plan_backward(d40, -1, 0, True, False, "sm_90a", 132)  # softcap / ALiBi: 128 rows
    assert capped.sm90 == backward_sm90.BwdSm90Spec("fp16", 64, True, True, 128) and capped.sm90.tma_dq
    capped_det = backward.plan_backward(d40, -1, -1, True, True, "sm_90a", 132)  # 40 key blocks: the fixed point
    assert capped_det.sm90 == backward_sm90.BwdSm90Spec("fp16", 64, False, True, 128, fixed=True)
    assert capped_det.fixed_point and capped_det.slices == 1
    causal_det = backward.plan_backward(d40, -1, 0, True, True, "sm_90a", 132)  # causal with a mod: the slices
    assert causal_det.sm90 == backward_sm90.BwdSm90Spec("fp16", 64, True, True, 128) and not causal_det.fixed_point
    with cuflash_settings.override(bwd_sm90_block_m={64: 64}):  # the lockstep kernel
        assert backward.plan_backward(d40, -1, 0, False, False, "sm_90a", 132).sm90 == (
            backward_sm90.BwdSm90Spec("fp16", 64, True, block_m=64))
    for launch in (narrow, det, mod, capped, capped_det):
        assert launch.sm90 in backward_sm90.all_specs()
    configure(bwd_sm90=False)  # the portable kernel
    atomic = backward.plan_backward(problem, -1, 0, False, False, "sm_90a", 132)
    assert atomic.spec.headdim == 96 and atomic.grid == (8, 2, 2) and atomic.slices == 1
    det = backward.plan_backward(problem, -1, 0, False, True, "sm_90a", 132)
    assert det.grid[0] == det.slices and 1 <= det.slices <= 8
    with pytest.raises(NotImplementedError, match="head dim 160"):  # no wide backward on sm_80
        backward.plan_backward(checks.Problem(1, 8, 8, 1, 1, 160, np.dtype(np.float16)), -1, -1, False, False,
                               "sm_80", 108)
    with pytest.raises(NotImplementedError, match="head dim 264"):  # nor past 256 anywhere
        backward.plan_backward(checks.Problem(1, 8, 8, 1, 1, 264, np.dtype(np.float16)), -1, -1, False, False,
                               "sm_90a", 132)


@pytest.mark.parametrize("arch", plan.ARCHS)
def test_dropout_forward_plan(arch):
    """The portable forward compiles dropout in only where a call has it (FwdSpec.dropout, a template flag): one
    configuration per head dim and mask, whose keep bits fit beside the scores, for every length."""
    for d in plan.COMPILED_HEADDIMS:
        for band in (False, True):
            for sk in (100, 600, 5000):
                problem = checks.Problem(1, 300, sk, 4, 2, d, np.dtype(np.float16))
                plain = forward.plan_forward(problem, -1, 0 if band else -1, False, arch)
                drop = forward.plan_forward(problem, -1, 0 if band else -1, False, arch, True)
                assert not plain.spec.dropout and drop.spec.dropout
                assert drop.spec.config == forward.dropout_config(arch, d, band)
                assert forward.dropout_fits(drop.spec.config)
                assert {plain.spec, drop.spec} <= set(forward.all_specs(arch))
                assert drop.spec.template.endswith(", true>")


def test_dropout_backward_plan():
    """Dropout's backward: on sm_90a the Hopper kernel's dropout variant at d 64, 128 and 256 (64 query rows, 128 at
    d 64 without a score mod; in deterministic mode the ordered additions; with a score mod at d 64 and 256),
    elsewhere with a score mod the portable kernel with one Q/dO buffer (at d 128 the 32-key configuration: the
    kernels that would spill leave dropout out, BwdTraits::DROPOUT); above 128 it raises there, and on sm_90a the
    d 256 Hopper kernel takes 136-248."""
    problem = checks.Problem(2, 300, 500, 8, 2, 128, np.dtype(np.float16))
    assert backward.plan_backward(problem, -1, 0, False, False, "sm_90a", 132).sm90.dropout is False
    hopper = backward.plan_backward(problem, -1, 0, False, False, "sm_90a", 132, dropout=True)
    assert hopper.sm90 == backward_sm90.BwdSm90Spec("fp16", 128, True, False, 64, False, True)
    assert hopper.sm90 in backward_sm90.all_specs() and hopper.grid == (4, 2, 2) and hopper.slices == 1
    det = backward.plan_backward(problem, -1, 0, False, True, "sm_90a", 132, dropout=True)
    assert det.sm90.dropout and det.ordered and not det.fixed_point and det.slices == 1
    narrow = checks.Problem(2, 300, 500, 8, 2, 64, np.dtype(np.float16))
    assert backward.plan_backward(narrow, -1, -1, False, False, "sm_90a", 132, dropout=True).sm90.block_m == 128
    modded = backward.plan_backward(problem, -1, 0, True, False, "sm_90a", 132, dropout=True)
    assert modded.sm90 == backward_sm90.BwdSm90Spec("fp16", 128, True, True, 64, False, True)
    assert modded.sm90 in backward_sm90.all_specs()
    with cuflash_settings.override(bwd_sm90=False):  # the portable kernel's 32-key configuration
        modded = backward.plan_backward(problem, -1, 0, True, False, "sm_90a", 132, dropout=True)
        assert modded.sm90 is None and modded.spec.config == backward.DROPOUT_CONFIG
        assert modded.spec in backward.all_specs("sm_90a")
    ampere = backward.plan_backward(problem, -1, 0, False, False, "sm_80", 108, dropout=True)
    assert ampere.spec.config == backward.BWD_CONFIG and ampere.spec in backward.all_specs("sm_80")
    ampere_mod = backward.plan_backward(problem, -1, 0, True, False, "sm_80", 108, dropout=True)  # a score mod
    assert ampere_mod.spec.config == backward.DROPOUT_CONFIG and ampere_mod.spec in backward.all_specs("sm_80")
    narrow_mod = backward.plan_backward(narrow, -1, 0, True, False, "sm_90a", 132, dropout=True)
    assert narrow_mod.sm90 == backward_sm90.BwdSm90Spec("fp16", 64, True, True, 64, False, True)
    assert narrow_mod.sm90 in backward_sm90.all_specs()
    assert backward.plan_backward(narrow, -1, 0, False, False, "sm_80", 108, dropout=True).spec.config.q_buffers == 2
    between = checks.Problem(1, 8, 8, 1, 1, 200, np.dtype(np.float16))  # on the d 256 Hopper kernel
    assert backward.plan_backward(between, -1, -1, False, False, "sm_90a", 132, dropout=True).sm90 == (
        backward_sm90.BwdSm90Spec("fp16", 256, False, False, 64, False, True))
    with pytest.raises(NotImplementedError, match="head dim 200"):  # not on the portable kernel
        backward.plan_backward(between, -1, -1, False, False, "sm_80", 108, dropout=True)
    wide = checks.Problem(1, 8, 8, 1, 1, 256, np.dtype(np.float16))  # d 256: the Hopper kernel's DSPLIT variant
    assert backward.plan_backward(wide, -1, -1, False, False, "sm_90a", 132, dropout=True).sm90 == (
        backward_sm90.BwdSm90Spec("fp16", 256, False, False, 64, False, True))
    assert backward.plan_backward(wide, -1, -1, True, False, "sm_90a", 132, dropout=True).sm90 == (  # a score mod
        backward_sm90.BwdSm90Spec("fp16", 256, False, True, 64, False, True))
    with cuflash_settings.override(bwd_sm90=False):  # the portable kernel: none
        with pytest.raises(NotImplementedError, match="dropout at head dim 256"):
            backward.plan_backward(wide, -1, -1, True, False, "sm_90a", 132, dropout=True)


def test_score_mod_backward_plan(monkeypatch):
    """Softcap and ALiBi (a score mod) in the backward: on sm_90a the Hopper kernel's score-mod variant at every
    compiled head dim (the head dim's query rows: 128 at d 64; in deterministic mode the fixed point or the slices by
    the rule without a mod, but the slices at d 64 under a causal mask), a head dim between the compiled ones on the
    next one's; on sm_80 the portable kernel. (The rule without the ordered mode, which takes no score mod.)"""
    monkeypatch.setattr(backward, "ORDERED_MAX_BLOCKS", dict.fromkeys(backward.ORDERED_MAX_BLOCKS, 0))
    for d, compiled in ((64, 64), (128, 128), (96, 128), (200, 256), (256, 256)):
        problem = checks.Problem(2, 300, 1100, 8, 2, d, np.dtype(np.float16))
        for band in (False, True):
            launch = backward.plan_backward(problem, -1, 0 if band else -1, True, False, "sm_90a", 132)
            rows = 128 if compiled == 64 else 64
            assert launch.sm90 == backward_sm90.BwdSm90Spec("fp16", compiled, band, True, rows), (d, band)
            assert launch.sm90 in backward_sm90.all_specs()
            det = backward.plan_backward(problem, -1, 0 if band else -1, True, True, "sm_90a", 132)
            assert det.sm90.score_mod and det.sm90 in backward_sm90.all_specs()
            plain = backward.plan_backward(problem, -1, 0 if band else -1, False, True, "sm_90a", 132)
            want = plain.fixed_point and not (compiled == 64 and band)  # (band: causal here)
            assert det.fixed_point == want and det.sm90.fixed == det.fixed_point, (d, band)
    for seqlen in (4096, 16384):  # d 64 with a mod: the fixed point without a mask, the slices under a causal one
        problem = checks.Problem(16384 // seqlen, seqlen, seqlen, 32, 32, 64, np.dtype(np.float16))
        assert backward.plan_backward(problem, -1, -1, True, True, "sm_90a", 132).fixed_point
        assert backward.plan_backward(problem, -1, 0, False, True, "sm_90a", 132).fixed_point  # no mod
        assert not backward.plan_backward(problem, -1, 0, True, True, "sm_90a", 132).fixed_point
        if d <= 128:  # (above, sm_80 has no backward)
            assert backward.plan_backward(problem, -1, 0, True, False, "sm_80", 108).sm90 is None


def test_grid_limits_are_checked_before_launch():
    problem = checks.Problem(70000, 8, 8, 1, 1, 64, np.dtype(np.float16))
    with pytest.raises(ValueError, match="batch: 70000 exceeds"):
        forward.plan_forward(problem, -1, -1, False, "sm_90a")


def test_forward_scales():
    s = options.forward_scales(0.125, 0.0, False)
    assert s["scale_log2"] == pytest.approx(0.125 * options.LOG2E) and s["mod_scale"] == 0.125
    s = options.forward_scales(0.125, 30.0, True)
    assert s["scale_log2"] == pytest.approx(options.LOG2E) and s["mod_scale"] == pytest.approx(0.125 / 30.0)


def test_kernel_names_are_readable_and_unique():
    specs = ops.all_specs("sm_90a")
    names = [s.name for s in specs]
    assert len(set(names)) == len(set(specs))
    assert "fwd_bf16_d128_m128_n128_w8_qreg_causal" in names
    assert "bwd_bf16_d128_m64_n64_w8_causal_mod" in names


def test_source_hash_covers_headers(tmp_path, monkeypatch):
    """Editing any header changes the hash that keys CuPy's disk cache."""
    for f in build.SOURCE_DIR.glob("*.cu*"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    monkeypatch.setattr(build, "SOURCE_DIR", Path(tmp_path))
    build.source_hash.cache_clear()
    before = build.source_hash()
    (tmp_path / "softmax.cuh").write_text((tmp_path / "softmax.cuh").read_text() + "\n// edit\n")
    build.source_hash.cache_clear()
    assert build.source_hash() != before
    build.source_hash.cache_clear()


# ---- decode ----

def test_num_splits_heuristic_no_split_when_the_grid_is_full():
    assert decode.num_splits_heuristic(work=264, slots=264, n_blocks=1000) == 1
    assert decode.num_splits_heuristic(work=220, slots=264, n_blocks=1000) == 1


def test_num_splits_heuristic_fills_the_gpu_for_batch_one():
    # batch 1, 8 KV heads, 8k keys in 64-key blocks, two CTAs per SM on 132 SMs
    s = decode.num_splits_heuristic(work=8, slots=264, n_blocks=128)
    assert 8 * s >= 0.85 * 264 and 8 * s <= 264
    assert decode.num_splits_heuristic(work=8, slots=264, n_blocks=3) <= 3   # never more splits than blocks


@pytest.mark.parametrize("sq,group,row_warps", [(1, 8, 1), (2, 8, 1), (3, 8, 4), (17, 1, 4), (1, 1, 1)])
def test_plan_decode_packs_gqa_groups(sq, group, row_warps):
    problem = checks.Problem(2, sq, 4096, 8 * group, 8, 128, np.dtype(np.float16))
    launch = decode.plan_decode(problem, -1, -1, False, 1, 132)
    assert launch.spec.config.row_warps == row_warps
    rows_per_tile = 16 * row_warps
    assert launch.grid == (-(-sq * group // rows_per_tile), 8, 2) and launch.splits == 1


def test_plan_decode_splits_clamped():
    problem = checks.Problem(1, 1, 300, 32, 8, 128, np.dtype(np.float16))
    blocks = -(-300 // decode.decode_config(128, 4).block_n)
    launch = decode.plan_decode(problem, -1, -1, False, 50, 132)
    assert launch.splits == blocks  # never more splits than KV blocks
    launch = decode.plan_decode(problem, -1, -1, False, 0, 132)
    assert 1 <= launch.splits <= blocks and launch.grid[0] == launch.splits


def test_decode_smem_fits_and_matches_traits():
    for spec in decode.all_specs("sm_90a"):
        if isinstance(spec, decode.DecodeSpec):
            assert spec.smem_bytes <= plan.SMEM_PER_SM, spec.name


def test_backward_workspace_layout():
    lse_log2, dq_accum, total = backward.workspace(rows=300, nheads=4, headdim=128, slices=3)
    assert lse_log2 == 4864 and dq_accum == 2 * 4864  # 300 * 4 * 4 = 4800 bytes, rounded up to 256
    assert total == dq_accum + 3 * 300 * 4 * 128 * 4 and total % backward.WORKSPACE_ALIGN == 0


def test_backward_double_buffering_switch_and_spill_free_dims_only(configure):
    problem = checks.Problem(2, 300, 300, 4, 2, 64, np.dtype(np.float16))
    configure(bwd_qbuf=False)
    assert backward.plan_backward(problem, -1, -1, False, False, "sm_90a", 132).spec.config.q_buffers == 1
    configure(bwd_qbuf=True)
    spec = backward.plan_backward(problem, -1, -1, False, False, "sm_90a", 132).spec
    assert spec.config.q_buffers == 2 and "_qb2" in spec.name and ", 2, false, false>" in spec.template
    wide = checks.Problem(2, 300, 300, 4, 2, 128, np.dtype(np.float16))
    assert backward.plan_backward(wide, -1, -1, False, False, "sm_90a", 132).spec.config.q_buffers == 1
    # one more Q and dO tile and one more lse/D pair per query block of shared memory
    one = backward.BwdSpec("fp16", 64, backward.BWD_CONFIG, False, False)
    assert spec.smem_bytes - one.smem_bytes == 2 * 64 * 128 + 2 * 64 * 4
    assert spec in backward.all_specs("sm_90a")


def test_wide_backward_switch_and_hopper_only(configure):
    problem = checks.Problem(1, 100, 100, 2, 1, 192, np.dtype(np.float16))
    assert backward.plan_backward(problem, -1, -1, False, False, "sm_90a", 132).sm90.headdim == 256
    configure(bwd_wide=False, bwd_sm90=False)  # the portable kernel's wide variant, where the Hopper one is off
    with pytest.raises(NotImplementedError, match="head dim 192"):
        backward.plan_backward(problem, -1, -1, False, False, "sm_90a", 132)
    configure(bwd_wide=True, bwd_sm90=False)
    launch = backward.plan_backward(problem, -1, 0, False, True, "sm_90a", 132)
    assert launch.spec.headdim == 256 and launch.spec.config == backward.BwdConfig(64, 32, 8)
    assert launch.grid[0] == launch.slices == 4  # deterministic: one slot per 32-key block here (100 keys)
    with pytest.raises(NotImplementedError, match="head dim 192"):
        backward.plan_backward(problem, -1, -1, False, False, "sm_80", 108)  # spills there: not offered
    assert launch.spec in backward.all_specs("sm_90a") and launch.spec not in backward.all_specs("sm_80")


def test_sm90_backward_ordered_mode_where_it_applies(configure):
    """bwd_sm90_det "ordered": the atomic grid, one fp32 accumulator, on the dQ warp's kernels for a padded batch of
    at most ORDERED_MAX_BLOCKS[d] key blocks and half the SMs, without a score mod, under no band or one with a right
    edge; elsewhere the other modes' rule."""
    configure(bwd_sm90_det="ordered")
    most = backward.ORDERED_MAX_BLOCKS

    def plan(d, sk, left=-1, right=0, mod=False, packed=False, deterministic=True, sms=132):
        problem = checks.Problem(2, 1000, sk, 8, 2, d, np.dtype(np.float16))
        return backward.plan_backward(problem, left, right, mod, deterministic, "sm_90a", sms, packed=packed)

    assert most[128] == most[64] == 64 and most[256] == 16
    for d, right, blocks in ((128, 0, most[128]), (64, -1, most[64]), (96, 30, most[128])):
        launch = plan(d, 128 * blocks, right=right)
        assert launch.ordered and launch.grid == (blocks, 2, 2) and launch.slices == 1 and not launch.fixed_point
    assert not plan(128, 128 * most[128] + 1).ordered  # too many key blocks: the fixed point
    assert plan(128, 128 * most[128] + 1).fixed_point
    assert plan(128, 128 * 33, sms=65).fixed_point  # a group of more CTAs than half the SMs
    assert plan(128, 128 * 33, sms=66).ordered
    assert plan(64, 128 * 8, sms=16).ordered and not plan(64, 128 * 8 + 1, sms=16).ordered
    assert not plan(128, 1000, left=100, right=-1).ordered  # a window without a right edge
    assert plan(256, 64 * most[256]).ordered and not plan(256, 64 * most[256] + 1).ordered  # 64-key blocks at d 256
    for other in (plan(128, 1000, mod=True), plan(128, 1000, packed=True), plan(128, 1000, deterministic=False)):
        assert not other.ordered
    with cuflash_settings.override(bwd_sm90_block_m={64: 64}):  # d 64's lockstep kernel: no dQ warp
        assert not plan(64, 1000).ordered
    with pytest.raises(ValueError, match="CUFLASH_BWD_SM90_DET"):
        cuflash_settings.Settings(bwd_sm90_det="sorted")
    configure(bwd_sm90_det="auto")  # from ORDERED_MIN_BLOCKS key blocks: d 128 from one, d 64 from 8 (1k keys)
    assert plan(128, 512).ordered and plan(64, 1024).ordered and plan(64, 1024, right=-1).ordered
    assert not plan(64, 512).ordered
    assert plan(128, 8192).ordered and plan(128, 8192, right=-1).ordered and plan(128, 8193).fixed_point
    assert plan(64, 8192).ordered and plan(64, 8192, right=-1).ordered and plan(64, 8193).fixed_point  # d 64 too
    # d 256: ordered without a mask, the fixed point under a band
    assert plan(256, 64 * most[256], right=-1).ordered and plan(256, 64, right=-1).ordered
    assert not plan(256, 64 * most[256]).ordered and plan(256, 64 * most[256]).fixed_point
    assert not plan(256, 1000, left=100, right=30).ordered
    with cuflash_settings.override(bwd_sm90_ordered_blocks={64: 32, 128: 8}):  # the table replaced per head dim
        assert plan(64, 128 * 32).ordered and not plan(64, 128 * 32 + 1).ordered
        assert plan(128, 128 * 8).ordered and plan(128, 128 * 8 + 1).fixed_point
        assert plan(256, 64 * most[256], right=-1).ordered and not plan(256, 64 * most[256] + 1, right=-1).ordered
    with cuflash_settings.override(bwd_sm90_ordered_blocks={256: 64}):  # more blocks, but never under a band (auto)
        assert plan(256, 64 * 64, right=-1).ordered and plan(256, 64 * 32).fixed_point
        assert not plan(128, 128 * 64, sms=100).ordered  # nor past half the SMs


@settings(max_examples=300)
@given(sk=st.integers(1, 20000), b=st.integers(1, 4), hk=st.integers(1, 4), d=st.sampled_from([40, 64, 96, 128, 256]),
       mask=st.sampled_from(["none", "causal", "window"]), sms=st.sampled_from([8, 16, 66, 114, 132]),
       mode=st.sampled_from(["auto", "ordered"]))
def test_sm90_ordered_groups_fit_half_the_gpu(sk, b, hk, d, mask, sms, mode):
    """Wherever the plan takes the ordered mode, a (KV head, sequence) group's CTAs (the grid's key blocks, one CTA an
    SM) fit on half the SMs, so that no call, nor two at once, can fill the GPU with CTAs waiting on unstarted ones."""
    left, right = {"none": (-1, -1), "causal": (-1, 0), "window": (300, 40)}[mask]
    problem = checks.Problem(b, 1000, sk, 2 * hk, hk, d, np.dtype(np.float16))
    with cuflash_settings.override(bwd_sm90_det=mode):
        launch = backward.plan_backward(problem, left, right, False, True, "sm_90a", sms)
    if launch.ordered:
        assert launch.grid[0] <= sms // 2 and launch.grid[1:] == (hk, b) and launch.slices == 1


def test_sm90_backward_slots_end_soonest_with_fewest_slices():
    """Deterministic mode on the Hopper backward: the slot count minimizes waves x key blocks per CTA, then slices."""
    assert backward.slots_sm90(32, 64, 132) == 2    # 128 CTAs of 16 blocks: one wave
    assert backward.slots_sm90(8, 256, 132) == 1    # 256 CTAs of 8 blocks: two waves, one slice
    assert backward.slots_sm90(3, 2, 132) == 3      # few groups: one block per CTA
    assert backward.slots_sm90(1, 1, 132) == 1
    for n, groups in ((32, 64), (40, 4), (7, 100), (64, 1)):
        best = backward.slots_sm90(n, groups, 132)
        span = [math.ceil(s * groups / 132) * math.ceil(n / s) for s in range(1, n + 1)]
        assert span[best - 1] == min(span) and span.index(min(span)) == best - 1


def test_sm90_backward_slot_ties_broken_by_passes():
    """slots_sm90's max_passes (the bwd_sm90_det_max_passes setting, off by default): among the slot counts that
    finish as soon, the fewest with at most that many key blocks per slot; none such: the fewest slots as without it."""
    assert backward.slots_sm90(32, 128, 132) == 1                 # d 64 4k: 1, 2, 4, ... slots tie
    assert backward.slots_sm90(32, 128, 132, max_passes=16) == 2
    assert backward.slots_sm90(8, 512, 132, max_passes=16) == 1   # 1k: 8 blocks per slot already
    assert backward.slots_sm90(128, 32, 132, max_passes=16) == 8  # 16k: 4 and 8 slots tie (one and two waves)
    assert backward.slots_sm90(128, 32, 132) == 4
    for n, groups, bound in ((32, 64, 8), (40, 4, 3), (7, 100, 2), (64, 1, 4), (128, 16, 16)):
        span = [math.ceil(s * groups / 132) * math.ceil(n / s) for s in range(1, n + 1)]
        soonest = [s for s in range(1, n + 1) if span[s - 1] == min(span)]
        short = [s for s in soonest if math.ceil(n / s) <= bound]
        assert backward.slots_sm90(n, groups, 132, max_passes=bound) == (short or soonest)[0]


def test_sm90_backward_slot_count_fixed_by_the_table(configure):
    """The bwd_sm90_det_slots setting (CUFLASH_BWD_SM90_DET_SLOTS) fixes deterministic mode's slot count, at most one
    per key block; the atomic grid keeps one CTA per key block."""
    problem = checks.Problem(1, 1000, 1000, 4, 2, 128, np.dtype(np.float16))  # 8 key blocks of 128
    configure(bwd_sm90_det_slots=3)
    launch = backward.plan_backward(problem, -1, 0, False, True, "sm_90a", 132)
    assert launch.grid[0] == launch.slices == 3
    assert backward.plan_backward(problem, -1, 0, False, False, "sm_90a", 132).grid[0] == 8
    configure(bwd_sm90_det_slots=50)
    assert backward.plan_backward(problem, -1, 0, False, True, "sm_90a", 132).grid[0] == 8
    configure(bwd_sm90_det_slots=0)
    assert backward.plan_backward(problem, -1, 0, False, True, "sm_90a", 132).grid[0] == backward.slots_sm90(8, 2, 132)


def test_jax_workspace_bound_covers_both_backward_kernels():
    """cuflash.jax sizes the backward workspace before it knows the device: the bound covers the portable and the
    Hopper main kernel's deterministic slices."""
    jax_mod = pytest.importorskip("cuflash.jax")
    for b, s, h, hk, d in ((1, 300, 2, 2, 64), (1, 38000, 1, 1, 128), (4, 4096, 16, 16, 128), (2, 1000, 8, 1, 64)):
        problem = checks.Problem(b, s, s, h, hk, d, np.dtype(np.float16))
        bound = jax_mod.backward_workspace_bytes(problem, -1, 0, False, True)
        for arch in ("sm_80", "sm_90a"):
            for sms in (108, 132):
                slices = backward.plan_backward(problem, -1, 0, False, True, arch, sms).slices
                assert backward.workspace(b * s, h, d, slices)[2] <= bound, (arch, sms, b, s, h, d)


def test_decode_merges_few_splits_in_the_kernel(configure):
    """decode.fused_combine: 2..fused_max_splits splits merge in the decode kernel, more in decode_combine;
    one split needs no merge; a bound of 0 turns the fused merge off."""
    configure(decode_fused_max_splits=16)
    assert [decode.fused_combine(s) for s in (1, 2, 16, 17, 128)] == [False, True, True, False, False]
    configure(decode_fused_max_splits=0)
    assert not decode.fused_combine(4)


def test_decode_evicts_first_only_small_reads(configure):
    configure(decode_evict_first_mb=128)
    assert decode.evict_first(32 * 2**20) and decode.evict_first(128 * 2**20)
    assert not decode.evict_first(128 * 2**20 + 1)
    configure(decode_evict_first_mb=0)
    assert not decode.evict_first(1)


def test_sm90_o_tma_switch(configure):
    """CUFLASH_SM90_O_TMA sets how every head dim's Hopper forward writes O; unset, the measured table holds."""
    from cuflash import settings

    def table(env):
        configure(sm90_o_tma=settings.Settings.from_env(env).sm90_o_tma)
        return {d: forward_sm90.o_tma(d) for d in forward_sm90.HEADDIMS}

    assert table({}) == forward_sm90.O_TMA_DEFAULT == {64: 1, 128: 1, 256: 1}
    assert table({"CUFLASH_SM90_O_TMA": "1"}) == {64: 1, 128: 1, 256: 1}
    assert table({"CUFLASH_SM90_O_TMA": "0"}) == {64: 0, 128: 0, 256: 0}
    with pytest.raises(ValueError, match="CUFLASH_SM90_O_TMA"):
        settings.Settings.from_env({"CUFLASH_SM90_O_TMA": "yes"})


def test_kv_bound_blocks():
    """bwd_kv_bound's blocks per (KV head, sequence): about 8 per SM over all of them, at most one per rows_per_block
    rows, at least one."""
    assert backward.kv_bound_blocks(16384, 32, 32, 132) == 33          # 8 x 132 / 32 heads
    assert backward.kv_bound_blocks(100, 32, 1, 132) == 4              # one per 32 rows
    assert backward.kv_bound_blocks(1, 32, 10_000, 132) == 1


def test_deterministic_fixed_point_rule(configure, monkeypatch):
    """The bwd_sm90_det setting "auto": the fixed point where the slot rule gives several slots or from
    backward.FIXED_MIN_BLOCKS key blocks on (per head dim, without and with a causal mask), with a score mod too, not
    with dropout or on the d = 64 kernel with 64 rows (no TMA dQ); "slices" never; a fixed slot count keeps slices.
    (The rule where the ordered mode does not apply: off here.)"""
    from cuflash import checks
    from cuflash.ops import backward
    monkeypatch.setattr(backward, "ORDERED_MAX_BLOCKS", dict.fromkeys(backward.ORDERED_MAX_BLOCKS, 0))
    configure(bwd_sm90=True)
    configure(bwd_sm90_det="auto")
    big = checks.Problem(32, 512, 512, 16, 16, 128, np.dtype(np.float16))   # 4 blocks, one slot each
    long = checks.Problem(8, 2048, 2048, 16, 16, 128, np.dtype(np.float16))  # 16 blocks, one slot each
    assert backward.slots_sm90(4, 32 * 16, 132) == 1 and backward.slots_sm90(16, 8 * 16, 132) == 1
    assert not backward.plan_backward(big, -1, -1, False, True, "sm_90a", 132).fixed_point
    fixed = backward.plan_backward(long, -1, -1, False, True, "sm_90a", 132)
    assert fixed.fixed_point and fixed.slices == 1 and fixed.grid == (16, 16, 8)
    mid = checks.Problem(16, 1024, 1024, 16, 16, 128, np.dtype(np.float16))  # 8 blocks: d 128's threshold
    assert backward.plan_backward(mid, -1, -1, False, True, "sm_90a", 132).fixed_point
    assert backward.plan_backward(mid, -1, 0, False, True, "sm_90a", 132).fixed_point      # causal: 8 too
    assert not backward.plan_backward(big, -1, 0, False, True, "sm_90a", 132).fixed_point  # causal 4 blocks
    assert backward.plan_backward(long, -1, 0, False, True, "sm_90a", 132).fixed_point     # causal 16 blocks
    for seqlen, causal, want in ((1024, False, False), (2048, False, True), (2048, True, False), (4096, True, True)):
        d64 = checks.Problem(16384 // seqlen, seqlen, seqlen, 32, 32, 64, np.dtype(np.float16))  # d 64: 16 blocks
        assert backward.slots_sm90(seqlen // 128, 16384 // seqlen * 32, 132) == 1
        assert backward.plan_backward(d64, -1, 0 if causal else -1, False, True, "sm_90a", 132).fixed_point == want
    for seqlen in (64, 512, 1024):  # d 256: the fixed point from one key block on, causal or not
        d256 = checks.Problem(16384 // seqlen, seqlen, seqlen, 8, 8, 256, np.dtype(np.float16))
        for right in (-1, 0):
            assert backward.plan_backward(d256, -1, right, False, True, "sm_90a", 132).fixed_point
    capped = checks.Problem(1, 4096, 4096, 4, 4, 64, np.dtype(np.float16))
    assert backward.plan_backward(capped, -1, -1, False, True, "sm_90a", 132).fixed_point
    assert backward.plan_backward(capped, -1, -1, True, True, "sm_90a", 132).fixed_point  # score mod (128 rows)
    assert not backward.plan_backward(capped, -1, -1, True, True, "sm_90a", 132, dropout=True).fixed_point
    configure(bwd_sm90_det="slices")
    assert not backward.plan_backward(long, -1, -1, False, True, "sm_90a", 132).fixed_point
    configure(bwd_sm90_det="fixed")
    assert backward.plan_backward(big, -1, -1, False, True, "sm_90a", 132).fixed_point
    assert not backward.plan_backward(big, -1, -1, False, False, "sm_90a", 132).fixed_point


def test_memory_system_from_the_device_attributes(monkeypatch):
    """build.memory_system: the L2 size and twice the memory clock times the bus width; None where the runtime
    refuses an attribute or says 0."""
    import cupy
    from cuflash import build
    rt = cupy.cuda.runtime
    attrs = {rt.cudaDevAttrL2CacheSize: 50 << 20, rt.cudaDevAttrMemoryClockRate: 2619000,  # kHz
             rt.cudaDevAttrGlobalMemoryBusWidth: 5120}
    monkeypatch.setattr(rt, "deviceGetAttribute", lambda attr, device_id: attrs[attr])
    build.memory_system.cache_clear()
    try:
        assert build.memory_system(0) == build.MemorySystem(50 << 20, 2 * 2619e6 * 5120 / 8)  # an H100 SXM's 3.35 TB/s
        attrs[rt.cudaDevAttrMemoryClockRate] = 0
        assert build.memory_system(1) is None
        del attrs[rt.cudaDevAttrGlobalMemoryBusWidth]
        assert build.memory_system(2) is None
    finally:
        build.memory_system.cache_clear()


def test_deterministic_slices_that_outgrow_the_l2_take_the_fixed_point(configure, monkeypatch):
    """"auto" on a device whose memory system is known: one slot per group whose dQ at once (halved under a causal
    mask) outgrows the L2 scaled by the bandwidth takes the fixed point (about 28 MiB on an H100 SXM, 41 on an H200);
    smaller, or without a memory system, the slices. (The rule where the ordered mode does not apply: off here.)"""
    from cuflash import build, checks
    from cuflash.ops import backward
    monkeypatch.setattr(backward, "ORDERED_MAX_BLOCKS", dict.fromkeys(backward.ORDERED_MAX_BLOCKS, 0))
    configure(bwd_sm90=True)
    configure(bwd_sm90_det="auto")
    h100 = build.MemorySystem(50 << 20, 2 * 2619e6 * 5120 / 8)
    h200 = build.MemorySystem(50 << 20, 2 * 3201e6 * 6144 / 8)
    cells = (  # (d, seqlen, causal): whether an H100 takes the fixed point; an H200 keeps the slices in all
        (64, 512, False, False),   # 132 x 128 KiB at once: 16.5 MiB
        (64, 1024, False, True),   # 33 MiB
        (64, 1024, True, False),   # 33 MiB, halved
        (64, 2048, True, True),    # 66 MiB, halved
        (128, 512, False, True),   # 33 MiB
        (128, 512, True, False))
    for d, seqlen, causal, want in cells:
        problem = checks.Problem(16384 // seqlen, seqlen, seqlen, 2048 // d, 2048 // d, d, np.dtype(np.float16))
        right = 0 if causal else -1
        assert backward.slots_sm90(seqlen // 128, 16384 // seqlen * (2048 // d), 132) == 1
        assert not backward.plan_backward(problem, -1, right, False, True, "sm_90a", 132).fixed_point
        assert backward.plan_backward(problem, -1, right, False, True, "sm_90a", 132, memory=h100).fixed_point == want
        assert not backward.plan_backward(problem, -1, right, False, True, "sm_90a", 132, memory=h200).fixed_point
        assert not backward.plan_backward(problem, -1, right, False, False, "sm_90a", 132, memory=h100).fixed_point
    gqa = checks.Problem(16, 1024, 1024, 32, 8, 64, np.dtype(np.float16))  # 128 groups of 4 heads: 128 MiB at once
    assert backward.slots_sm90(8, 128, 132) == 1
    assert not backward.plan_backward(gqa, -1, -1, False, True, "sm_90a", 132).fixed_point
    assert backward.plan_backward(gqa, -1, -1, False, True, "sm_90a", 132, memory=h200).fixed_point
    configure(bwd_sm90_det="slices")
    assert not backward.plan_backward(problem, -1, -1, False, True, "sm_90a", 132, memory=h100).fixed_point


@given(d=st.integers(1, 2**31 - 1), x=st.integers(0, 2**31 - 1))
def test_fast_div_is_exact(d, x):
    from cuflash.ops import forward_sm90
    mul, shift = forward_sm90.fast_div(d)
    assert 0 <= mul < 2**32 and (((x * mul) >> 32) + x) >> shift == x // d


def test_sm90_walk_chunk_divides_the_ctas_and_fits_the_l2(configure, monkeypatch):
    configure(sm90_walk_chunk=0)
    monkeypatch.setattr(forward_sm90, "WALK_HEAD_DIMS", (64, 128))
    budget = forward_sm90.WALK_L2_BYTES
    for ctas, sk, d, group in ((132, 512, 64, 1), (132, 2048, 64, 1), (132, 1024, 128, 1), (114, 900, 64, 4),
                               (132, 1 << 20, 128, 1)):
        c = forward_sm90.walk_chunk(ctas, sk, d, group)
        fits = [n for n in range(1, ctas + 1) if ctas % n == 0 and n * 4 * sk * d / group <= budget]
        assert c == max(fits, default=1)
    assert forward_sm90.walk_chunk(132, 512, 64, 1) == 132  # d 64 causal 512: 16 MB of K/V in a chunk
    monkeypatch.setattr(forward_sm90, "WALK_HEAD_DIMS", (64,))
    assert forward_sm90.walk_chunk(132, 512, 128, 1) == 1  # d 128 keeps the pair-by-pair walk
    configure(sm90_walk_chunk=5)
    assert forward_sm90.walk_chunk(132, 512, 128, 1) == 5
