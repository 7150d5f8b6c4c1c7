"""GraphPipe as a registered partitioner: layer nodes -> SP decomposition -> DAG of stages (pure)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ...core.errors import InfeasiblePlanError
from ...core.mesh import MeshSpec
from ..partition import Baseline, PartitionedStage, PartitionProblem, StagePartition, max_over_mean
from ..rannc.blocks import DEFAULT_MEMORY_FRACTION
from .layer_graph_build import layer_graph
from .partition import graphpipe_partition
from .spp import spp_partition


class GraphPipePartitioner:
    """GraphPipe (§5): a DAG of stages over the model's branches, each with its devices and
    micro-batch size, scheduled by graph-1F1B. It chooses each stage's devices itself, so the mesh
    must not fix a stage count. Options: max_microbatch_size, depth, per_stage_microbatch."""

    name = "graphpipe"
    schedules = ("1f1b", "graph-1f1b")
    options = frozenset({"max_microbatch_size", "depth", "per_stage_microbatch"})

    def unsupported(self, mesh: MeshSpec, options: Mapping[str, Any]) -> str | None:
        if "pipe" in mesh.names:
            return (f"mesh {mesh} has a 'pipe' axis, but GraphPipe chooses the stage DAG and each stage's devices "
                    f"itself; pass the devices as one axis (e.g. {{'data': {math.prod(mesh.sizes)}}}), or "
                    "pipeline='rannc' to fix the stage count")
        return None

    def partition(self, problem: PartitionProblem) -> StagePartition:
        graph, hw, options, devices = problem.graph, problem.hardware, problem.options, problem.devices
        measured: list[str] = []
        kw_lg: dict[str, Any] = {}
        if problem.profiler is not None:
            # GraphPipe picks micro-batch sizes from each layer's time at every size, so every op is
            # timed at each size (the step traced again with its data inputs cut to that many samples)
            op_time, op_curves, measured = problem.profiler.layer_costs(graph, hw)
            kw_lg = {"op_time": op_time, "op_curves": op_curves}
        lg = layer_graph(graph, hw, depth=options.get("depth"), **kw_lg)
        kw = {"memory_budget": problem.memory_budget, "max_microbatch_size": options.get("max_microbatch_size"),
              "per_stage_microbatch": options.get("per_stage_microbatch", False)}
        gp = graphpipe_partition(lg, devices, hw, **kw)
        try:
            spp, spp_error = spp_partition(lg, devices, hw, **kw), ""
        except InfeasiblePlanError as e:      # its own words: no sequential split fits the budget
            spp, spp_error = None, str(e)
        after = {s.index: tuple(sorted(u for u, v in gp.edges if v == s.index)) for s in gp.stages}
        stages = tuple(PartitionedStage(
            units=tuple(sorted(s.nodes)), ops=tuple(sorted({o for n in s.nodes for o in lg.nodes[n].ops})),
            replicas=s.devices, microbatch_size=-(-s.microbatch_size // s.devices), forward=s.forward,
            backward=s.backward, memory=s.memory, microbatches=s.num_microbatches, after=after[s.index])
            for s in gp.stages)
        used = sum(s.devices for s in gp.stages)
        warnings = list(measured) if used == devices else [*measured,
            f"graphpipe uses {used} of the {devices} devices: every micro-batch size is a power of two dividing "
            f"the batch of {gp.batch_size}, and a stage gets at most one device per sample of its micro-batch; "
            "a larger batch (or fewer devices) uses them all"]
        baseline = None
        if spp is not None:
            baseline = Baseline(
                name="sequential pipeline (SPP)", stages=len(spp.stages), depth=spp.depth,
                microbatches=max(s.num_microbatches for s in spp.stages), step_time=spp.step_time,
                max_over_mean=max_over_mean([s.forward for s in spp.stages], [s.backward for s in spp.stages]),
                hint="GraphPipe keeps stages to whole series-parallel parts of the graph")
        return StagePartition(
            method=gp.method, stages=stages, schedule=gp.schedule, step_time=gp.step_time,
            memory_budget=_budget(problem), batch_size=gp.batch_size, pipelines=1,
            search_seconds=gp.search_seconds, units=len(lg), unit="layer nodes", warnings=tuple(warnings),
            info={"time_per_sample": gp.time_per_sample, "edges": tuple(gp.edges)}, baseline=baseline,
            baseline_name="sequential pipeline (SPP)", baseline_reason=spp_error)


def _budget(problem: PartitionProblem) -> float:
    if problem.memory_budget is not None:
        return float(problem.memory_budget)
    return DEFAULT_MEMORY_FRACTION * problem.hardware.memory_bytes


GRAPHPIPE = GraphPipePartitioner()
