"""Where `autoshard.pipelined` cuts a chain of eqns (plans are read duck-typed):
each eqn's earliest stage, from cuts that balance the estimated pipeline tick (the largest stage's
flops, the largest boundary's bytes) or from a pipeline plan's parameter placement."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...core.errors import PipelineError
from .. import compat as jc


def live_bytes(key_ins: list, producer: dict, batch_only: list, nbytes: dict, loss_key: Any) -> np.ndarray:
    """live[i]: bytes of the values made before eqn i and used at or after it, i.e. what a cut just
    before eqn i sends per micro-batch (batch-only values are recomputed, parameters are held)."""
    n = len(key_ins)
    last: dict[Any, int] = {}
    for e, ins in enumerate(key_ins):
        if not batch_only[e]:
            for k in ins:
                if k in producer and not batch_only[producer[k]]:
                    last[k] = max(last.get(k, -1), e)
    if not jc.is_literal(loss_key) and loss_key in producer and not batch_only[producer[loss_key]]:
        last[loss_key] = n                        # the loss leaves from the last stage
    diff = np.zeros(n + 2)
    for k, q in last.items():
        p = producer[k]
        if q > p:
            diff[p + 1] += nbytes[k]
            diff[q + 1] -= nbytes[k]
    return np.cumsum(diff)[:n]


def balanced_cuts(S: int, before: np.ndarray, total: float, live: np.ndarray, movable: list[bool],
                   flop_rate: float, link_bandwidth: float) -> list[int]:
    """S-1 cut positions minimising the runtime's tick estimate: a forward and a recomputing backward
    (4x the stage's forward flops) plus the two transfers the lock step makes every tick, each as
    long as the largest boundary's message (the ticks run in lock step). For each bound L on
    boundary bytes (ascending), the smallest achievable largest-stage flops T over cuts where
    live <= L is found by bisection with a greedy packing; the (T, L) pair with the lowest estimate
    wins."""
    n = len(live)
    positions = np.array([i for i in range(1, n) if movable[i]], dtype=int)
    if len(positions) < S - 1:
        raise PipelineError(
            f"autoshard.pipelined: the loss has {len(positions)} places to cut but the pipe axis asks for {S} stages; "
            f"use a smaller pipe axis.")

    def pack(allowed: np.ndarray, limit: float) -> list[int] | None:
        cum = before[allowed]
        cuts: list[int] = []
        start = 0.0
        prev = 0
        for _ in range(S - 1):
            j = int(np.searchsorted(cum, start + limit, "right")) - 1
            if j < 0 or allowed[j] <= prev:
                break
            cuts.append(int(allowed[j]))
            prev, start = int(allowed[j]), float(cum[j])
        if total - start > limit * (1 + 1e-9):
            return None
        if len(cuts) == S - 1:
            return cuts
        taken = set(cuts)    # stages to spare: any further cuts only shrink stages
        spare = [int(a) for a in allowed if int(a) not in taken][:S - 1 - len(cuts)]
        return sorted(cuts + spare) if len(cuts) + len(spare) == S - 1 else None

    def tick(t: float, bytes_: float) -> float:
        return 4 * t / flop_rate + 2 * bytes_ / link_bandwidth

    best: tuple[float, float, list[int]] | None = None
    for bound in np.unique(live[positions]):
        if best is not None and tick(total / S, bound) >= best[0]:
            break
        allowed = positions[live[positions] <= bound]
        if len(allowed) < S - 1 or pack(allowed, total) is None:
            continue
        lo, hi = total / S, total
        for _ in range(40):
            mid = (lo + hi) / 2
            if pack(allowed, mid) is None:
                lo = mid
            else:
                hi = mid
        cuts = pack(allowed, hi)
        bounds = np.diff([0.0, *before[cuts], total])
        est = tick(float(bounds.max()), float(live[cuts].max()))
        if best is None or est < best[0] * (1 - 1e-9):
            best = (est, float(bounds.max()), cuts)
    assert best is not None    # the largest bound allows every position
    return best[2]


def choose_cuts(windows: list[tuple[int, int]], targets: list[float], before: np.ndarray, live: np.ndarray,
                 movable: list[bool]) -> list[int]:
    """Per boundary k (1..S-1), the eqn index the cut goes before: inside windows[k-1], the fewest
    live bytes (within 5 %), then the closest to the flops target; cuts strictly increase."""
    cuts: list[int] = []
    prev = 0
    n = len(live)
    for (lo, hi), target in zip(windows, targets, strict=True):
        cand = [i for i in range(max(lo, prev + 1 if cuts else prev), min(hi, n - 1) + 1) if movable[i]]
        if not cand:   # nothing movable in the window: the first position at or past the target
            later = [i for i in range(prev + 1 if cuts else prev, n) if movable[i] and before[i] >= target]
            cand = later[:1] or [min(n - 1, max(prev + 1, lo))]
        floor = min(live[i] for i in cand)
        best = min(cand, key=lambda i: (live[i] > 1.05 * floor, abs(before[i] - target), i))
        cuts.append(best)
        prev = best
    return cuts


def anchors(plan: Any, S: int, keys: tuple[str, ...], key_ins: list, param_key: dict, batch_only: list,
             flops: list, modules: list[str], live: np.ndarray, flop_rate: float, link_bandwidth: float) -> list[int]:
    """The earliest stage of every eqn before data dependencies push it later: S-1 cuts in program
    order. Without a plan they balance the estimated tick (largest stage's flops and largest boundary's
    bytes); with one, each cut crosses the fewest bytes between the parameters the plan gives the
    stages on either side."""
    n = len(key_ins)
    movable = [not b for b in batch_only]
    work = np.array([0.0 if batch_only[e] else flops[e] for e in range(n)])
    if work.sum() <= 0:
        work = np.array([0.0 if batch_only[e] else 1.0 for e in range(n)])
    total = float(work.sum()) or 1.0
    before = np.cumsum(work) - work
    if plan is None:
        cuts = balanced_cuts(S, before, total, live, movable, flop_rate, link_bandwidth)
        return [int(np.searchsorted(cuts, e, "right")) for e in range(n)]
    plan_anchor = plan_anchors(plan, S, keys, key_ins, param_key, batch_only, modules)
    # the cut between stages k-1 and k lies after every eqn the plan anchors before k and at or
    # before the first it anchors at k or later; a plan that does not follow program order keeps
    # its anchors and data dependencies alone
    first, last = [n] * S, [-1] * S
    for e, a in enumerate(plan_anchor):
        if a is not None:
            first[a], last[a] = min(first[a], e), max(last[a], e)
    windows = [(max(last[:k]) + 1, min(first[k:])) for k in range(1, S)]
    if any(lo > hi for lo, hi in windows) or any(w1[0] > w2[1] for w1, w2 in zip(windows, windows[1:], strict=False)):
        return [a or 0 for a in plan_anchor]
    fwd = np.array([max(float(st.predicted_forward), 0.0) for st in plan.stages])
    share = np.cumsum(fwd) / fwd.sum() if fwd.sum() > 0 else np.arange(1, S + 1) / S
    cuts = choose_cuts(windows, [float(share[k - 1]) * total for k in range(1, S)], before, live, movable)
    return [max(int(np.searchsorted(cuts, e, "right")), a or 0) for e, a in enumerate(plan_anchor)]


def in_argument(step_keypath: str, key: str) -> bool:
    """The step's keypath ("[0]['block_0']['w']") is the loss's parameter `key` ("['block_0']['w']")
    inside one step argument."""
    head = step_keypath[:-len(key)] if step_keypath.endswith(key) else ""
    return head.startswith("[") and head.endswith("]") and head.count("[") == 1


def stage_count(plan: Any, schedule: Any, ranks: int, virtual_stages: Any) -> int:
    """How many stages to cut: one per pipe rank, or for "interleaved-1f1b" v per rank (stage k on rank
    k % ranks), v from the plan's stage count or `virtual_stages` (default 2)."""
    if schedule != "interleaved-1f1b":
        if virtual_stages is not None:
            raise PipelineError(f"autoshard.pipelined: virtual_stages={virtual_stages!r} needs "
                                f"schedule='interleaved-1f1b' (schedule={schedule!r} runs one stage per pipe rank).")
        return ranks
    if virtual_stages is not None and (isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int)
                                       or virtual_stages < 1):
        raise PipelineError(f"autoshard.pipelined: virtual_stages must be a positive int, got {virtual_stages!r}.")
    if plan is None:
        return ranks * (2 if virtual_stages is None else virtual_stages)
    n = len(plan.stages)
    if n % ranks or (virtual_stages is not None and n != ranks * virtual_stages):
        raise PipelineError(
            f"autoshard.pipelined: schedule='interleaved-1f1b' runs v stages on each of the {ranks} pipe ranks; the "
            f"plan has {n} stages (virtual_stages={virtual_stages}). Fix: a plan of v x {ranks} stages, or a 'pipe' "
            f"axis dividing {n}.")
    return n


