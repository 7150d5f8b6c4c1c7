"""Event simulation of 1F1B, GPipe and interleaved 1F1B on a chain of stages, lean enough for the
3-D search (pure: no jax import).

The same task orders as the registered "1f1b", "gpipe" and "interleaved-1f1b" schedules and the
same dependencies (a forward after the previous stage's, a backward after this stage's forward and
the next stage's backward), with stage k on rank k % S. `pipeline.simulate` validates and builds a
general dependency table for every call, which costs seconds at 64 ranks x 3 chunks x 512
micro-batches; this gives the same makespan (tests compare them) in tens of milliseconds:

* the lock-step ticks of the orders (which task each rank runs at each tick) do not depend on the
  durations, so they are computed once per (schedule, S, v, M) with numpy over ranks and cached;
* every task of a tick depends only on tasks of earlier ticks, so one call's end times follow
  tick by tick, each tick one vectorised max-plus step over the ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from ..core.errors import ScheduleError

_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")


def _orders(S: int, v: int, M: int, warmup: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(stage, micro-batch, is-forward) per rank and position, [S, 2*M*v] each: `warmup[r]` forwards,
    then one forward and one backward, then the remaining backwards (`interleaved.virtual_order`,
    which with v=1 is 1F1B and with warmup M is GPipe)."""
    total = M * v
    L = 2 * total
    pos = np.arange(L)[None, :]
    w = warmup[:, None]
    steady = 2 * (total - w)
    is_f = (pos < w) | ((pos < w + steady) & ((pos - w) % 2 == 0))
    # index k of the k-th forward / k-th backward on the rank at this position
    k_f = np.where(pos < w, pos, w + (pos - w) // 2)
    k_b = np.where(pos < w + steady, (pos - w) // 2, pos - total)
    k = np.where(is_f, k_f, k_b)
    group, within = np.divmod(k, S * v)
    chunk = np.where(is_f, within // S, v - 1 - within // S)
    stage = chunk * S + np.arange(S)[:, None]
    return stage, group * S + within % S, is_f


def _warmup(S: int, v: int, M: int) -> np.ndarray:
    """Forwards each rank runs before its first backward (`interleaved.warmup_forwards`)."""
    r = np.arange(S)
    return np.minimum(M * v, S - 1 - r if v == 1 else 2 * (S - 1 - r) + (v - 1) * S)


@functools.lru_cache(maxsize=8)   # ~8 MB an entry at 64 ranks x 3 chunks x 512 micro-batches
def _ticks(schedule: str, S: int, v: int, M: int) -> tuple[np.ndarray, ...]:
    """Per tick and rank: the task it ends (or a scratch slot when idle), the tasks it waits for and
    the index of its duration. Task ids: forward (k, m) -> k*M + m, backward -> (n + k)*M + m, then
    ZERO (ends at time 0: a missing dependency) and SCRATCH (written by idle ranks, never read)."""
    n = S * v
    warm = np.full(S, M) if schedule == "gpipe" else _warmup(S, v, M)
    stage, mb, is_f = _orders(S, v, M, warm)
    ZERO, SCRATCH = 2 * n * M, 2 * n * M + 1
    tid = np.where(is_f, stage, n + stage) * M + mb
    dep1 = np.where(is_f, np.where(stage > 0, (stage - 1) * M + mb, ZERO), stage * M + mb)
    dep2 = np.where(is_f | (stage == n - 1), ZERO, (n + stage + 1) * M + mb)
    prev = np.concatenate([np.full((S, 1), ZERO), tid[:, :-1]], axis=1)
    dur = np.where(is_f, stage, n + stage)

    L, rows = tid.shape[1], np.arange(S)
    flat = [a.ravel() for a in (tid, prev, dep1, dep2, dur)]
    tick = np.full(2 * n * M + 2, np.iinfo(np.int64).max)
    tick[ZERO] = -1
    heads, base, left, t = np.zeros(S, np.int64), rows * L, S * L, 0
    at: list[np.ndarray] = []                       # per tick: flat position each rank runs (S*L: idle)
    while left:
        idx = base + np.minimum(heads, L - 1)
        ready = (heads < L) & (tick[flat[2][idx]] < t) & (tick[flat[3][idx]] < t)
        run = idx[ready]
        if not run.size:
            raise ScheduleError(f"chain_makespan: {schedule} deadlocked at tick {t}; please report.")
        tick[flat[0][run]] = t
        at.append(np.where(ready, idx, S * L))
        heads += ready
        left -= run.size
        t += 1
    pos = np.stack(at)                              # [T, S]
    fills = (SCRATCH, ZERO, ZERO, ZERO, 2 * n)      # idle: write scratch, read time 0, take 0 seconds
    return tuple(np.append(a, fill)[pos] for a, fill in zip(flat, fills, strict=True))


def chain_makespan(schedule: str, forward: Sequence[float], backward: Sequence[float], microbatches: int,
                   virtual: int = 1) -> float:
    """Seconds from the first forward to the last backward of `schedule` ("1f1b", "gpipe" or
    "interleaved-1f1b"). `forward`/`backward`: seconds per micro-batch of each stage; for
    "interleaved-1f1b" one per virtual stage (S * `virtual` of them, stage k on rank k % S)."""
    if schedule not in _SCHEDULES:
        raise ScheduleError(f"chain_makespan: schedule={schedule!r} is not one of {list(_SCHEDULES)}.")
    n, M, v = len(forward), int(microbatches), int(virtual)
    if v < 1 or (v > 1 and schedule != "interleaved-1f1b") or n % v or len(backward) != n or M < 1:
        raise ScheduleError(
            f"chain_makespan: {schedule} with virtual={virtual}, {n} forward and {len(backward)} backward times and "
            f"{microbatches} micro-batches; give one time per stage (S * virtual of them, virtual > 1 only for "
            "'interleaved-1f1b') and a positive micro-batch count.")
    S = n // v
    if schedule == "interleaved-1f1b" and M % S:
        raise ScheduleError(
            f"chain_makespan: interleaved-1f1b runs micro-batches in groups of the {S} ranks; {M} is not a "
            f"multiple of {S}. Fix: use {-(-M // S) * S} micro-batches.")
    task, prev, dep1, dep2, dur_ix = _ticks(schedule, S, v, M)
    dur = np.concatenate([np.asarray(forward, float), np.asarray(backward, float), [0.0]])[dur_ix]
    end = np.zeros(2 * n * M + 2)
    for t in range(task.shape[0]):
        end[task[t]] = np.maximum(np.maximum(end[prev[t]], end[dep1[t]]), end[dep2[t]]) + dur[t]
    return float(end[:-2].max())


def interleaved_inflight(S: int, v: int, M: int) -> list[int]:
    """Per rank, the peak number of (stage, micro-batch) activations alive at once under interleaved
    1F1B on S ranks with v chunks (forward done, backward not): the warm-up's 2*(S-1-r) + (v-1)*S
    forwards plus the first steady forward, at most M*v. v=1 gives 1F1B's min(S-r, M)."""
    return np.minimum(M * v, _warmup(S, v, M) + 1).tolist()


def interleaved_peak_bytes(S: int, v: int, M: int, activation_bytes: Sequence[float]) -> list[float]:
    """Per rank, the peak bytes of live activations under interleaved 1F1B when a micro-batch of
    virtual stage k keeps `activation_bytes[k]` (S * v values): for chunks of unequal size, where
    the count of `interleaved_inflight` times one size is not exact."""
    a = np.asarray(activation_bytes, float)
    if a.shape != (S * v,):
        raise ScheduleError(f"interleaved_peak_bytes: activation_bytes needs one value per virtual stage "
                            f"({S} x {v} = {S * v}), got {len(a)}.")
    stage, _, is_f = _orders(S, v, M, _warmup(S, v, M))
    live = np.cumsum(np.where(is_f, a[stage], -a[stage]), axis=1)
    return np.maximum(live.max(axis=1), 0.0).tolist()
