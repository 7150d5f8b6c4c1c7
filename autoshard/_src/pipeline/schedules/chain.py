"""Chain schedules: GPipe and synchronous 1F1B (one micro-batch count for every stage)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

from ...core.errors import ScheduleError
from .schedule import Schedule, chain_edges, check_positive_int, inflight_order


def _chain_args(fn: str, num_stages: Any, num_microbatches: Any) -> tuple[int, int]:
    p = check_positive_int(fn, "num_stages", num_stages)
    if not isinstance(num_microbatches, numbers.Integral):
        per_stage = list(num_microbatches)
        if len(per_stage) != p or len(set(per_stage)) != 1:
            raise ScheduleError(
                f"{fn}: chain schedules run one micro-batch count on every stage, got {per_stage} "
                f"for {p} stages. Pass one int, or use 'graph-1f1b' for per-stage micro-batch counts."
            )
        num_microbatches = per_stage[0]
    return p, check_positive_int(fn, "num_microbatches", num_microbatches)


def gpipe(num_stages: int, num_microbatches: int | Sequence[int]) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards; each stage holds all m in flight."""
    p, m = _chain_args("gpipe", num_stages, num_microbatches)
    ranks = tuple(inflight_order(s, m, cap=m) for s in range(p))
    return Schedule("gpipe", p, chain_edges(p), (m,) * p, ranks)


def one_f_one_b(num_stages: int, num_microbatches: int | Sequence[int]) -> Schedule:
    """Synchronous 1F1B (PipeDream-Flush): stage s warms up with p-s forwards, then alternates one
    backward and one forward, so it holds at most p-s micro-batches instead of GPipe's m."""
    p, m = _chain_args("1f1b", num_stages, num_microbatches)
    ranks = tuple(inflight_order(s, m, cap=p - s) for s in range(p))
    return Schedule("1f1b", p, chain_edges(p), (m,) * p, ranks)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}   # the registry's built-ins from this module
