"""LayerGraph: the coarse DAG that GraphPipe (and its sequential baseline) partitions (pure: no jax).

A node is a layer-sized unit of the training step (a transformer layer, an FF layer, an embedding
bag, ...) with its costs per sample on one device; an edge carries the node's output to a consumer.
Costs are linear in the micro-batch size (a micro-batch of b samples takes b * forward seconds),
which is how GraphPipe's cost model is used in the paper's search (§5, profiled per sample).
Builders from a traced OpGraph live in `_layer_graph_build.py`; synthetic graphs are built by hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from functools import cached_property

from ._atomic import PipelineGraphError


@dataclasses.dataclass(frozen=True)
class LayerNode:
    name: str
    forward: float           # seconds per sample, forward
    backward: float          # seconds per sample, backward (input and weight gradients)
    param_bytes: float       # parameters (gradients take as much again)
    state_bytes: float       # optimizer state
    activation_bytes: float  # bytes saved for backward, per sample
    output_bytes: float      # bytes of the output sent to each consumer, per sample
    update: float = 0.0      # optimizer seconds per step (not per sample)
    branch: str = ""         # the model's branch label, if any (reports only)


@dataclasses.dataclass(frozen=True)
class LayerGraph:
    """Nodes in a topological order; `edges` (u, v) with u < v. Sources read the batch, sinks
    produce the loss (their outputs are summed)."""

    nodes: tuple[LayerNode, ...]
    edges: tuple[tuple[int, int], ...]
    batch_size: int            # the mini-batch the step trains on (samples per step)
    name: str = ""

    def __post_init__(self) -> None:
        n = len(self.nodes)
        if n == 0:
            raise PipelineGraphError("pipeline.LayerGraph: the graph has no nodes.")
        if self.batch_size < 1:
            raise PipelineGraphError(f"pipeline.LayerGraph: batch_size={self.batch_size} must be >= 1.")
        seen = set()
        for u, v in self.edges:
            if not (0 <= u < v < n):
                raise PipelineGraphError(
                    f"pipeline.LayerGraph: edge ({u}, {v}) is not forward in the node order of {n} "
                    "nodes; nodes must be listed in a topological order and edges go from lower to higher.")
            if (u, v) in seen:
                raise PipelineGraphError(f"pipeline.LayerGraph: edge ({u}, {v}) is listed twice.")
            seen.add((u, v))
        for i, nd in enumerate(self.nodes):
            for f in ("forward", "backward", "param_bytes", "state_bytes", "activation_bytes",
                      "output_bytes", "update"):
                if getattr(nd, f) < 0:
                    raise PipelineGraphError(f"pipeline.LayerGraph: node {i} ({nd.name!r}) has {f} < 0.")

    def __len__(self) -> int:
        return len(self.nodes)

    @cached_property
    def succ(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in self.nodes]
        for u, v in self.edges:
            out[u].append(v)
        return tuple(tuple(sorted(s)) for s in out)

    @cached_property
    def pred(self) -> tuple[tuple[int, ...], ...]:
        out: list[list[int]] = [[] for _ in self.nodes]
        for u, v in self.edges:
            out[v].append(u)
        return tuple(tuple(sorted(p)) for p in out)

    @property
    def sources(self) -> tuple[int, ...]:
        return tuple(i for i, p in enumerate(self.pred) if not p)

    @property
    def sinks(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.succ) if not s)


def chain_graph(nodes: Sequence[LayerNode], batch_size: int, name: str = "") -> LayerGraph:
    """A sequential model: node i feeds node i + 1."""
    return LayerGraph(tuple(nodes), tuple((i, i + 1) for i in range(len(nodes) - 1)), batch_size, name)
