"""RaNNC as a registered partitioner: atomic components -> k blocks -> stage DP (pure: no jax import)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...core.grouping import group
from ...core.mesh import MeshSpec
from ..atomic import atomic_partition
from ..costs import PipelineCosts
from ..partition import Baseline, PartitionedStage, PartitionProblem, StagePartition, max_over_mean
from ..schedules.registry import schedule
from .stages import SEARCHES, plan_stages
from .uniform import best_uniform, layer_starts, uniform_stage_counts


class RanncPartitioner:
    """RaNNC (§III): stages, replicas per stage and micro-batch count over all the mesh's devices;
    a "pipe" mesh axis fixes the stage count. Options: k (blocks, default 32), recompute,
    use_blocks, search ("all" | "node" | "stage"), prune."""

    name = "rannc"
    schedules = ("1f1b", "gpipe")
    options = frozenset({"k", "recompute", "use_blocks", "search", "prune"})

    def unsupported(self, mesh: MeshSpec, options: Mapping[str, Any]) -> str | None:
        if options.get("search", "all") not in SEARCHES:
            return (f"pipeline_options search={options['search']!r} is unknown; valid: 'all' (every node and stage "
                    "count, default), 'node', 'stage' (the paper's first feasible count)")
        return None

    def partition(self, problem: PartitionProblem) -> StagePartition:
        graph, hw, options = problem.graph, problem.hardware, problem.options
        atomic = atomic_partition(graph)
        warnings: list[str] = []
        op_time = None
        if problem.profiler is not None:
            model_costs = PipelineCosts(atomic, hw)
            reps = [op.repeat for op in graph.ops]
            op_time, warnings = problem.profiler.op_times(graph, lambda i: model_costs.op_time[i] / reps[i])
        costs = PipelineCosts(atomic, hw, op_time=op_time)
        kw = {k: options[k] for k in ("recompute",) if k in options}
        use_blocks = bool(options.get("use_blocks", True))
        sp = plan_stages(graph, problem.devices, hw, k=int(options.get("k", 32)), schedule=problem.schedule,
                         memory_budget=problem.memory_budget, use_blocks=use_blocks,
                         search=str(options.get("search", "all")), prune=bool(options.get("prune", False)),
                         costs=costs, stage_counts=problem.stage_counts,
                         microbatch_counts=None if problem.num_microbatches is None else [problem.num_microbatches],
                         **kw)
        grouping = group(graph)
        uniform = best_uniform(costs, problem.devices, grouping=grouping, schedule=problem.schedule,
                               memory_budget=sp.memory_budget, stage_counts=problem.stage_counts, **kw)
        stages = tuple(PartitionedStage(
            units=tuple(range(*s.blocks)), ops=s.ops, replicas=s.replicas, microbatch_size=s.microbatch_size,
            forward=s.predicted_forward, backward=s.predicted_backward, memory=s.memory,
            microbatches=sp.microbatches, after=(s.index - 1,) if s.index else ()) for s in sp.stages)
        baseline = None
        if uniform is not None:
            baseline = Baseline(
                name="uniform layer split", stages=len(uniform.stages), depth=len(uniform.stages),
                microbatches=uniform.microbatches, step_time=uniform.step_time,
                max_over_mean=max_over_mean(list(uniform.predicted_forward), list(uniform.predicted_backward)),
                hint="the partitioner searches blocks, not layer boundaries; try more blocks, "
                     "pipeline_options={'k': ...}")
        return StagePartition(
            method=sp.method, stages=stages,
            schedule=schedule(problem.schedule, num_stages=len(sp.stages), num_microbatches=sp.microbatches),
            step_time=sp.step_time, memory_budget=sp.memory_budget, batch_size=sp.batch_size,
            pipelines=sp.pipelines, search_seconds=sp.search_seconds, units=int(sp.stages[-1].blocks[1]),
            unit="blocks" if use_blocks else "atomic components", warnings=tuple(warnings),
            info={"objective": sp.objective, "dp_calls": sp.dp_calls}, baseline=baseline,
            baseline_name="uniform layer split",
            baseline_reason="" if baseline is not None else _no_uniform(costs, grouping, problem, sp.memory_budget))


def _no_uniform(costs, grouping, problem, budget: float) -> str:
    """Why no uniform layer split applies, with the numbers it was tried on."""
    counts = problem.stage_counts or uniform_stage_counts(problem.devices)
    layers = len(layer_starts(costs, grouping))
    fitting = [s for s in counts if s <= layers]
    if not fitting:
        return f"{layers} repeated layer(s) cannot fill {min(counts) if counts else 2} or more stages"
    return (f"no uniform split of the {layers} repeated layers into {fitting} stages fits the memory budget of "
            f"{budget / 2**30:.3g} GiB per device")


RANNC = RanncPartitioner()
