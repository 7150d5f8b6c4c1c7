"""Costs of pipeline units (atomic components, blocks, stages) on a HardwareSpec (pure: no jax import).

Per-op time is the roofline of `autoshard._cost.AnalyticalCostModel.compute` (or any `CostModel`)
on the op's flops and bytes times its repeat count, at the batch the step was traced with. Ops are
sorted into categories that scale differently with the micro-batch size:

=============  ==========================================================  ======================
category       what                                                        per stage, per device
=============  ==========================================================  ======================
fwd            non-constant forward tasks                                  × micro-batch fraction
fwd_const      constant forward ops (clones counted once per stage)        per micro-batch
bwd            backward ops that depend on the data                        × micro-batch fraction
bwd_const      backward ops that do not (transposes of weights)            per micro-batch
step           optimizer and other ops                                     once per step
params         bytes of parameters the stage's ops read                    held once; + gradients
state          bytes of optimizer state the stage's ops read               held once
act            saved activations (forward values read by backward ops)     × fraction × in flight
act_const      saved constants (weights read by backward ops)              held once
data           data inputs the stage's forward ops read                    × fraction × in flight
=============  ==========================================================  ======================

The micro-batch fraction is `microbatch_size / traced_batch`: flops and bytes of batch-dependent ops
are taken as linear in the batch, so their roofline time is too (max(a·s, b·s) = s·max(a, b)). An
item (an op or a value) held by several units counts once in any union of them: a parameter read
by two blocks, or a constant op cloned into two components, is one parameter or one op in a stage
holding both. Range tables give every contiguous union of topologically sorted units at once.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from ..core.attention import priced_fusion
from ..core.cost import AnalyticalCostModel, CostModel, alpha_beta
from ..core.errors import PipelineError
from ..core.graph import traced_batch  # noqa: F401  (imported from here by the pipeline planners)
from ..core.hardware import HardwareSpec, get_hardware
from ..core.kernels import compute_dtype, op_seconds
from ..core.liveness import live_ops
from .atomic import AtomicPartition, non_constant_ops

CATEGORIES = ("fwd", "fwd_const", "bwd", "bwd_const", "step", "params", "state", "act", "act_const", "data")


def leading_dim(shape) -> int | None:
    """A shape's first dim larger than 1 (a [1, batch, ...] broadcast leads with the batch too)."""
    return next((d for d in shape if d > 1), None)


def leads_with_batch(graph, batch: int) -> np.ndarray:
    """Per op: does a result lead with the traced batch (a mask or iota broadcast over it)?"""
    return np.array([batch > 1 and any(leading_dim(s) == batch for s in op.out_shapes) for op in graph.ops],
                    dtype=bool)


@dataclasses.dataclass(frozen=True)
class RangeTables:
    """Per category, `table[c][i, j]` = the union total over units i..j-1 (0 <= i < j <= n);
    `cut[j]` = bytes of values crossing the boundary before unit j (produced in a unit < j and
    consumed in one >= j, each value once; cut[0] = cut[n] = 0)."""

    n: int
    table: dict[str, np.ndarray]
    cut: np.ndarray


