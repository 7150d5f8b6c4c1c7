"""Which instance of a block type stands for which (pure: no jax import).

The planner analyses representative instances only; instance k of a type repeating with period p
takes the factors of instance k mod p. These maps carry that over to every op and every input.
"""

from __future__ import annotations

from ..core.graph import PHASES, OpGraph
from ..core.grouping import Grouping
from .factors import corresponding_ops


def instance_maps(graph: OpGraph, grouping: Grouping, periods: tuple[int, ...],
                  phases: tuple[str, ...] = PHASES) -> dict[int, int]:
    """Op index → the corresponding op of its representative instance (instance k of a type
    with period p takes the factors of instance k mod p), for the ops of `phases`. Computed once per
    grouping: do not modify."""
    if graph is not grouping.graph:
        return _instance_maps(graph, grouping, periods, phases)
    return grouping.memo(("instance_maps", tuple(periods), phases),
                         lambda: _instance_maps(graph, grouping, periods, phases))


def _instance_maps(graph: OpGraph, grouping: Grouping, periods: tuple[int, ...],
                   phases: tuple[str, ...]) -> dict[int, int]:
    out: dict[int, int] = {}
    for bt, period in zip(grouping.block_types, periods, strict=True):
        rep_sigs: list[dict] = [{} for _ in range(period)]    # each representative's signature, once
        for k, inst in enumerate(bt.instances):
            rep = bt.instances[k % period]
            if k < period or inst.ops == rep.ops:
                continue
            for a, b in corresponding_ops(graph, rep.ops, inst.ops, phases, rep_sigs[k % period]):
                out[b] = a
    return out


def input_maps(graph: OpGraph, grouping: Grouping, periods: tuple[int, ...]) -> dict[int, int]:
    """Input value → the corresponding input of its block type's first instance, matched by role,
    shape, dtype and keypath with the instance's own path components removed. Computed once per
    grouping: do not modify."""
    if graph is not grouping.graph:
        return _input_maps(graph, grouping, periods)
    return grouping.memo(("input_maps", tuple(periods)), lambda: _input_maps(graph, grouping, periods))


def _input_maps(graph: OpGraph, grouping: Grouping, periods: tuple[int, ...]) -> dict[int, int]:
    def strip(parts: tuple, path: str) -> tuple:
        # remove the instance's own path components ("block_3", or "blocks", "3" in nnx); the
        # keypath may lack leading scope names (linen's "GPT"), so try the path's suffixes
        comps = path.split("/")
        out = [str(p).lstrip(".") for p in parts[1:]]
        present = set(out)
        for start in range(len(comps)):
            tail = comps[start:]
            if tail[0] not in present:
                continue
            for k in range(len(out) - len(tail) + 1):
                if out[k:k + len(tail)] == tail:
                    return (parts[0], *out[:k], *out[k + len(tail):])
        return (parts[0], *out)

    # inputs by the instance whose subtree holds their module (one pass: O(inputs × depth))
    paths = {inst.path for bt in grouping.block_types for inst in bt.instances}
    under: dict[str, list[int]] = {}
    for v in graph.inputs:
        comps = graph.values[v].module.split("/")
        for d in range(len(comps), 0, -1):
            prefix = "/".join(comps[:d])
            if prefix in paths:
                under.setdefault(prefix, []).append(v)
                break

    def inputs_under(path: str) -> list[int]:
        return under.get(path, [])

    def key(v: int, path: str) -> tuple:
        val = graph.values[v]
        return (val.role, val.shape, val.dtype, strip(val.keypath_parts, path))

    out: dict[int, int] = {}
    for bt, period in zip(grouping.block_types, periods, strict=True):
        reps = [{key(v, inst.path): v for v in inputs_under(inst.path)}
                for inst in bt.instances[:period]]
        for k, inst in enumerate(bt.instances):
            if k < period:
                continue
            rep = reps[k % period]
            for v in inputs_under(inst.path):
                hit = rep.get(key(v, inst.path))
                if hit is not None:
                    out[v] = hit
    return out
