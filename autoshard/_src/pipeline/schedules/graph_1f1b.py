"""graph-1F1B: GraphPipe's static micro-batch scheduler (Algorithm 2, Appendix A.1, Table 2).

For a DAG of stages, each with its own micro-batch count, walk the stages from the sinks back to
the sources and give each the fewest in-flight micro-batches that keep every successor fed
(ComputeInFlight, max over successors). Each stage then runs forwards until it holds that many,
and from then on a backward as soon as the cap is reached, oldest first (ScheduleTask: backward as
early as possible, kFkB with k=1 by default). The order depends only on the DAG and the counts, not
on timings, so a runtime can execute it as a static table and a chain with equal counts gives
exactly 1F1B.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import networkx as nx

from ...core.errors import ScheduleError
from .schedule import Schedule, chain_edges, check_positive_int, dependency_table, inflight_order, run_ticks


def compute_inflight(kx: int, bx: int, ky: int, by: int, iy: int) -> int:
    """GraphPipe Table 2: in-flight samples stage x (kx-F-kx-B schedule, micro-batch size bx) needs
    so that its successor y (ky, by), which holds iy samples in flight, never waits on x."""
    x, y, m = kx * bx, ky * by, max(bx, by)
    if x < y:
        if m < x:
            return iy + 2 * m  # max{bx,by} < kx bx < ky by
        if m == x:
            return iy + m  # max{bx,by} = kx bx < ky by
        return iy + by  # bx <= kx bx < by <= ky by
    if x > y:
        if bx <= by:  # by <= ky by always, so by < y or by == y
            return iy + x - y + 2 * by if by < y else iy + x  # bx <= by < ky by < kx bx | bx <= by = ky by
        if bx < y:
            return iy + x - y + 2 * bx  # by <= bx < ky by < kx bx
        if bx == y:
            return iy + x  # by <= bx = ky by < kx bx
        return iy + x - y + bx  # by <= ky by < bx <= kx bx
    return iy + y if m == y else iy + 2 * m  # kx bx = ky by, = or > max{bx,by}


def static_inflight(
    num_microbatches: Sequence[int], edges: Sequence[tuple[int, int]], k: int | Sequence[int] = 1
) -> list[int]:
    """Per-stage in-flight micro-batch caps from Table 2 (Appendix A.1), sinks first: a sink holds k
    micro-batches; any other stage the max over its successors, capped at its micro-batch count."""
    counts = [check_positive_int("static_inflight", "num_microbatches[i]", n) for n in num_microbatches]
    p = len(counts)
    ks = _per_stage_k(k, p)
    graph = nx.DiGraph()
    graph.add_nodes_from(range(p))
    graph.add_edges_from(edges)
    if graph.number_of_nodes() != p or not nx.is_directed_acyclic_graph(graph):
        raise ScheduleError(
            f"static_inflight: edges {list(edges)} must form a DAG over the {p} stages given micro-batch counts."
        )
    # Sizes in samples: the mini-batch is lcm(counts) samples, so every micro-batch size is an int.
    total = math.lcm(*counts)
    size = [total // n for n in counts]
    caps = [0] * p
    held = [0] * p  # samples in flight at each stage under its cap
    for x in reversed(list(nx.topological_sort(graph))):
        succ = list(graph.successors(x))
        need = ks[x] * size[x]
        if succ:
            need = max(compute_inflight(ks[x], size[x], ks[y], size[y], held[y]) for y in succ)
        caps[x] = min(counts[x], max(ks[x], -(-need // size[x])))
        held[x] = caps[x] * size[x]
    return caps


def graph_one_f_one_b(
    num_stages: int | None = None,
    num_microbatches: int | Sequence[int] = 8,
    edges: Sequence[tuple[int, int]] | None = None,
    k: int | Sequence[int] = 1,
) -> Schedule:
    """1F1B over a DAG of stages with per-stage micro-batch counts (GraphPipe). Without `edges` the
    stages form a chain; `num_microbatches` is one int or one per stage; `k` gives kFkB stages."""
    fn = "schedule('graph-1f1b')"
    if edges is None:
        if num_stages is None:
            raise ScheduleError(f"{fn}: give num_stages (for a chain) or edges (a DAG of stages).")
        edges = chain_edges(check_positive_int(fn, "num_stages", num_stages))
    edges = tuple((int(u), int(v)) for u, v in edges)
    one_count = isinstance(num_microbatches, numbers.Integral)
    if num_stages is None:
        num_stages = 1 + max((max(e) for e in edges), default=0) if one_count else len(num_microbatches)
    p = check_positive_int(fn, "num_stages", num_stages)
    counts = [num_microbatches] * p if one_count else list(num_microbatches)
    if len(counts) != p:
        raise ScheduleError(f"{fn}: {len(counts)} micro-batch counts for {p} stages; give one int or one per stage.")
    counts = [check_positive_int(fn, "num_microbatches", n) for n in counts]
    if any(not 0 <= s < p for e in edges for s in e):
        raise ScheduleError(f"{fn}: edges {list(edges)} name stages outside 0..{p - 1}.")
    ks = _per_stage_k(k, p)
    caps = static_inflight(counts, edges, ks)
    while True:
        ranks = tuple(inflight_order(s, counts[s], caps[s], ks[s]) for s in range(p))
        sched = Schedule("graph-1f1b", p, edges, tuple(counts), ranks)
        _, stalled = run_ticks(sched, dependency_table(sched))
        if not stalled:
            return sched
        # Table 2 assumes aligned micro-batches (e.g. powers of two). With ragged overlaps a stage can
        # need one more forward in flight; raising the blocked caps converges (all caps = n is GPipe).
        raise_ = [r for r, i in stalled if ranks[r][i].kind == "B" and caps[r] < counts[r]]
        if not raise_:
            raise ScheduleError(f"{fn}: could not build a deadlock-free order for counts {counts}; please report.")
        for r in raise_:
            caps[r] += 1


def _per_stage_k(k: int | Sequence[int], p: int) -> list[int]:
    ks = [k] * p if isinstance(k, numbers.Integral) else list(k)
    if len(ks) != p:
        raise ScheduleError(f"graph-1f1b: k has {len(ks)} values for {p} stages; give one int or one per stage.")
    return [check_positive_int("graph-1f1b", "k", v) for v in ks]


SCHEDULES = {"graph-1f1b": graph_one_f_one_b}   # the registry's built-ins from this module
