"""Every ``CUFLASH_*`` switch, in one place: read once from the environment, overridable without reloading.

The switches exist for measuring and for turning a kernel path off; the defaults are what the planner's tables
were measured with (``docs/settings.md`` lists each one). Code reads them through :func:`current` at planning
time, never at import time, so a test or a benchmark changes them with :func:`override`::

    with cuflash.settings.override(sm90=False):
        out = cuflash.attention(q, k, v)       # the portable forward, even on Hopper

Parsing is pure Python: :meth:`Settings.from_env` takes any mapping, so the formats are testable without touching
``os.environ``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass
from typing import Callable, Mapping

__all__ = ["Settings", "current", "override", "on_change"]

DET_MODES = ("auto", "slices", "fixed", "ordered")


def _flag(env: Mapping, name: str, default: bool) -> bool:
    return env.get(name, "1" if default else "0") == "1"


def _int(env: Mapping, name: str, default: int) -> int:
    text = env.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be an integer, not {text!r}") from None


def env_pairs(text: str | None) -> list:
    """"64:ws,128c:ws_n128" -> [("64", "ws"), ("128c", "ws_n128")] (the variant switches' format)."""
    return [tuple(item.partition(":")[::2]) for item in (text or "").replace(" ", "").split(",") if item]


def _head_dim_map(text: str | None, name: str, value: Callable) -> dict:
    try:
        return {int(d): value(v) for d, v in env_pairs(text)}
    except ValueError:
        raise ValueError(f"{name}: expected 'headdim:value,...', not {text!r}") from None


def _short_table(text: str | None) -> dict | None:
    """CUFLASH_SM90_SHORT_VARIANTS, e.g. "128@512:pingpong_n128_p_s2,128c:pingpong_n128_p" as
    {(head dim, band, bound or None): variant}; None: unset. (The forward bounds a missing @N.)"""
    if text is None:
        return None
    table = {}
    for key, variant in env_pairs(text):
        d, _, bound = key.partition("@")
        table[int(d.rstrip("c")), d.endswith("c"), int(bound) if bound else None] = variant
    return table


@dataclass(frozen=True)
class Settings:
    """The switches. Defaults leave every kernel path on and every table as measured."""

    sm90: bool = True                      # CUFLASH_SM90: the Hopper forward where it applies
    sm90_variants: dict = dataclasses.field(default_factory=dict)  # CUFLASH_SM90_VARIANTS: head dim -> variant
    sm90_short_variants: dict | None = None  # CUFLASH_SM90_SHORT_VARIANTS: replaces the short-sequence table
    sm90_o_tma: int | None = None          # CUFLASH_SM90_O_TMA: 0/1 for every head dim; None: the table
    sm90_walk_chunk: int = 0               # CUFLASH_SM90_WALK_CHUNK: pairs per chunk of the persistent walk; 0: rule
    bwd_qbuf: bool = True                  # CUFLASH_BWD_QBUF: double-buffered Q/dO in the portable backward
    bwd_wide: bool = True                  # CUFLASH_BWD_WIDE: the portable backward past d = 128 (sm_90a)
    bwd_sm90: bool = True                  # CUFLASH_BWD_SM90: the Hopper backward where it applies
    bwd_sm90_det: str = "auto"             # CUFLASH_BWD_SM90_DET: deterministic mode, auto | slices | fixed | ordered
    bwd_sm90_det_slots: int = 0            # CUFLASH_BWD_SM90_DET_SLOTS: fixed dQ slice count; 0: the rule
    bwd_sm90_det_max_passes: int = 0       # CUFLASH_BWD_SM90_DET_MAX_PASSES: slot tie-break bound; 0: off
    bwd_sm90_block_m: dict = dataclasses.field(default_factory=dict)  # CUFLASH_BWD_SM90_BLOCK_M: head dim -> rows
    bwd_sm90_ordered_blocks: dict = dataclasses.field(default_factory=dict)  # CUFLASH_BWD_SM90_ORDERED_BLOCKS
    bwd_sm90_dq_first_store: bool = True   # CUFLASH_BWD_SM90_DQ_FIRST_STORE: first dQ additions as stores
    pdl: bool = True                       # CUFLASH_PDL: decode_combine as a programmatic dependent launch
    decode_tma: bool = True                # CUFLASH_DECODE_TMA: the TMA decode kernel where it applies
    decode_tma_stages: int = 3             # CUFLASH_DECODE_TMA_STAGES: slots of its K/V ring
    decode_fused_max_splits: int = 128     # CUFLASH_DECODE_FUSED_MAX_SPLITS: splits the TMA kernel merges itself
    decode_evict_first_mb: int = 128       # CUFLASH_DECODE_EVICT_FIRST_MB: evict_first K/V up to this many MiB
    fp8_pipelined: int | None = None       # CUFLASH_FP8_PIPELINED: 0/1, the FP8 forward's form; None: its table
    fp8_vt_pass: int | None = None         # CUFLASH_FP8_VT_PASS: 0/1, V^T from the pass or not; None: its table

    def __post_init__(self):
        if self.bwd_sm90_det not in DET_MODES:
            raise ValueError(f"CUFLASH_BWD_SM90_DET must be auto, slices, fixed or ordered, not {self.bwd_sm90_det!r}")
        if self.sm90_o_tma not in (None, 0, 1):
            raise ValueError(f"CUFLASH_SM90_O_TMA must be 0 or 1, not {self.sm90_o_tma!r}")
        for name, value in (("CUFLASH_FP8_PIPELINED", self.fp8_pipelined), ("CUFLASH_FP8_VT_PASS", self.fp8_vt_pass)):
            if value not in (None, 0, 1):
                raise ValueError(f"{name} must be 0 or 1, not {value!r}")

    @classmethod
    def from_env(cls, env: Mapping = os.environ) -> Settings:
        """The settings a process with environment `env` runs with (unset variables keep the defaults)."""
        o_tma, pipelined = env.get("CUFLASH_SM90_O_TMA"), env.get("CUFLASH_FP8_PIPELINED")
        vt_pass = env.get("CUFLASH_FP8_VT_PASS")
        for name, value in (("CUFLASH_SM90_O_TMA", o_tma), ("CUFLASH_FP8_PIPELINED", pipelined),
                            ("CUFLASH_FP8_VT_PASS", vt_pass)):
            if value is not None and value.strip() not in ("0", "1"):
                raise ValueError(f"{name} must be 0 or 1, not {value!r}")
        return cls(
            sm90=_flag(env, "CUFLASH_SM90", True),
            sm90_variants=_head_dim_map(env.get("CUFLASH_SM90_VARIANTS"), "CUFLASH_SM90_VARIANTS", str),
            sm90_short_variants=_short_table(env.get("CUFLASH_SM90_SHORT_VARIANTS")),
            sm90_o_tma=None if o_tma is None else int(o_tma),
            sm90_walk_chunk=_int(env, "CUFLASH_SM90_WALK_CHUNK", 0),
            bwd_qbuf=_flag(env, "CUFLASH_BWD_QBUF", True),
            bwd_wide=_flag(env, "CUFLASH_BWD_WIDE", True),
            bwd_sm90=_flag(env, "CUFLASH_BWD_SM90", True),
            bwd_sm90_det=env.get("CUFLASH_BWD_SM90_DET", "auto"),
            bwd_sm90_det_slots=_int(env, "CUFLASH_BWD_SM90_DET_SLOTS", 0),
            bwd_sm90_det_max_passes=_int(env, "CUFLASH_BWD_SM90_DET_MAX_PASSES", 0),
            bwd_sm90_block_m=_head_dim_map(env.get("CUFLASH_BWD_SM90_BLOCK_M"), "CUFLASH_BWD_SM90_BLOCK_M", int),
            bwd_sm90_ordered_blocks=_head_dim_map(env.get("CUFLASH_BWD_SM90_ORDERED_BLOCKS"),
                                                  "CUFLASH_BWD_SM90_ORDERED_BLOCKS", int),
            bwd_sm90_dq_first_store=_flag(env, "CUFLASH_BWD_SM90_DQ_FIRST_STORE", True),
            pdl=_flag(env, "CUFLASH_PDL", True),
            decode_tma=_flag(env, "CUFLASH_DECODE_TMA", True),
            decode_tma_stages=_int(env, "CUFLASH_DECODE_TMA_STAGES", 3),
            decode_fused_max_splits=_int(env, "CUFLASH_DECODE_FUSED_MAX_SPLITS", 128),
            decode_evict_first_mb=_int(env, "CUFLASH_DECODE_EVICT_FIRST_MB", 128),
            fp8_pipelined=None if pipelined is None else int(pipelined),
            fp8_vt_pass=None if vt_pass is None else int(vt_pass),
        )


_current = Settings.from_env()
_listeners: list = []


def current() -> Settings:
    """The settings in force."""
    return _current


def on_change(listener: Callable[[], None]) -> Callable[[], None]:
    """Registers `listener` (no arguments) to run whenever the settings change: the ops modules drop the launches
    they cached under the old ones."""
    _listeners.append(listener)
    return listener


def _set(settings: Settings) -> None:
    global _current
    _current = settings
    for listener in _listeners:
        listener()


@contextlib.contextmanager
def override(**changes):
    """Within the block, the current settings with `changes` (field names of :class:`Settings`) applied."""
    previous = _current
    _set(dataclasses.replace(previous, **changes))
    try:
        yield _current
    finally:
        _set(previous)