class PipelineCosts:
    """Item weights per atomic component, aggregated over any grouping of components into units."""

    def __init__(self, atomic: AtomicPartition, hardware: Any, *,
                 cost_model: CostModel | None = None, batch: int | None = None,
                 op_time: Sequence[float] | None = None, attention: str = "as_traced") -> None:
        self.atomic = atomic
        graph = atomic.graph
        self.hardware: HardwareSpec = get_hardware(hardware)
        self.custom_cost_model = cost_model          # None: the analytical model of `hardware`
        self.cost_model = cost_model or AnalyticalCostModel({"stage": 1}, self.hardware)
        self.batch = int(batch or traced_batch(graph))
        ops, values = graph.ops, graph.values
        self.op_time = op_times(graph, self.hardware, cost_model, self.cost_model, attention, op_time)
        live = live_ops(graph)
        fz = priced_fusion(graph, self.hardware.kernels is not None, attention)     # cached on the graph
        dep = non_constant_ops(graph)
        # no data flows into a causal mask broadcast to [batch, heads, q, k], yet it is built per
        # micro-batch at the micro-batch's size: it scales like the data-dependent ops
        dep |= leads_with_batch(graph, self.batch)
        n = len(atomic)
        # items: category -> {key: (weight, components)}
        items: dict[str, dict[Any, tuple[float, tuple[int, ...]]]] = {c: {} for c in CATEGORIES}
        for c, t in enumerate(atomic.tasks):
            items["fwd"][t] = (float(self.op_time[t]), (c,))
        for consts in atomic.constants:
            for o in consts:
                cat = "fwd" if dep[o] else "fwd_const"
                if o not in items[cat]:
                    items[cat][o] = (float(self.op_time[o]), atomic.components_of(o))
        for c, att in enumerate(atomic.attached):
            for o in att:
                phase = ops[o].phase
                cat = (("fwd" if dep[o] else "fwd_const") if phase == "forward" else "step" if phase != "backward"
                       else "bwd" if dep[o] else "bwd_const")
                items[cat][o] = (float(self.op_time[o]), (c,))
        # inputs by role, and saved values, held by the components of the ops reading them
        readers: dict[int, set[int]] = defaultdict(set)
        saved: dict[int, set[int]] = defaultdict(set)
        for c in range(n):
            for o in atomic.ops(c):
                if not live[o]:
                    continue
                fwd_op = ops[o].phase == "forward" or o == atomic.tasks[c] or o in atomic.constants[c]
                for v in ops[o].inputs:
                    val = values[v]
                    if val.producer is None and val.kind == "input":
                        if val.role in ("parameter", "state") or (val.role == "data" and fwd_op):
                            readers[v].add(c)
                    elif not fwd_op and val.producer is not None and ops[val.producer].phase == "forward" \
                            and v not in fz.unsaved:
                        saved[v].add(c)
        for v, reader in fz.kept:       # FlashAttention's log-sum-exp, read by its backward kernel
            if live[reader]:
                saved[v].update(atomic.components_of(reader))
        for v, cs in readers.items():
            val = values[v]
            cat = {"parameter": "params", "state": "state", "data": "data"}[val.role]
            items[cat][v] = (float(val.nbytes), tuple(sorted(cs)))
        for v, cs in saved.items():
            p = values[v].producer
            cat = "act" if dep[p] else "act_const"
            items[cat][v] = (float(values[v].nbytes * ops[p].repeat), tuple(sorted(cs)))
        self.items = items
        # values between components: (producer component, consumer components, bytes)
        comp_of = atomic.component_of
        flows = []
        for c, t in enumerate(atomic.tasks):
            op = ops[t]
            for v in op.outputs:
                dsts = {comp_of[d] for d in values[v].consumers
                        if live[d] and d in comp_of and atomic.tasks[comp_of[d]] == d}
                dsts.discard(c)
                if dsts:
                    flows.append((c, tuple(sorted(dsts)), values[v].nbytes * op.repeat))
        self.flows = flows
        self._per_component = self._component_totals()

    # --- per component ------------------------------------------------------------------------
    def _component_totals(self) -> dict[str, np.ndarray]:
        n = len(self.atomic)
        out = {}
        for cat, its in self.items.items():
            arr = np.zeros(n)
            for w, cs in its.values():
                for c in cs:
                    arr[c] += w
            out[cat] = arr
        return out

    def component_work(self) -> np.ndarray:
        """Seconds of forward + backward work per component at the traced batch (clones in each)."""
        t = self._per_component
        return t["fwd"] + t["fwd_const"] + t["bwd"] + t["bwd_const"]

    def component_memory(self) -> np.ndarray:
        """Bytes per device a component needs at the smallest micro-batch (one sample, one in
        flight): parameters, gradients, optimizer state, saved constants and activations."""
        t = self._per_component
        return 2 * t["params"] + t["state"] + t["act_const"] + (t["act"] + t["data"]) / self.batch

    # --- unions -------------------------------------------------------------------------------
    def totals(self, components: Iterable[int]) -> dict[str, float]:
        """Union totals per category over a set of components (direct; for checks and reports)."""
        cs = set(components)
        return {cat: float(sum(w for w, held in its.values() if not cs.isdisjoint(held)))
                for cat, its in self.items.items()}

    def range_tables(self, units: Sequence[Sequence[int]]) -> RangeTables:
        """Range tables over `units` (lists of components) given in topological order."""
        n = len(units)
        unit_of = np.full(len(self.atomic), -1, dtype=np.int64)
        for u, cs in enumerate(units):
            unit_of[list(cs)] = u
        if (unit_of < 0).any():
            raise PipelineError("pipeline: units must cover every atomic component")
        tables = {}
        for cat, its in self.items.items():
            single = np.zeros(n)
            multi: dict[tuple[int, ...], float] = defaultdict(float)
            for w, cs in its.values():
                us = {int(unit_of[c]) for c in cs} if len(cs) > 1 else {int(unit_of[cs[0]])}
                if len(us) == 1:
                    single[us.pop()] += w
                else:
                    multi[tuple(sorted(us))] += w
            prefix = np.concatenate([[0.0], np.cumsum(single)])
            tab = prefix[None, :] - prefix[:, None]
            for us, w in multi.items():
                ind = np.zeros(n)
                ind[list(us)] = 1
                cnt = np.concatenate([[0.0], np.cumsum(ind)])
                tab += w * ((cnt[None, :] - cnt[:, None]) > 0)
            tables[cat] = np.triu(tab, 1)
        diff = np.zeros(n + 2)
        for c, dsts, b in self.flows:
            p, q = int(unit_of[c]), max(int(unit_of[d]) for d in dsts)
            if q > p:
                diff[p + 1] += b
                diff[q + 1] -= b
        cut = np.cumsum(diff)[: n + 1]
        cut[0] = cut[n] = 0.0
        return RangeTables(n, tables, cut)

    def boundary_bytes(self, before: Iterable[int]) -> float:
        """Bytes of values produced by components in `before` and consumed outside it (direct)."""
        b = set(before)
        return float(sum(nb for c, dsts, nb in self.flows if c in b and not b.issuperset(dsts)))

    # --- communication ------------------------------------------------------------------------
    def p2p(self) -> tuple[float, float]:
        """(latency, seconds per byte) of a stage-to-stage send on the intra-node link (RaNNC
        estimates stage communication with the intra-node bandwidth, §III-B footnote 3)."""
        hw = self.hardware
        return alpha_beta("collective-permute", 2, hw.intra_node_bandwidth, hw.intra_node_latency,
                          hw.collective_efficiency["collective-permute"])

    def allreduce(self, n: int, inter_node: bool) -> tuple[float, float]:
        """(latency, seconds per byte) of a ring all-reduce over n devices (_cost formulas)."""
        hw = self.hardware
        bw, lat = ((hw.inter_node_bandwidth, hw.inter_node_latency) if inter_node
                   else (hw.intra_node_bandwidth, hw.intra_node_latency))
        return alpha_beta("all-reduce", n, bw, lat, hw.collective_efficiency["all-reduce"])


