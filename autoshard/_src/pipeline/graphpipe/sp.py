"""Series-parallel decomposition of a LayerGraph for GraphPipe's partitioner (pure: no jax).

GraphPipe (§5) splits the model graph recursively into series and parallel parts and solves one
DP subproblem per part. We decompose the graph's partial order (u < v iff a path u -> v exists),
i.e. vertex series-parallel decomposition (Valdes, Tarjan & Lawler 1982), so every layer node is
a leaf exactly once and a stage is always a set of whole subtrees:

* parallel: the comparability graph of the part is disconnected; its components run concurrently;
* series: the incomparability graph is disconnected; its components ("co-components") are totally
  ordered, and every node of an earlier one precedes every node of a later one.

A part that is neither contains an "N" (a -> c, b -> c, b -> d, no a -> d) and is not
series-parallel. The paper converts such graphs into "arithmetically identical" SP ones; we do it
by serialising: the part is cut into a prefix A (a down-set of a topological order) and the rest B,
run as series(A, B). That keeps every node and every dependency and only adds order (A before B),
so stages built from the tree are still convex and their DAG acyclic. The cut chosen is the one
adding the fewest orderings (pairs a in A, b in B that were concurrent), over the prefixes of two
topological orders (node index, and longest-path level); ties go to the first found. Series nodes
that received added order carry `artificial=True`. Everything is deterministic.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property
from typing import Any, Literal

from ...core.errors import PipelineError
from .layer_graph import LayerGraph

Kind = Literal["leaf", "series", "parallel"]


@dataclasses.dataclass(frozen=True)
class SPTree:
    """A node of the SP tree: a leaf (one LayerGraph node), a series (children in execution order)
    or a parallel composition (children concurrent, ordered by their smallest node index)."""

    kind: Kind
    children: tuple[SPTree, ...] = ()
    node: int = -1              # the LayerGraph node of a leaf
    artificial: bool = False    # series made by serialising a non-SP part (adds order)

    @cached_property
    def nodes(self) -> tuple[int, ...]:
        """LayerGraph nodes under this subtree, sorted."""
        if self.kind == "leaf":
            return (self.node,)
        return tuple(sorted(n for c in self.children for n in c.nodes))

    @cached_property
    def height(self) -> int:
        """Nodes on the longest chain (the deepest pipeline any partition of it can form)."""
        if self.kind == "leaf":
            return 1
        hs = [c.height for c in self.children]
        return sum(hs) if self.kind == "series" else max(hs)

    def to_dict(self) -> dict[str, Any]:
        if self.kind == "leaf":
            return {"leaf": self.node}
        out: dict[str, Any] = {self.kind: [c.to_dict() for c in self.children]}
        if self.artificial:
            out["artificial"] = True
        return out

    def __str__(self) -> str:
        if self.kind == "leaf":
            return str(self.node)
        sep = " ; " if self.kind == "series" else " | "
        return ("S*(" if self.artificial else "S(" if self.kind == "series" else "P(") + sep.join(
            str(c) for c in self.children) + ")"


def sp_decompose(graph: LayerGraph) -> SPTree:
    """The SP tree of `graph`'s node order (see the module doc), converting non-SP parts by
    serialisation. Leaves cover every node exactly once; for every edge (u, v), u's subtree comes
    before v's in their lowest common series ancestor."""
    if not isinstance(graph, LayerGraph):
        raise PipelineError(f"sp_decompose: graph must be a pipeline.LayerGraph, got {type(graph).__name__}.")
    n = len(graph)
    desc = [0] * n  # bitmask of strict descendants
    for u in range(n - 1, -1, -1):  # nodes are in topological order (LayerGraph checks u < v)
        m = 0
        for v in graph.succ[u]:
            m |= desc[v] | (1 << v)
        desc[u] = m
    anc = [0] * n
    for v in range(n):
        m = 0
        for u in graph.pred[v]:
            m |= anc[u] | (1 << u)
        anc[v] = m
    comp = [desc[v] | anc[v] for v in range(n)]  # comparable nodes
    return _Decomposer(desc, comp).run((1 << n) - 1)


class _Decomposer:
    def __init__(self, desc: list[int], comp: list[int]) -> None:
        self.desc, self.comp = desc, comp

    def run(self, mask: int) -> SPTree:
        nodes = _bits(mask)
        if len(nodes) == 1:
            return SPTree("leaf", node=nodes[0])
        parts = self._components(nodes, mask, lambda v: self.comp[v])
        if len(parts) > 1:
            return SPTree("parallel", tuple(self.run(p) for p in parts))
        parts = self._components(nodes, mask, lambda v: ~self.comp[v] & ~(1 << v))
        if len(parts) > 1:  # co-components; ordered by smallest node (an earlier one's min is smaller)
            return _series([self.run(p) for p in parts], artificial=False)
        return _series([self.run(half) for half in self._cut(nodes, mask)], artificial=True)

    @staticmethod
    def _components(nodes: list[int], mask: int, nbrs) -> list[int]:
        """Connected components (as bitmasks, sorted by smallest node) of the graph on `nodes`
        whose neighbourhoods are `nbrs(v) & mask`."""
        left, out = mask, []
        for v in nodes:
            if not left >> v & 1:
                continue
            seen = frontier = 1 << v
            while frontier:
                nxt = 0
                for u in _bits(frontier):
                    nxt |= nbrs(u) & mask
                frontier = nxt & ~seen
                seen |= frontier
            out.append(seen)
            left &= ~seen
        return out

    def _cut(self, nodes: list[int], mask: int) -> tuple[int, int]:
        level: dict[int, int] = {}
        for v in nodes:  # longest path from the part's sources (nodes are topologically sorted)
            level[v] = max((level[u] + 1 for u in _bits(self.comp[v] & mask) if u < v), default=0)
        best: tuple[int, int, int] | None = None  # (added pairs, prefix mask, rest)
        for order in (nodes, sorted(nodes, key=lambda v: (level[v], v))):
            prefix = 0
            for v in order[:-1]:
                prefix |= 1 << v
                rest = mask & ~prefix
                added = sum((rest & ~self.desc[u]).bit_count() for u in _bits(prefix))
                if best is None or added < best[0]:
                    best = (added, prefix, rest)
        assert best is not None  # a part that is neither series nor parallel has >= 4 nodes
        return best[1], best[2]


def _series(parts: list[SPTree], artificial: bool) -> SPTree:
    """A series node; serialised (artificial) series parts are flattened into it, so stages may
    span the added boundaries like any other series boundary."""
    children: list[SPTree] = []
    for t in parts:
        if t.kind == "series":
            children.extend(t.children)
            artificial = True
        else:
            children.append(t)
    return SPTree("series", tuple(children), artificial=artificial)


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
