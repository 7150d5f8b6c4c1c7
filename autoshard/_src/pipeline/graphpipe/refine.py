"""Per-stage micro-batch sizes for a GraphPipe or SPP plan (opt-in; GraphPipe §6, Fig. 5).

The partitioner's DP gives every stage the plan's one micro-batch size b (the paper's default
configuration). Stages differ in how their time per sample falls with the micro-batch: a memory-bound
stage (embedding bags, small MLPs that read their weights once per micro-batch) wants large
micro-batches, while a stage that is already efficient at small ones does better with more, smaller
micro-batches (shorter fill and drain, fewer samples in flight). With `per_stage_microbatch=True`
the chosen stage DAG and devices keep their shape and each stage's size b_s (a power of two dividing
the batch, at least one sample per replica) is improved by local search on the *simulated* step:
halve or double one stage's size (alone, or with the stages up- or downstream of it), schedule the
stage DAG with graph-1F1B at the per-stage micro-batch counts (Table 2 handles the unequal sizes),
run the event simulator, check every stage's memory with the schedule's actual in-flight counts,
and keep a change only when the step gets shorter. The result is never slower than the uniform
plan it starts from. This differs from the paper, which enumerates (b_f, b_b) schedule
configurations inside the DP: the DP here stays with one size, and the per-stage sizes are a local
search on the exact schedule instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import networkx as nx

from ..schedules.registry import schedule
from ..schedules.schedule import Schedule
from ..schedules.simulate import SimResult, simulate

MAX_PASSES = 4   # sweeps over the stages; each accepted change shortens the simulated step


@dataclasses.dataclass(frozen=True)
class Evaluated:
    sizes: tuple[int, ...]
    forward: tuple[float, ...]
    backward: tuple[float, ...]
    memory: tuple[float, ...]
    schedule: Schedule
    sim: SimResult


def evaluate(sizes: Sequence[int], stage_costs: Callable[[int, int], tuple[float, float, float, float]],
             batch: int, edges: Sequence[tuple[int, int]], budget: float) -> Evaluated | None:
    """Schedule and simulate the stages at per-stage micro-batch `sizes`; None if a stage cannot run
    at its size or does not fit `budget`. `stage_costs(i, b)` = (forward s, backward s, static bytes,
    bytes per in-flight micro-batch) of stage i at micro-batch b."""
    costs = [stage_costs(i, b) for i, b in enumerate(sizes)]
    if any(not (c[0] < float("inf") and c[1] < float("inf")) for c in costs):
        return None
    sched = schedule("graph-1f1b", num_stages=len(sizes), num_microbatches=[batch // b for b in sizes],
                     edges=list(edges))
    fwd = tuple(c[0] for c in costs)
    bwd = tuple(c[1] for c in costs)
    sim = simulate(sched, forward=list(fwd), backward=list(bwd), transfer=0.0)
    mem = tuple(c[2] + c[3] * n for c, n in zip(costs, sim.peak_inflight, strict=True))
    if any(m > budget * (1 + 1e-9) for m in mem):
        return None
    return Evaluated(tuple(sizes), fwd, bwd, mem, sched, sim)


def refine_sizes(start: Evaluated, allowed: Sequence[Sequence[int]],
                 stage_costs: Callable[[int, int], tuple[float, float, float, float]], batch: int,
                 edges: Sequence[tuple[int, int]], budget: float) -> Evaluated:
    """Coordinate descent from `start` (module doc); `allowed[i]` are stage i's candidate sizes.
    A move halves or doubles the size of one stage, or of one stage together with every stage
    upstream (or downstream) of it that had the same size: Fig. 5's gain needs the stages before an
    efficient-only-at-large-sizes stage to shrink together (each alone changes nothing: the stage
    after still waits for the same samples)."""
    n = len(start.sizes)
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_edges_from(edges)
    groups = [[{i}, nx.ancestors(g, i) | {i}, nx.descendants(g, i) | {i}] for i in range(n)]
    best = start
    for _ in range(MAX_PASSES):
        improved = False
        for i in range(n):
            for group in groups[i]:
                for factor in (2, 0.5):
                    sizes = list(best.sizes)
                    for j in group:
                        if best.sizes[j] == best.sizes[i]:
                            sizes[j] = int(best.sizes[j] * factor)
                    if tuple(sizes) == best.sizes or any(b not in allowed[j] for j, b in enumerate(sizes)):
                        continue
                    trial = evaluate(sizes, stage_costs, batch, edges, budget)
                    if trial is not None and trial.sim.makespan < best.sim.makespan * (1 - 1e-9):
                        best, improved = trial, True
        if not improved:
            break
    return best


