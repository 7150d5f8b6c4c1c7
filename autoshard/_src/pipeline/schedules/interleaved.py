"""Interleaved 1F1B (virtual pipeline stages), Narayanan et al. SC'21 §2.2.2, Megatron-LM's schedule.

S pipeline ranks each hold v model chunks: the model is a chain of S*v stages and stage k runs on
rank k % S, so a micro-batch crosses the ranks v times. Each rank runs forwards in groups of S
micro-batches per chunk (chunk 0 of micro-batches 0..S-1, chunk 1 of the same, ..., then the next
S micro-batches), backwards in the same groups with the chunks reversed. Rank r warms up with
Megatron's 2*(S-1-r) + (v-1)*S forwards (at most all M*v), then alternates one forward and one
backward, then drains the backwards. Stages are 1/v of a plain stage, so the fill and drain shrink
by v: with per-rank forward/backward times f and b split evenly over the chunks and free
transfers, the step takes M*(f+b) + (S-1)*(f+b)/v instead of 1F1B's (M+S-1)*(f+b). The S-1-r
forwards beyond the S-1-r the dependencies need keep the steady state busy while activations and
gradients are in flight (with a transfer time they save most of its cost), for S-1-r more
activations held.

Convention: `num_stages` is the number of pipeline ranks S (as in the paper and Megatron); the
returned `Schedule` has S*v stages and `placement[k] == k % S`. The groups of S need M to be a
multiple of S. With v=1 Megatron runs its plain 1F1B (S-1-r warm-up forwards), and so does this:
v=1 is exactly the registered "1f1b".
"""

from __future__ import annotations

import numbers
from typing import Any

from ...core.errors import ScheduleError
from .schedule import Schedule, Task, chain_edges, check_positive_int


def _args(num_stages: Any, num_microbatches: Any, virtual_stages: Any) -> tuple[int, int, int]:
    fn = "interleaved-1f1b"
    S = check_positive_int(fn, "num_stages", num_stages)
    v = check_positive_int(fn, "virtual_stages", virtual_stages)
    if not isinstance(num_microbatches, numbers.Integral):
        counts = list(num_microbatches)
        if len(counts) != S * v or len(set(counts)) != 1:
            raise ScheduleError(
                f"{fn}: num_microbatches={counts} must be one count for every stage; pass one int."
            )
        num_microbatches = counts[0]
    M = check_positive_int(fn, "num_microbatches", num_microbatches)
    if M % S:
        up = -(-M // S) * S
        raise ScheduleError(
            f"{fn}: num_microbatches={M} is not a multiple of num_stages={S} (the pipeline ranks): the schedule "
            f"runs micro-batches in groups of {S}, one per rank. Fix: use num_microbatches={up}"
            + (f" or {up - S}" if up > S else "") + ", or the plain '1f1b'."
        )
    return S, M, v


def warmup_forwards(rank: int, num_ranks: int, num_microbatches: int, virtual_stages: int) -> int:
    """Forwards rank `rank` runs before its first backward (Megatron-LM's counts)."""
    S, v = num_ranks, virtual_stages
    extra = (S - 1 - rank) if v == 1 else 2 * (S - 1 - rank) + (v - 1) * S
    return min(num_microbatches * v, extra)


def virtual_order(rank: int, num_ranks: int, num_microbatches: int, virtual_stages: int) -> tuple[Task, ...]:
    """Rank `rank`'s task order (stage k = chunk * num_ranks + rank); arguments are not checked."""
    S, M, v = num_ranks, num_microbatches, virtual_stages
    total = M * v

    def task(k: int, kind: str) -> Task:
        group, within = divmod(k, S * v)
        chunk = within // S if kind == "F" else v - 1 - within // S
        return Task(chunk * S + rank, group * S + within % S, kind)

    warmup = warmup_forwards(rank, S, M, v)
    order = [task(k, "F") for k in range(warmup)]
    for k in range(total - warmup):          # steady state: one forward, one backward
        order += [task(warmup + k, "F"), task(k, "B")]
    order += [task(k, "B") for k in range(total - warmup, total)]
    return tuple(order)


def interleaved_1f1b(num_stages: int, num_microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B on `num_stages` pipeline ranks with `virtual_stages` chunks each (module doc):
    a chain of num_stages * virtual_stages stages, stage k on rank k % num_stages."""
    S, M, v = _args(num_stages, num_microbatches, virtual_stages)
    ranks = tuple(virtual_order(r, S, M, v) for r in range(S))
    n = S * v
    return Schedule("interleaved-1f1b", n, chain_edges(n), (M,) * n, ranks, tuple(k % S for k in range(n)))


SCHEDULES = {"interleaved-1f1b": interleaved_1f1b}   # the registry's built-ins from this module
