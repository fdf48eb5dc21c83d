"""cuflash.settings: every CUFLASH_* switch parsed from an environment mapping, and overridable in-process."""
from pathlib import Path

import numpy as np
import pytest

from cuflash import checks, settings
from cuflash.ops import backward, decode, forward


def test_defaults_without_any_variable():
    s = settings.Settings.from_env({})
    assert s == settings.Settings()
    assert (s.sm90, s.bwd_sm90, s.bwd_qbuf, s.bwd_wide, s.decode_tma, s.pdl) == (True,) * 6
    assert (s.sm90_variants, s.sm90_short_variants, s.sm90_o_tma, s.bwd_sm90_block_m) == ({}, None, None, {})
    assert (s.bwd_sm90_det, s.bwd_sm90_det_slots, s.bwd_sm90_det_max_passes, s.sm90_walk_chunk) == ("auto", 0, 0, 0)
    assert (s.decode_tma_stages, s.decode_fused_max_splits, s.decode_evict_first_mb) == (3, 128, 128)


def test_every_variable_is_read():
    env = {"CUFLASH_SM90": "0", "CUFLASH_SM90_VARIANTS": "64:ws, 128:ws_n128", "CUFLASH_SM90_SHORT_VARIANTS":
           "128c@1024:pingpong_n128_p,64:ws_n128_p", "CUFLASH_SM90_O_TMA": "0", "CUFLASH_SM90_WALK_CHUNK": "4",
           "CUFLASH_BWD_QBUF": "0", "CUFLASH_BWD_WIDE": "0", "CUFLASH_BWD_SM90": "0", "CUFLASH_BWD_SM90_DET": "fixed",
           "CUFLASH_BWD_SM90_DET_SLOTS": "2", "CUFLASH_BWD_SM90_DET_MAX_PASSES": "8", "CUFLASH_BWD_SM90_BLOCK_M":
           "64:64", "CUFLASH_PDL": "0", "CUFLASH_DECODE_TMA": "0", "CUFLASH_DECODE_TMA_STAGES": "4",
           "CUFLASH_DECODE_FUSED_MAX_SPLITS": "0", "CUFLASH_DECODE_EVICT_FIRST_MB": "64", "CUFLASH_FP8_PIPELINED": "1",
           "CUFLASH_BWD_SM90_DQ_FIRST_STORE": "0", "CUFLASH_FP8_VT_PASS": "0",
           "CUFLASH_BWD_SM90_ORDERED_BLOCKS": "64:32,256:8"}
    s = settings.Settings.from_env(env)
    assert s == settings.Settings(
        sm90=False, sm90_variants={64: "ws", 128: "ws_n128"},
        sm90_short_variants={(128, True, 1024): "pingpong_n128_p", (64, False, None): "ws_n128_p"}, sm90_o_tma=0,
        sm90_walk_chunk=4, bwd_qbuf=False, bwd_wide=False, bwd_sm90=False, bwd_sm90_det="fixed",
        bwd_sm90_det_slots=2, bwd_sm90_det_max_passes=8, bwd_sm90_block_m={64: 64}, pdl=False, decode_tma=False,
        decode_tma_stages=4, decode_fused_max_splits=0, decode_evict_first_mb=64, fp8_pipelined=1,
        bwd_sm90_dq_first_store=False, fp8_vt_pass=0, bwd_sm90_ordered_blocks={64: 32, 256: 8})
    text = (Path(__file__).resolve().parent.parent / "docs" / "settings.md").read_text()
    assert all(f"`{name}`" in text for name in env), "docs/settings.md lists every variable"
    assert len(env) == len(settings.Settings.__dataclass_fields__)


@pytest.mark.parametrize("env,match", [({"CUFLASH_BWD_SM90_DET": "sometimes"}, "CUFLASH_BWD_SM90_DET"),
                                       ({"CUFLASH_SM90_O_TMA": "yes"}, "CUFLASH_SM90_O_TMA"),
                                       ({"CUFLASH_FP8_PIPELINED": "2"}, "CUFLASH_FP8_PIPELINED"),
                                       ({"CUFLASH_FP8_VT_PASS": "on"}, "CUFLASH_FP8_VT_PASS"),
                                       ({"CUFLASH_DECODE_TMA_STAGES": "three"}, "CUFLASH_DECODE_TMA_STAGES"),
                                       ({"CUFLASH_SM90_VARIANTS": "sixty-four:ws"}, "CUFLASH_SM90_VARIANTS"),
                                       ({"CUFLASH_BWD_SM90_ORDERED_BLOCKS": "64:many"},
                                        "CUFLASH_BWD_SM90_ORDERED_BLOCKS")])
def test_bad_values_name_the_variable(env, match):
    with pytest.raises(ValueError, match=match):
        settings.Settings.from_env(env)


def test_override_restores_and_drops_cached_launches():
    before = settings.current()
    caches = (forward._launches, forward._attention_calls, forward._varlen_calls, backward._launches,
              backward._attention_calls, backward._varlen_calls, decode._calls)
    for cache in caches:
        cache["key"] = object()
    with settings.override(sm90=False, decode_tma_stages=4) as inside:
        assert settings.current() is inside and not inside.sm90 and inside.decode_tma_stages == 4
        assert not any("key" in cache for cache in caches)
        with settings.override(sm90=True):
            assert settings.current().sm90 and settings.current().decode_tma_stages == 4
        assert not settings.current().sm90
    assert settings.current() is before
    with pytest.raises(TypeError):
        with settings.override(no_such_switch=1):
            pass
    assert settings.current() is before


def test_planning_reads_the_settings_in_force():
    problem = checks.Problem(2, 300, 16384, 8, 2, 128, np.dtype(np.float16))
    assert forward.sm90_variant(problem, "sm_90a") == forward.SM90_DEFAULT_VARIANTS[128]
    with settings.override(sm90=False):
        assert forward.sm90_variant(problem, "sm_90a") is None
    with settings.override(sm90_variants={128: "ws_n128"}):
        assert forward.sm90_variant(problem, "sm_90a") == "ws_n128"
    with settings.override(decode_tma_stages=4):
        assert decode.plan_decode(problem, -1, -1, False, 0, 132, True).spec.config.stages == 4
    assert decode.plan_decode(problem, -1, -1, False, 0, 132, True).spec.config.stages == 3