def plan_stages(plan: Any, S: int) -> tuple:
    if not getattr(plan, "is_pipeline", False):
        raise PipelineError("autoshard.pipelined: plan= takes a pipeline Plan (autoshard.plan(..., pipeline="
                            "'rannc' or 'graphpipe')); this is a tensor plan (one stage over the whole mesh).")
    stages = plan.stages
    if len(stages) != S:
        raise PipelineError(
            f"autoshard.pipelined: the plan has {len(stages)} stages but the mesh's pipe axis has {S} ranks; use a "
            f"mesh with a 'pipe' axis of the plan's stage count (mesh={{'pipe': {len(stages)}, ...}}).")
    return tuple(stages)


def plan_anchors(plan: Any, S: int, keys: tuple[str, ...], key_ins: list, param_key: dict, batch_only: list,
                  modules: list[str]) -> list[int | None]:
    """The plan's stage of every eqn reading a parameter (None: no parameter, or only tied ones)."""
    stages = plan_stages(plan, S)
    plan_owner: dict[str, int] = {}
    for st in stages:
        for kp in st.params:
            plan_owner[kp] = st.index
    stage_of_leaf = []
    for k in keys:
        hits = {s for kp, s in plan_owner.items() if in_argument(kp, k)}
        if len(hits) != 1:
            raise PipelineError(
                f"autoshard.pipelined: parameter {k} is {'not in' if not hits else 'ambiguous in'} the plan's stage "
                f"parameters; the plan must come from a train step taking these parameters as one argument.")
        stage_of_leaf.append(hits.pop())
    # A parameter read in several modules (tied embeddings) has one plan stage but uses at both ends
    # of the model; it anchors nothing, its uses follow their other inputs.
    readers: dict[int, set[str]] = {}
    for e, ins in enumerate(key_ins):
        for k in ins:
            if k in param_key and not batch_only[e]:
                readers.setdefault(k, set()).add(modules[e])
    out: list[int | None] = []
    for e, ins in enumerate(key_ins):
        got = [stage_of_leaf[param_key[k]] for k in ins if k in param_key and len(readers[k]) == 1]
        out.append(max(got) if got and not batch_only[e] else None)
    return out
