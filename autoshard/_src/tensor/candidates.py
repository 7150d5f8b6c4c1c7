"""The tensor search's plan space (pure: no jax import): which factors it may split, ranked by the bytes
of the parameters and inputs they split, the plan space cap and its warnings, and every assignment of
axis masks to them (search.plan_space builds a PlanSpace from these)."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from ..core.graph import OpGraph
from ..core.mesh import MeshSpec
from ..core.quantities import fmt_bytes
from .evaluator import SearchOptions, _axis_masks, _mask_size
from .factors import FactorGraph


def _candidate_factors(graph: OpGraph, fg: FactorGraph, weights: dict[int, float], mesh: MeshSpec,
                       options: SearchOptions, notes: list[str]
                       ) -> tuple[tuple[int, ...], dict[int, list[int]]]:
    """The factors the search may split (sorted) and, per factor, the axis masks that divide it.
    Factors beyond the plan space cap are left out, with a note."""
    cands = _ranked_factors(graph, fg, weights)
    masks_of = {f: [m for m in _axis_masks(mesh) if fg.divides(f, _mask_size(mesh, m))]
                for f in cands}
    kept: list[int] = []
    total = 1
    carried: dict[int, float] | None = None
    for f in cands:
        if total * len(masks_of[f]) > options.max_plans:
            carried = carried if carried is not None else _carried_bytes(graph, fg, weights)
            if carried.get(f, 0.0) >= NEGLIGIBLE_SHARE * carried[-1]:   # else: nothing to lose, no warning
                notes.append(_cap_note(graph, fg, f, [_mask_size(mesh, m) for m in masks_of[f]],
                                       options.max_plans, total * len(masks_of[f])))
            continue
        kept.append(f)
        total *= len(masks_of[f])
    return tuple(sorted(kept)), masks_of


# a factor over the plan space cap whose values, all together, hold under this share of the bytes the
# search prices is left whole without a warning: splitting it could move the step's bytes (and with them
# its memory and the flops of the ops reading them) by less (T5's 32-bucket relative-position table, 1 KiB)
NEGLIGIBLE_SHARE = 1e-3


def _carried_bytes(graph: OpGraph, fg: FactorGraph, weights: dict[int, float]) -> dict[int, float]:
    """Bytes of the priced ops' values (each once, times the executions it stands for) carrying each
    factor, and under key -1 those of all of them (once per factor graph and weights, as the ranking)."""
    hit = fg.builds.get(("carried bytes", id(weights)))
    if hit is not None and hit[0] is weights:
        return hit[1]
    out: dict[int, float] = defaultdict(float)
    seen: set[int] = set()
    for i, w in weights.items():
        if w <= 0:
            continue
        op = graph.ops[i]
        for v in (*op.inputs, *op.outputs):
            if v in seen:
                continue
            seen.add(v)
            b = graph.values[v].nbytes * w
            out[-1] += b
            for f in set(fg.value_factors(v)) - {None}:
                out[f] += b
    fg.builds[("carried bytes", id(weights))] = (weights, out)
    return out


def _cap_note(graph: OpGraph, fg: FactorGraph, f: int, splits: list[int], cap: int, needed: int) -> str:
    """Why factor `f` stays whole (the plan space cap `cap`): the largest parameter or data input it splits, its size,
    the per-device bytes of the inputs carrying it that its largest split would divide away, and the option
    that lets the search split it (`needed` plans with it and the factors ranked before it)."""
    where, carried, largest = "", 0, -1
    for v in graph.inputs:
        val = graph.values[v]
        fs = fg.value_factors(v) if val.role in ("parameter", "data") else ()
        if f in fs:
            carried += val.nbytes
            if val.nbytes > largest:            # named by the largest tensor carrying it (a kernel, not its bias)
                where, largest = f"{val.keypath} dim {fs.index(f)}", val.nbytes
    if not where:                               # an activation's dim: named by the first op producing it
        where = next((f"{op.module or '(root)'}/{op.primitive} result dim {fs.index(f)}" for op in graph.ops
                      for v in op.outputs if f in (fs := fg.value_factors(v))), "")
    n = max(splits)
    cost = (f"; whole, it keeps up to {fmt_bytes(carried * (1 - 1 / n))} per device of the "
            f"{fmt_bytes(carried)} of parameters and inputs carrying it that splitting it {n} ways would free"
            if carried and n > 1 else "")
    return (f"{where or f'factor {f}'} (a logical dim of size {fg.factor_size(f)}) left unsplit: splitting it too "
            f"would make {needed:,} plans, beyond the plan space cap of {cap:,}{cost}. Fix: raise the cap, "
            f"search={{\"max_plans\": {needed}}} (autoshard.plan / @autoshard.autoshard, or [search] max_plans "
            "in a config file).")


def _ranked_factors(graph: OpGraph, fg: FactorGraph, weights: dict[int, float]) -> tuple[int, ...]:
    """The factors worth splitting, largest first: mesh-independent, so once per factor graph and weights
    (the 3-D search asks for every submesh shape)."""
    hit = fg.builds.get(("ranked factors", id(weights)))
    if hit is not None and hit[0] is weights:
        return hit[1]
    # factors worth splitting: those of parameters and data inputs, largest first, that some op
    # iterates over, except a stacked scan's layer axis: the loop slices it, and splitting it
    # would cost a gather per iteration that the op model does not see
    sliced: set[int] = set()
    for i in weights:
        op = graph.ops[i]
        if op.loops:
            for v, shape in zip(op.inputs, op.in_shapes, strict=True):
                full = graph.values[v].shape
                if len(shape) < len(full):  # a scan slices this value along its leading dims
                    sliced.update(f for f in fg.value_factors(v)[:len(full) - len(shape)] if f is not None)
    in_loops = {f for i, w in weights.items() if w > 0 for f in fg.op_factors[i].loop} - sliced
    weight_of: dict[int, float] = defaultdict(float)
    for v in fg.factored_inputs():
        val = graph.values[v]
        if val.role in ("parameter", "data"):
            for f in fg.value_factors(v):
                if f is not None and f not in fg.repeated and f in in_loops:
                    weight_of[f] += val.nbytes
    for v, before, after in fg.cuts:      # a region's own factors (the expert side of an MoE layer)
        for f in (*before, *after):
            if f is not None and f not in fg.repeated and f in in_loops:
                weight_of[f] += graph.values[v].nbytes
    cands = tuple(sorted(weight_of, key=lambda f: (-weight_of[f], f)))
    fg.builds[("ranked factors", id(weights))] = (weights, cands)
    return cands


def _enumerate_plans(fg: FactorGraph, cands_t: tuple[int, ...], masks_of: dict[int, list[int]]) -> np.ndarray:
    """Every assignment of axis masks to the candidate factors, plans[C, K], in canonical order
    (itertools.product's: the last factor fastest). Built a factor at a time, each step dropping the
    rows where two factors that share a tensor share an axis, so the array never holds the pruned
    product (with no candidate factors, a step with nothing to split, there is one plan: ())."""
    plans = np.zeros((1, 0), dtype=np.int64)
    for k, f in enumerate(cands_t):
        masks = np.asarray(masks_of[f], dtype=np.int64)
        rows = plans.shape[0]
        plans = np.concatenate([np.repeat(plans, len(masks), axis=0), np.tile(masks, rows)[:, None]], axis=1)
        ok = np.ones(plans.shape[0], dtype=bool)
        for a in range(k):
            if f in fg.cooccur.get(cands_t[a], ()):
                ok &= (plans[:, a] & plans[:, k]) == 0
        plans = plans[ok]
    return plans
