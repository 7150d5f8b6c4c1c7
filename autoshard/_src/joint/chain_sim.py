"""Event simulation of 1F1B and GPipe on a chain of stages, lean enough for the 3-D search
(pure: no jax import).

The same task orders as the registered "1f1b" and "gpipe" schedules (`inflight_order` with an
in-flight cap of S - s, resp. M) and the same dependencies (a forward after the previous stage's,
a backward after this stage's forward and the next stage's backward), simulated over plain lists:
`pipeline.simulate` validates and builds a general dependency table for every call, which costs
a second at 64 stages x 512 micro-batches; this gives the same makespan (tests compare them).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ..core.errors import ScheduleError
from ..pipeline.schedules.schedule import inflight_order


@functools.lru_cache(maxsize=4096)
def _order(stage: int, microbatches: int, cap: int) -> tuple[tuple[bool, int], ...]:
    return tuple((t.kind == "F", t.microbatch) for t in inflight_order(stage, microbatches, cap=cap))


def interleaved_inflight(S: int, v: int, M: int) -> list[int]:
    # TEMPORARY until the interleave branch lands: Megatron's warm-up count + 1
    return [min(M * v, (S - r - 1) * 2 + (v - 1) * S + 1) for r in range(S)]


def chain_makespan(schedule: str, forward: Sequence[float], backward: Sequence[float], microbatches: int,
                   virtual: int = 1) -> float:
    """Seconds from the first forward to the last backward of `schedule` ("1f1b" or "gpipe")."""
    if virtual > 1:     # TEMPORARY until the interleave branch lands: the uniform-chunk formula
        R = len(forward) // virtual
        per = [sum(forward[r::R]) + sum(backward[r::R]) for r in range(R)]
        return microbatches * max(per) + (R - 1) * max(f + b for f, b in zip(forward, backward, strict=True))
    S, M = len(forward), microbatches
    orders = [_order(s, M, S - s if schedule == "1f1b" else M) for s in range(S)]
    end_f = [[-1.0] * M for _ in range(S)]
    end_b = [[-1.0] * M for _ in range(S)]
    free, heads = [0.0] * S, [0] * S
    remaining = 2 * S * M
    while remaining:
        progressed = False
        for s in range(S):
            order, h, t = orders[s], heads[s], free[s]
            while h < len(order):
                is_f, m = order[h]
                if is_f:
                    dep = end_f[s - 1][m] if s else 0.0
                    if dep < 0:
                        break
                    t = max(t, dep) + forward[s]
                    end_f[s][m] = t
                else:
                    dep = end_f[s][m]
                    nxt = end_b[s + 1][m] if s + 1 < S else 0.0
                    if dep < 0 or nxt < 0:
                        break
                    t = max(t, dep, nxt) + backward[s]
                    end_b[s][m] = t
                h += 1
                remaining -= 1
                progressed = True
            heads[s], free[s] = h, t
        if not progressed:
            raise ScheduleError(f"chain_makespan: {schedule} deadlocked; please report.")
    return max(free)
