"""The options of one attention call, resolved once: what every kernel path and wrapper reads.

:func:`resolve` turns the public keywords (``softmax_scale``, ``causal``, ``window_size``, ``softcap``,
``alibi_slopes``, ``dropout_p``) into :class:`AttentionOptions`: the scale with its default, the window normalized
against the problem's lengths, and the three scalars the kernels turn ``q . k`` into ``exp2`` arguments with
(``cuda_src/params.cuh``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from . import checks

LOG2E = math.log2(math.e)


def normalize_window(left: int, right: int, seqlen_q: int, seqlen_k: int) -> tuple[int, int]:
    """Drops window sides that cannot hide any key (-1 = unbounded), so full attention runs unmasked."""
    if left >= seqlen_k - 1:   # j >= i + sk - sq - left holds for every row once left >= sk - 1
        left = -1
    if right >= seqlen_q - 1:  # j <= i + sk - sq + right holds for every key once right >= sq - 1
        right = -1
    return left, right


DROPOUT_LEVELS = 256  # the draws are bytes (cuda_src/dropout.cuh Dropout::LEVELS); a threshold of 256: no dropout


def dropout_threshold(dropout_p: float) -> int:
    """Draws (bytes) below the threshold keep their element (cuda_src/dropout.cuh): round((1 - p) 256), at most 255
    where p > 0, so the keep probability is threshold / 256 exactly (p rounded to a multiple of 1/256, at least
    1/256); 256: no dropout."""
    if not dropout_p:
        return DROPOUT_LEVELS
    return min(DROPOUT_LEVELS - 1, max(1, round((1.0 - float(dropout_p)) * DROPOUT_LEVELS)))


def forward_scales(softmax_scale: float, softcap: float, score_mod: bool) -> dict:
    """The three scalars the kernel uses to turn q.k into exp2 arguments (see params.cuh)."""
    return {
        "scale_log2": LOG2E if score_mod else softmax_scale * LOG2E,
        "mod_scale": softmax_scale / softcap if softcap > 0 else softmax_scale,
        "softcap": softcap,
    }


@dataclass(frozen=True)
class AttentionOptions:
    """One call's options, resolved against its problem."""

    softmax_scale: float   # the given scale, or 1 / sqrt(headdim)
    left: int              # window sides after normalize_window: -1 unbounded
    right: int
    softcap: float         # 0: off
    alibi: bool            # ALiBi slopes given
    causal: bool           # as given (the window already holds it)
    dropout_threshold: int = DROPOUT_LEVELS  # dropout_threshold(dropout_p); DROPOUT_LEVELS: no dropout

    @property
    def score_mod(self) -> bool:
        """softcap or ALiBi: the kernels with the score modification compiled in."""
        return self.softcap > 0 or self.alibi

    @property
    def band(self) -> bool:
        """A causal mask or a sliding window that hides some key: the kernels with masking compiled in."""
        return self.left >= 0 or self.right >= 0

    @property
    def dropout(self) -> bool:
        return self.dropout_threshold < DROPOUT_LEVELS

    @property
    def dropout_fields(self) -> dict:
        """The parameter structs' dropout_threshold and dropout_scale (the kept probabilities' scale)."""
        return {"dropout_threshold": self.dropout_threshold,
                "dropout_scale": float(DROPOUT_LEVELS) / self.dropout_threshold}

    @property
    def scales(self) -> dict:
        """scale_log2, mod_scale and softcap, the parameter struct's scalars."""
        return forward_scales(self.softmax_scale, self.softcap, self.score_mod)


def resolve(problem, *, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, dropout_p=0.0) -> AttentionOptions:
    """The options of a call whose arguments passed the checks, for `problem` (a checks.Problem)."""
    scale = 1.0 / math.sqrt(problem.headdim) if softmax_scale is None else float(softmax_scale)
    left, right = normalize_window(*checks.window(causal, window_size), problem.seqlen_q, problem.seqlen_k)
    return AttentionOptions(scale, left, right, float(softcap), alibi_slopes is not None, bool(causal),
                            dropout_threshold(dropout_p))
