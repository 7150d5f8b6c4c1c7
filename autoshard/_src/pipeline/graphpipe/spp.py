"""SPP baseline for GraphPipe: the same search on a linearised chain (pure: no jax import).

Sequential pipeline parallelism (PipeDream, Piper) orders the nodes topologically (here: the
LayerGraph's own order) and cuts the sequence into contiguous stages, each with its devices (data
parallel inside) and one micro-batch size for all, minimising the bottleneck time per sample under
memory, with 1F1B (stage s of S holds S - s micro-batches). That is `_graphpipe`'s DP on a series
of single nodes, with the same costs, memory model, micro-batch choice and simulator, so the two
methods are compared on identical terms; the stage DAG is the chain of the stages. On a chain graph
GraphPipe's SP tree is this very series, and both give the same plan (paper A.3).
"""

from __future__ import annotations

import time
from typing import Any

from .layer_graph import LayerGraph
from .partition import GraphPipePlan, _check_args, _partition
from .sp import SPTree


def linear_tree(graph: LayerGraph) -> SPTree:
    """The SP tree of SPP: every node in topological (index) order, in series."""
    leaves = tuple(SPTree("leaf", node=v) for v in range(len(graph)))
    return leaves[0] if len(leaves) == 1 else SPTree("series", leaves)


def spp_partition(graph: LayerGraph, devices: int, hardware: Any, *,
                  memory_budget: float | None = None, max_microbatch_size: int | None = None,
                  per_stage_microbatch: bool = False) -> GraphPipePlan:
    """The best sequential pipeline of `graph` on `devices` devices (method "spp"); arguments and
    errors as `graphpipe_partition`."""
    _check_args("spp_partition", graph, devices, memory_budget, max_microbatch_size, per_stage_microbatch)
    t0 = time.perf_counter()
    return _partition(graph, linear_tree(graph), devices, hardware, memory_budget, max_microbatch_size,
                      method="spp", t0=t0, per_stage=per_stage_microbatch)