def stage_cost(t: dict[str, Any], cut_in: Any, cut_out: Any, *, fraction: Any, inflight: Any,
               microbatches: int, p2p: tuple[float, float], allreduce: tuple[Any, Any],
               recompute: bool = False) -> tuple[Any, Any, Any]:
    """(forward seconds, backward seconds, bytes per device) of one stage, per micro-batch.

    Works elementwise on scalars or numpy arrays. Forward: scaled forward tasks + constant ops +
    sending the boundary values after the stage. Backward: scaled backward ops + constant backward
    ops (+ the forward again with `recompute`) + sending input gradients back + the once-per-step
    gradient all-reduce among the stage's replicas and optimizer update, amortised over the
    micro-batches. Memory: parameters, gradients (same bytes), optimizer state, saved constants,
    plus saved activations and data of each micro-batch in flight; with `recompute` only the
    stage's inputs are kept per micro-batch and one micro-batch's activations are rebuilt.
    """
    def send(nbytes):
        return np.where(nbytes > 0, p2p[0] + p2p[1] * nbytes, 0.0)

    fwd = fraction * t["fwd"] + t["fwd_const"]
    bwd = fraction * t["bwd"] + t["bwd_const"] + (fwd if recompute else 0.0)
    ar = np.where(t["params"] > 0, allreduce[0] + allreduce[1] * t["params"], 0.0)
    fwd = fwd + send(fraction * cut_out)
    bwd = bwd + send(fraction * cut_in) + (ar + t["step"]) / microbatches
    static = 2 * t["params"] + t["state"] + t["act_const"]
    if recompute:
        act = fraction * ((cut_in + t["data"]) * inflight + t["act"])
    else:
        act = fraction * (t["act"] + t["data"]) * inflight
    return fwd, bwd, static + act


def op_times(graph, hw: HardwareSpec, custom: CostModel | None, cm: CostModel, attention: str,
             measured: Sequence[float] | None) -> np.ndarray:
    """Seconds of each op per step (its repeat count included): measured (`profile="measured"`, seconds
    per execution), on the hardware's kernel model (tiles, waves, launches) or on `cm`'s roofline, each
    op priced for the bytes and kernels left after XLA's fusion (attention="flash": attention cores as
    FlashAttention's kernels, core/attention.py). Dead ops cost nothing: XLA deletes them."""
    ops = graph.ops
    if measured is not None:
        if len(measured) != len(ops):
            raise PipelineError(f"pipeline.PipelineCosts: op_time has {len(measured)} entries for a graph "
                                f"of {len(ops)} ops; give one time per op (seconds per execution).")
        times = np.array([float(t) * op.repeat for t, op in zip(measured, ops, strict=True)])
        return times * live_ops(graph)
    fz = priced_fusion(graph, hw.kernels is not None, attention)
    scale = fz.scale if fz.scale is not None else np.ones(len(ops))
    if hw.kernels is not None and custom is None:
        km = hw.kernels
        peaks = [hw.peak_flops(compute_dtype(op.primitive, op.in_dtypes, op.out_dtypes)) for op in ops]
        times = np.array([op.repeat * op_seconds(
            km, op.primitive, op.params, op.in_shapes, op.out_shapes[0] if op.out_shapes else (), op.flops,
            fz.bytes[i], peak * hw.compute_efficiency, hw.memory_bandwidth, peak=peak, launches=fz.launches[i],
            scale=scale[i]) for i, (op, peak) in enumerate(zip(ops, peaks, strict=True))])
    else:
        times = np.array([cm.compute(op.flops * scale[i] * op.repeat, fz.bytes[i] * op.repeat,
                                     op.out_dtypes[0] if op.out_dtypes else "float32")
                          for i, op in enumerate(ops)])
    return times * live_ops(graph)
