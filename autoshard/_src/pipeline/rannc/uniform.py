"""Uniform pipeline split baseline (GPipe-Hybrid / PipeDream-2BW style, RaNNC §IV) (pure: no jax).

Equal numbers of repeated layers per stage and the same number of replicas for every stage, costed
with the same stage model as RaNNC's DP so the two are comparable. Layers are the instances of the
Grouping's most repeated block type (transformer layers); a stage boundary is placed at the first
atomic component of the layer that starts the next stage, so every stage is a contiguous range of
the components' topological order (hence convex), with the embedding in the first stage and the
head and loss in the last. Without a usable Grouping the RaNNC blocks are split in equal counts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from ...core.errors import PipelineError
from ...core.grouping import Grouping
from ..costs import PipelineCosts
from .blocks import BlockPartition
from .stages import StagePlan, StageProblem


def layer_starts(costs: PipelineCosts, grouping: Grouping) -> list[int]:
    """First atomic component of each instance of the most repeated block type (sorted); [] when no
    block type has instances with forward tasks."""
    atomic = costs.atomic
    best: list[int] = []
    for bt in grouping.block_types:
        starts = []
        for inst in bt.instances:
            comps = [atomic.component_of[o] for o in inst.ops
                     if o in atomic.component_of and atomic.tasks[atomic.component_of[o]] == o]
            if comps:
                starts.append(min(comps))
        starts = sorted(set(starts))
        if len(starts) > len(best):
            best = starts
    return best


def uniform_units(costs: PipelineCosts, num_stages: int, *, grouping: Grouping | None = None,
                  blocks: BlockPartition | None = None) -> list[tuple[int, ...]]:
    """Components of each of `num_stages` uniform stages, in topological order."""
    n = len(costs.atomic)
    starts = layer_starts(costs, grouping) if grouping is not None else []
    if len(starts) >= num_stages:
        L = len(starts)
        cuts = [0] + [starts[(j * L) // num_stages] for j in range(1, num_stages)] + [n]
        units = [tuple(range(cuts[j], cuts[j + 1])) for j in range(num_stages)]
    elif blocks is not None and len(blocks) >= num_stages:
        K = len(blocks)
        units = [tuple(sorted(c for b in blocks.blocks[(j * K) // num_stages:((j + 1) * K) // num_stages] for c in b))
                 for j in range(num_stages)]
    else:
        raise PipelineError(f"pipeline.uniform: {num_stages} stages need at least as many layers (found "
                         f"{len(starts)}) or blocks ({len(blocks) if blocks is not None else 'none given'}).")
    if any(not u for u in units):
        raise PipelineError(f"pipeline.uniform: {num_stages} stages leave an empty stage (layer starts {starts}).")
    return units


def uniform_split(costs: PipelineCosts, num_stages: int, devices: int, microbatches: int, *,
                  grouping: Grouping | None = None, blocks: BlockPartition | None = None,
                  batch_size: int | None = None, schedule: str = "1f1b", recompute: bool = False,
                  memory_budget: float | None = None) -> StagePlan:
    """The uniform split into `num_stages` stages with devices // num_stages replicas each."""
    if devices % num_stages:
        raise PipelineError(f"pipeline.uniform: devices={devices} must be a multiple of num_stages={num_stages} "
                         "(every stage gets the same number of replicas).")
    t0 = time.perf_counter()
    units = uniform_units(costs, num_stages, grouping=grouping, blocks=blocks)
    problem = StageProblem(costs, units, batch_size=batch_size, schedule=schedule, recompute=recompute,
                           memory_budget=memory_budget)
    r = devices // num_stages
    if problem.mbs(1, microbatches, r) < 1:
        raise PipelineError(f"pipeline.uniform: batch {problem.batch_size} split into {microbatches} micro-batches "
                         f"over {r} replicas per stage leaves an empty micro-batch; use fewer micro-batches.")
    splits = [(s, s + 1, r) for s in range(num_stages)]
    plan = problem.plan(splits, D=devices, R=1, MB=microbatches, method="uniform")
    return _with_seconds(plan, time.perf_counter() - t0)


def uniform_stage_counts(devices: int) -> list[int]:
    """The stage counts a uniform split tries: powers of two >= 2 dividing `devices` (RaNNC §IV-B)."""
    return [s for s in (2 ** i for i in range(1, 12)) if s <= devices and devices % s == 0]


def best_uniform(costs: PipelineCosts, devices: int, *, grouping: Grouping | None = None,
                 blocks: BlockPartition | None = None, stage_counts: Sequence[int] | None = None,
                 batch_size: int | None = None, schedule: str = "1f1b", recompute: bool = False,
                 memory_budget: float | None = None) -> StagePlan | None:
    """The best uniform split over stage counts dividing `devices` (default: powers of two >= 2,
    as the baselines of RaNNC §IV-B) and micro-batch counts 1, 2, 4, ... that fits memory."""
    t0 = time.perf_counter()
    bs = int(batch_size or costs.batch)
    counts = stage_counts or uniform_stage_counts(devices)
    best = None
    for S in counts:
        try:
            units = uniform_units(costs, S, grouping=grouping, blocks=blocks)
        except PipelineError:
            continue
        problem = StageProblem(costs, units, batch_size=bs, schedule=schedule, recompute=recompute,
                               memory_budget=memory_budget)
        r = devices // S
        MB = 1
        while bs // MB // r >= 1:
            plan = problem.plan([(s, s + 1, r) for s in range(S)], D=devices, R=1, MB=MB, method="uniform")
            if max(plan.memory) <= problem.budget and (best is None or plan.step_time < best.step_time):
                best = plan
            MB *= 2
    return None if best is None else _with_seconds(best, time.perf_counter() - t0)


def _with_seconds(plan: StagePlan, seconds: float) -> StagePlan:
    return dataclasses.replace(plan, search_seconds=seconds)
