"""LayerGraph: the coarse DAG that GraphPipe (and its sequential baseline) partitions (pure: no jax).

A node is a layer-sized unit of the training step (a transformer layer, an FF layer, an embedding
bag, ...) with its costs per sample on one device; an edge carries the node's output to a consumer.
A node's time for a micro-batch of b samples comes from its *curves* when given: seconds at
b = 1, 2, 4, ..., 2**(K-1) on one device, interpolated linearly between those sizes and extended
with the last segment's slope beyond them (`curve_seconds`). Small micro-batches are not free on
real hardware: every micro-batch reads each weight and writes each weight gradient once, so a
memory-bound layer (a 4096-wide FF layer at b < ~30 on a V100) costs nearly the same at b = 1 as
at b = 16 — the effect that lets a shallower graph pipeline, with larger micro-batches, beat a deep
sequential one (GraphPipe §7.5). Without curves the time is linear: b * forward seconds.
Builders from a traced OpGraph live in `_layer_graph_build.py`; synthetic graphs are built by hand.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from functools import cached_property

import numpy as np

from ...core.errors import PipelineError


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
    forward_curve: tuple[float, ...] = ()    # seconds per micro-batch of 2**i samples, i = 0, 1, ...
    backward_curve: tuple[float, ...] = ()
    ops: tuple[int, ...] = dataclasses.field(default=(), repr=False)   # traced ops (layer_graph fills it)


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
            raise PipelineError("pipeline.LayerGraph: the graph has no nodes.")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, numbers.Integral) \
                or self.batch_size < 1:
            raise PipelineError(f"pipeline.LayerGraph: batch_size={self.batch_size!r} must be an int >= 1 "
                                     "(samples per step).")
        seen = set()
        for u, v in self.edges:
            if not (0 <= u < v < n):
                raise PipelineError(
                    f"pipeline.LayerGraph: edge ({u}, {v}) is not forward in the node order of {n} "
                    "nodes; nodes must be listed in a topological order and edges go from lower to higher.")
            if (u, v) in seen:
                raise PipelineError(f"pipeline.LayerGraph: edge ({u}, {v}) is listed twice.")
            seen.add((u, v))
        for i, nd in enumerate(self.nodes):
            for f in ("forward", "backward", "param_bytes", "state_bytes", "activation_bytes",
                      "output_bytes", "update"):
                if not (0 <= getattr(nd, f) < math.inf):   # also rejects NaN
                    raise PipelineError(f"pipeline.LayerGraph: node {i} ({nd.name!r}) has {f}="
                                             f"{getattr(nd, f)!r}; costs and bytes must be finite and >= 0.")
            for f in ("forward_curve", "backward_curve"):
                c = getattr(nd, f)
                if len(c) != len(self.nodes[0].forward_curve) or len(c) != len(nd.forward_curve):
                    raise PipelineError(
                        f"pipeline.LayerGraph: node {i} ({nd.name!r}) has a {f} of {len(c)} sizes where node 0 "
                        f"has {len(self.nodes[0].forward_curve)}; give every node curves at the same sizes "
                        "(1, 2, 4, ...) or none.")
                if not all(0 <= x < math.inf for x in c) or any(b < a for a, b in zip(c, c[1:], strict=False)):
                    raise PipelineError(f"pipeline.LayerGraph: node {i} ({nd.name!r}) has a {f} that is "
                                             "negative, not finite, or decreasing in the micro-batch size.")

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
    def curve_sizes(self) -> int:
        """K: nodes carry curves at micro-batch sizes 1, 2, ..., 2**(K-1) (0: linear costs)."""
        return len(self.nodes[0].forward_curve)

    @property
    def sources(self) -> tuple[int, ...]:
        return tuple(i for i, p in enumerate(self.pred) if not p)

    @property
    def sinks(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.succ) if not s)


def chain_graph(nodes: Sequence[LayerNode], batch_size: int, name: str = "") -> LayerGraph:
    """A sequential model: node i feeds node i + 1."""
    return LayerGraph(tuple(nodes), tuple((i, i + 1) for i in range(len(nodes) - 1)), batch_size, name)


def curve_seconds(curve: np.ndarray, per_sample: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Seconds for micro-batches of b >= 1 samples, elementwise (numpy broadcasting over the
    leading dims of `curve` [..., K], `per_sample` [...] and `b`): the curve interpolated linearly
    between its sizes 1, 2, 4, ..., extended with its last segment's slope (with `per_sample` when
    K = 1) beyond 2**(K-1); b * per_sample when K = 0."""
    curve = np.asarray(curve, dtype=float)
    per_sample = np.asarray(per_sample, dtype=float)
    b = np.maximum(np.asarray(b, dtype=float), 1.0)
    K = curve.shape[-1]
    if K == 0:
        return b * per_sample
    shape = np.broadcast_shapes(curve.shape[:-1], per_sample.shape, b.shape)
    curve = np.broadcast_to(curve, shape + (K,))
    b = np.broadcast_to(b, shape)
    i = np.minimum(np.floor(np.log2(b)).astype(int), K - 1)

    def at(k: np.ndarray) -> np.ndarray:
        return np.take_along_axis(curve, k[..., None], axis=-1)[..., 0]

    if K == 1:
        slope = np.broadcast_to(per_sample, shape)
    else:
        j = np.minimum(i, K - 2)                 # the segment [2**j, 2**(j+1)]; past the end, the last
        slope = (at(j + 1) - at(j)) / np.exp2(j)
    return at(i) + (b - np.exp2(i)) * slope
