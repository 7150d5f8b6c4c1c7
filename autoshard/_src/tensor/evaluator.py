"""The plan evaluator of the tensor-sharding search (pure: no jax import): options, the chosen
point's record, and `_Evaluator`, which prices many plans of one factor graph at once with numpy.

Every op is summarised by the factors that split it and those it reduces over; ops with the same
summary are summed into groups, so a plan's cost is a table lookup per group (compute, all-reduces
of partial results, gathers of unknown ops), plus the parameters, gradients, optimizer state and
activations it keeps under a storage mode, plus the moves of values cut at region boundaries
(`FactorGraph.cuts`: an MoE layer's all-to-alls).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

from ..core.attention import ATTENTION_MODES, priced_fusion
from ..core.collectives import KINDS
from ..core.cost import CostModel
from ..core.errors import ConfigError
from ..core.fusion import ALIAS_OPS, window_fusion
from ..core.graph import OpGraph, nbytes
from ..core.hardware import HardwareSpec
from ..core.kernels import compute_dtype
from ..core.mesh import MeshSpec
from ..core.optable import PHASE_CODES
from ..core.residuals import reversed_parameter, saved_values
from .comm_records import CommBytes, CommRecords, _mask_axes
from .factors import FactorGraph
from .kernel_costs import GemmCosts
from .memory import MemoryModel
from .moves import CollectiveMoves
from .regions import REDUCE_SCATTERED
from .shares import unlinked_batch_loops
from .step_inputs import inputs_by_source, update_reads_all

STORAGE_MODES = ("replicated", "zero1", "zero3")


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    memory_budget: float | None = None       # bytes per device; None: 90 % of the hardware's
    storage_modes: tuple[str, ...] = STORAGE_MODES
    max_plans: int = 2_000_000               # enumeration cap (factors beyond it stay unsplit)
    # share of the last micro-batch's backward compute the gradient sync can hide behind: as Megatron's
    # --overlap-grad-reduce, a bucket's reduction starts once the last micro-batch's backward has
    # produced it (tensor plans: one micro-batch, its whole backward; joint/stage_choice.py: a stage's
    # backward / M)
    overlap: float = 1.0
    bucket_bytes: int = 25 * 2**20           # TAP §4.7.1 gradient packing threshold, per device
    # sequence parallelism (Megatron-SP, see regions.py): "auto" searches the space with the residual
    # stream cut from the tensor-parallel regions when no plan without it fits the memory budget;
    # "on" always searches it (it holds every plan without it too); "off" never
    sequence_parallel: str = "auto"
    # attention as the program's call runs it ("as_traced": XLA's einsum + softmax, the [B, H, S, S]
    # scores in memory) or as FlashAttention does on a GPU ("flash": core/attention.py)
    attention: str = "as_traced"

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_MODES:
            raise ConfigError(f"SearchOptions: attention={self.attention!r} must be one of {list(ATTENTION_MODES)}: "
                              "'as_traced' prices the program's own attention, 'flash' FlashAttention's kernels.")


@dataclasses.dataclass(frozen=True)
class PlanChoice:
    """The chosen point and its predicted costs."""

    factor_axes: dict[int, tuple[str, ...]]
    storage: str
    step_time: float
    breakdown: dict[str, float]           # compute / forward comm / backward comm / grad sync ...
    memory: dict[str, float]              # per device bytes: params, grads, optimizer, activations
    comm_bytes: Mapping[str, float]       # per device collective buffer bytes by "kind@axes" (CommBytes)
    plans_evaluated: int
    feasible: bool
    # mesh axis names matched (tensor.axis_hints.row_hints; set by the search) and, when the names decided
    # between plans of the same predicted step, what they decided (explain prints it)
    hint: int = 0
    hint_note: str = ""


@dataclasses.dataclass
class SearchResult:
    best: PlanChoice
    factors: FactorGraph
    candidates: tuple[int, ...]           # factors the search could split
    op_weight: dict[int, float]
    grad_ops: frozenset[int]
    budget: float
    notes: list[str]
    periods: tuple[int, ...]              # per block type: instances repeat with this period

    def evaluate(self, factor_axes: dict[int, tuple[str, ...]], storage: str) -> PlanChoice:
        """Cost of any assignment (used to compare with expert plans)."""
        return self._evaluator.evaluate_one(factor_axes, storage)


_MATERIALISED = ("dot_general", "conv_general_dilated")     # results XLA writes to memory, never fused away
# kernels of their own whose backward results are written whole too: a scatter-add (the gradient of a
# gather: the loss's take_along_axis, whose [B, S, V] cotangent XLA:GPU updates in place)
_SCATTERS = ("scatter-add", "scatter_add", "scatter")
_BUCKET = {"forward": "fwd_comm", "backward": "bwd_comm", "grad": "grad_sync", "optimizer": "opt_comm",
           "other": "fwd_comm"}


def _axis_masks(mesh: MeshSpec) -> list[int]:
    return list(range(1 << len(mesh.names)))


def _mask_size(mesh: MeshSpec, mask: int) -> int:
    return math.prod(s for i, s in enumerate(mesh.sizes) if mask >> i & 1)


class _Shared:
    """What the evaluators of one plan space share (the 3-D search builds ~20 per submesh shape):
    the collective cost tables per cost model and the candidate masks of factor sets."""

    def __init__(self) -> None:
        # per candidate tuple: factor set -> candidate indices
        self.cmasks: dict[tuple[int, ...], dict[tuple | frozenset, tuple[int, ...]]] = {}
        self._coll: dict[int, tuple[CostModel, dict]] = {}

    def collective_tables(self, mesh: MeshSpec, cost: CostModel) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per collective kind, (latency, seconds per byte) over each mask of `mesh`'s axes."""
        hit = self._coll.get(id(cost))
        if hit is not None and hit[0] is cost:
            return hit[1]
        nm = 1 << len(mesh.names)
        coll = {}
        for kind in KINDS:   # every collective kind the cost model knows
            alpha = np.array([cost.collective(kind, 0.0, _mask_axes(mesh, m)) for m in range(nm)])
            beta = np.array([(cost.collective(kind, 1e9, _mask_axes(mesh, m)) - alpha[m]) / 1e9
                             for m in range(nm)])
            coll[kind] = (alpha, beta)
        self._coll[id(cost)] = (cost, coll)
        return coll


# what _build_groups / _build_tensors / _build_reshards set (read-only afterwards)
_BUILT = ("partial_cuts", "gemm_costs", "phase_work", "fused", "op_loops", "groups", "gathers", "data", "params",
          "param_largest", "update_reads_all", "gathered", "state", "acts", "cut_copies", "backward_values",
          "reshards", "regathers")


class _Evaluator(MemoryModel, CollectiveMoves, CommRecords):
    """Vectorised cost and memory of many plans over one factor graph."""

    def __init__(self, graph: OpGraph, fg: FactorGraph, weights: dict[int, float],
                 grad_ops: frozenset[int], cands: tuple[int, ...], mesh: MeshSpec,
                 hw: HardwareSpec, cost: CostModel, options: SearchOptions,
                 in_map: dict[int, int], inputs: Sequence[int] | None = None,
                 fused_update: bool | None = None, shared: _Shared | None = None,
                 accumulate: bool = False, window: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
                 keep_all: bool = False) -> None:
        self.graph, self.fg, self.mesh, self.hw, self.cost = graph, fg, mesh, hw, cost
        self.window = window        # (scope, core): `weights` prices core ops only (window_fusion)
        self.in_map = in_map
        # the inputs whose bytes count (parameters, state, data): all, or a pipeline stage's own
        self.inputs = list(graph.inputs) if inputs is None else list(inputs)
        # the step applies the optimizer itself (known to callers that build many evaluators)
        self.fused_update = (bool((graph.table().phase == PHASE_CODES["optimizer"]).any()) if fused_update is None
                             else fused_update)
        # pipeline stages accumulate gradients over micro-batches: every gradient lives through the
        # step beside the activations in flight (the 3-D tables add those per micro-batch)
        self.accumulate = accumulate
        # remat 'dots' keeps every matmul result: the replayed elementwise ops read those that were not
        # residuals (the attention scores the softmax is recomputed from), see bridge/emit/remat_jaxpr.py
        self.keep_all = keep_all
        self.options = options
        self.cands = cands
        self.cidx = {f: i for i, f in enumerate(cands)}
        nm = 1 << len(mesh.names)
        self.nm = nm
        self.msize = np.array([_mask_size(mesh, m) for m in range(nm)], dtype=np.float64)
        shared = shared if shared is not None else _Shared()
        self.coll = shared.collective_tables(mesh, cost)
        # candidate indices depend on the candidates: a wider evaluator of the same space (an expert plan
        # splitting dims outside them, search.evaluate_assignment) must not read the narrower one's
        self._cmasks = shared.cmasks.setdefault(cands, {})
        # the summaries read the candidates, not the mesh: shared by every mesh with the same candidates
        key = (cands, tuple(sorted(weights.items())), grad_ops, tuple(self.inputs), self.fused_update, accumulate,
               options.attention, repr(hw), id(in_map), keep_all)
        built = fg.builds.get(key)
        if built is None or built[0] is not in_map:
            self._build_groups(weights, grad_ops)
            self._build_tensors(weights, grad_ops)
            self._build_reshards(weights)
            fg.builds[key] = (in_map, {k: getattr(self, k) for k in _BUILT})
        else:
            self.__dict__.update(built[1])

    # --- summaries -------------------------------------------------------------------------
    def _cmask(self, factors) -> tuple[int, ...]:
        """Candidate indices among `factors` (sorted): ops repeat few factor sets, so each is looked up once."""
        key = factors if isinstance(factors, frozenset | tuple) else tuple(factors)
        hit = self._cmasks.get(key)
        if hit is None:
            hit = self._cmasks[key] = tuple(sorted({self.cidx[f] for f in key if f in self.cidx}))
        return hit

    def _build_groups(self, weights: dict[int, float], grad_ops: frozenset[int]) -> None:
        hw = self.hw
        groups: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0])
        unknown_gather: dict[tuple, float] = defaultdict(float)
        cut_after = {v: after for v, _, after in self.fg.cuts}
        # partial sums whose consumers read them split (a row-parallel matmul's output entering the
        # sequence-parallel stream): priced per plan, a reduce-scatter over the axes the consumers
        # split, an all-reduce over the rest (per part, when given): (loop, reduced, parts, after dims,
        # bytes, executions, phase)
        self.partial_cuts: list[tuple] = []
        # on a GPU kernel model, matmuls and convolutions are priced on their shards' shapes
        self.gemm_costs = GemmCosts(hw.kernels, self.cidx) if hw.kernels is not None else None
        bandwidth = hw.memory_bandwidth * (hw.kernels.bandwidth_efficiency if hw.kernels is not None else 1.0)
        self.phase_work: dict[str, float] = defaultdict(float)     # roofline seconds by phase
        # HBM bytes and kernels after XLA's fusion (attention as FlashAttention with attention="flash")
        gpu = hw.kernels is not None
        fused = self.fused = (window_fusion(self.graph, gpu, *self.window)
                              if self.window is not None and self.options.attention == "as_traced"
                              else priced_fusion(self.graph, gpu, self.options.attention))
        scale = fused.scale if fused.scale is not None else np.ones(len(self.graph.ops))
        unlinked = unlinked_batch_loops(self.graph, self.fg)       # batch-sized dims no factor links
        self.op_loops: list[tuple[int, float, tuple[int, ...]]] = []   # (op, executions, dividing candidates)
        # reshapes merging a split minor dim (OpFactors.regathered): (its candidates, the other dims'
        # candidates, input bytes, executions, phase), an all-gather over the minor dims' axes
        self.regathers: list[tuple[tuple[int, ...], tuple[int, ...], float, float, str]] = []
        for i, w in weights.items():
            if w <= 0:
                continue
            of = self.fg.op_factors[i]
            op = self.graph.ops[i]
            dtype = compute_dtype(op.primitive, op.in_dtypes, op.out_dtypes)
            rate = hw.peak_flops(dtype) * hw.compute_efficiency
            t = max(op.flops * scale[i] / rate, fused.bytes[i] / bandwidth)
            kind = "grad" if i in grad_ops else op.phase
            self.phase_work[kind] += w * t
            key = (self._cmask(of.loop | unlinked.get(i, frozenset())), self._cmask(of.reduced), kind)
            self.op_loops.append((i, w, key[0]))
            g = groups[key]
            over = fused.bytes[i] if i in fused.overridden else None     # a flash kernel's bytes, not the op's
            if self.gemm_costs is None or not self.gemm_costs.add(op, of, self.fg, w, hw.peak_flops(dtype),
                                                                  hw.memory_bandwidth, key[0], fused.launches[i],
                                                                  scale=scale[i], nbytes=over):
                g[0] += w * t
            after = cut_after.get(op.outputs[0]) if op.outputs else None
            if of.reduced and after is not None and op.primitive in REDUCE_SCATTERED:
                a_idx = tuple(self.cidx.get(f, -1) if f is not None else -1 for f in after)
                self.partial_cuts.append((key[0], key[1], (), a_idx, float(of.out_bytes), w, kind))
            elif len(of.reduced) > 1:
                # a sum over several dims split on different axes (a weight's gradient over the batch and
                # the split sequence): XLA all-reduces each dim's axes apart, the whole buffer each time
                # (measured: one all-reduce per contracted dim; one over all axes when one dim holds them)
                parts = tuple(self._cmask([f]) for f in sorted(of.reduced))
                self.partial_cuts.append((key[0], key[1], parts, (), float(of.out_bytes), w, kind))
            elif of.reduced:
                g[1] += w * of.out_bytes
                g[2] += w          # collectives issued (each op, each instance, each iteration)
            for b, fs in of.gathered:
                unknown_gather[(self._cmask([f for f in fs if f is not None]), op.phase)] += w * b
            for b, minor, rest in of.regathered:
                if m_idx := self._cmask(minor):
                    self.regathers.append((m_idx, self._cmask(rest), b, w, op.phase))
        # gradient sync is packed into buckets (TAP §4.7.1), counted per plan from the per-device
        # bytes (_sync_count)
        self.groups = [(k, v[0], v[1], v[2]) for k, v in sorted(groups.items())]
        self.gathers = sorted(unknown_gather.items())

    def _build_reshards(self, weights: dict[int, float]) -> None:
        """Values cut at a region boundary (`FactorGraph.cuts`): (candidate per dim as produced, as
        consumed, bytes, executions, phase). A plan moves one between the two layouts."""
        self.reshards = []
        for v, before, after in self.fg.cuts:
            p = self.graph.values[v].producer
            if p is None:
                continue
            # moved once per execution of the ops reading it in the new layout: a value crossing from one
            # block instance into the next counts as often as its reader's instance stands for (from
            # the middle instance, which stands for n, into an unanalysed one no analysed op reads it;
            # into the middle one from an instance standing for one, it crosses n times). A remat call's
            # body reads its own moved copy: the backward's recomputation of a user's nn.remat block moves
            # the value again (the forward's copy is not kept across the call)
            consumers = self.graph.values[v].consumers
            by_call = self._reads_by_call(consumers, weights)
            if not by_call:
                continue
            b_idx = tuple(self.cidx.get(f, -1) if f is not None else -1 for f in before)
            a_idx = tuple(self.cidx.get(f, -1) if f is not None else -1 for f in after)
            if b_idx == a_idx:
                continue
            nb = float(self.graph.values[v].nbytes)
            for call, (w, phase) in by_call.items():
                self.reshards.append((b_idx, a_idx, nb, w, self.graph.ops[p].phase if call < 0 else phase))
            # emission pins the value to its consumed layout (planner._src_constraints): the readers that read
            # it as produced (a post-LN layer's query/key/value reading the embedding's output whole, beside
            # the residual add reading it split) move it back, once per call (XLA reshards a value once per
            # layout it is read in; a remat call's body reads its own copy)
            cut = self.fg.cut_readers.get(v, frozenset())
            for w, phase in self._reads_by_call([c for c in consumers if c not in cut], weights).values():
                self.reshards.append((a_idx, b_idx, nb, w, phase))

    def _reads_by_call(self, readers: list[int], weights: dict[int, float]) -> dict[int, tuple[float, str]]:
        """The readers' largest weight and its reader's phase per call they sit in (-1: the top level; a
        remat call's body: its top-level eqn)."""
        by_call: dict[int, tuple[float, str]] = {}
        for c in readers:
            wc, op = weights.get(c, 0.0), self.graph.ops[c]
            call = op.top_eqn if op.remat_eqn >= 0 else -1
            if wc > by_call.get(call, (0.0, ""))[0]:
                by_call[call] = (wc, op.phase)
        return by_call

    def _build_tensors(self, weights: dict[int, float], grad_ops: frozenset[int]) -> None:
        g, fg = self.graph, self.fg
        # parameters and optimizer state, aggregated by (per-dim candidate factor, shape): every
        # layer of a 96-layer model adds bytes to the same few entries
        tensors: dict[tuple, float] = defaultdict(float)
        largest: dict[tuple, float] = defaultdict(float)      # one parameter's bytes per entry
        self.data: list[tuple[tuple[int, ...], float]] = []
        dims_of: dict[int, tuple[int, ...]] = {}      # per representative input (layers share one)

        def dims_for(src: int, shape: tuple[int, ...]) -> tuple[int, ...]:
            if g.values[src].shape != shape:
                return (-1,) * len(shape)
            hit = dims_of.get(src)
            if hit is None:
                hit = dims_of[src] = tuple(self.cidx.get(f, -1) if f is not None else -1
                                           for f in fg.value_factors(src))
            return hit
        # ZeRO-3 gathers a parameter once: emission pins its reads to the layout it is computed in
        # (planner._stored_reads), and XLA keeps that gathered copy for every forward use (a tied
        # embedding's lookup and head) and for the backward pass instead of gathering again
        gathered: dict[tuple, float] = defaultdict(float)
        stored, others = inputs_by_source(g, self.in_map, self.inputs)
        for role, src, shape, total, big in stored:
            dims = dims_for(src, shape)
            key = (role, dims, shape)
            tensors[key] += total
            largest[key] = max(largest[key], big)
            if role == "parameter":
                gathered[(dims, shape)] += total
        for src, shape, size in others:
            fs = fg.value_factors(src) if g.values[src].shape == shape else (None,) * len(shape)
            self.data.append((self._cmask(fs), size))
        self.params = [(dims, shape, b) for (role, dims, shape), b in sorted(tensors.items()) if role == "parameter"]
        self.param_largest = [largest[k] for k in sorted(tensors) if k[0] == "parameter"]
        # an update that reads a reduction over a gradient (a global norm to clip by) waits for every
        # gradient; otherwise each parameter's update reads its own gradient only (memory.py)
        self.update_reads_all = update_reads_all(g)
        self.gathered = [(dims, shape, b) for (dims, shape), b in sorted(gathered.items())]
        self.state = [(dims, shape, b) for (role, dims, shape), b in sorted(tensors.items()) if role == "state"]
        self._build_activations(weights)
        unsaved = self.fused.unsaved
        # the backward pass's working set beside the saved activations: the cotangent a matmul or
        # convolution computes, or a fusion writes for one to read (a library GEMM reads its operands
        # from memory: the logits' cotangent, softmax - one-hot, is written whole for the two matmuls of
        # the output layer's backward, beside the saved logits; XLA:GPU's buffers show both at the peak),
        # in the GEMM's narrowest operand type (XLA:GPU converts a mixed-precision matmul's float32
        # cotangent in the fusion that writes it: attention's dS, float16 in the compiled GPT step);
        # other elementwise results fuse into their consumers; gradients are counted as gradients; at
        # most the largest of them at a time
        largest: dict[tuple[int, ...], float] = {}
        group = self.fused.group
        for i, w in weights.items():
            op = g.ops[i]
            if w <= 0 or op.phase != "backward" or i in grad_ops:
                continue
            if op.primitive == "rev" and reversed_parameter(g, op):
                continue
            library = op.primitive in _MATERIALISED or op.primitive in _SCATTERS
            if not library and group[i] < 0:
                continue
            for v, s, d in zip(op.outputs, op.out_shapes, op.out_dtypes, strict=True):
                if v in unsaved:          # a flash kernel's [B, H, S, S] gradients stay on chip
                    continue
                size = float(nbytes(s, d))
                if not library:
                    itemsize = self._gemm_operand_itemsize(v)
                    if itemsize is None:
                        continue
                    size = min(size, float(math.prod(s) * itemsize))
                key = self._cmask(fg.value_factors(v, len(s)))
                largest[key] = max(largest.get(key, 0.0), size)
        self.backward_values = sorted(largest.items())

    def _build_activations(self, weights: dict[int, float]) -> None:
        """The activations the backward pass keeps (`acts`) and the cut values kept in two layouts
        (`cut_copies`), per instance weight."""
        g, fg = self.graph, self.fg
        # activations kept for the backward pass (residuals), per instance weight
        # a value cut at a region boundary is kept in the layout the region's backward reads too (the
        # all-gathered stream of sequence parallelism, the dispatched tokens; see memory.py)
        acts: dict[tuple[int, ...], float] = defaultdict(float)
        cut_after = {v: after for v, _, after in fg.cuts}
        cut_copies: dict[tuple, float] = defaultdict(float)
        unsaved, kept = self.fused.unsaved, {v for v, _ in self.fused.kept}     # attention="flash"
        # what the compiled step keeps: fusion outputs a backward fusion reads (core.residuals)
        saved = saved_values(g, self.fused, None if self.window is None else frozenset(self.window[1]))
        for i, w in weights.items():
            op = g.ops[i]
            if w <= 0 or op.phase != "forward":
                continue
            for v, s, d in zip(op.outputs, op.out_shapes, op.out_dtypes, strict=True):
                if v in unsaved:
                    continue
                if v in cut_after and len(cut_after[v]) == len(s) and v not in kept:
                    before = tuple(self.cidx.get(f, -1) if f is not None else -1 for f in fg.value_factors(v))
                    after = tuple(self.cidx.get(f, -1) if f is not None else -1 for f in cut_after[v])
                    if before != after:
                        # each layout is kept for the backward readers that read it (a vocabulary-
                        # parallel embedding's whole output is read by no backward op: only its
                        # reduce-scattered sequence-parallel copy is kept)
                        reads_after = self._reads_layout(v, cut_after[v])
                        own = saved(v, lambda c, r=reads_after: not r(c))
                        copy = saved(v, reads_after)
                        if own or copy:
                            cut_copies[(before, after, own, copy)] += w * nbytes(s, d)
                        continue
                if v in kept or self.keep_all or saved(v):
                    acts[self._cmask(fg.value_factors(v, len(s)))] += w * nbytes(s, d)
        self.acts = sorted(acts.items())
        self.cut_copies = sorted(cut_copies.items())

    def _reads_layout(self, v: int, layout: tuple):
        """A predicate on op indices: does the op read `v` in `layout` (a cut's factors per dim)?"""
        ops, of = self.graph.ops, self.fg.op_factors

        def reads(c: int) -> bool:
            f = of.get(c)
            return f is not None and any(x == v and f.in_factors[k] == layout for k, x in enumerate(ops[c].inputs))
        return reads

    def _gemm_operand_itemsize(self, v: int) -> int | None:
        """The narrowest operand itemsize of the matmuls and convolutions reading `v` (through views),
        or None when none does."""
        ops, values = self.graph.ops, self.graph.values
        todo, out = [v], None
        while todo:
            for c in values[todo.pop()].consumers:
                reader = ops[c]
                if reader.primitive in _MATERIALISED:
                    size = min(nbytes((1,), d) for d in reader.in_dtypes)
                    out = size if out is None else min(out, size)
                elif self.fused.group[c] < 0 and reader.primitive in ALIAS_OPS:
                    todo.extend(reader.outputs)
        return out

    # --- evaluation --------------------------------------------------------------------------
    def _or(self, plans: np.ndarray, idxs: tuple[int, ...]) -> np.ndarray:
        """The axes the factors at `idxs` take together, per plan (read-only: cached per plans array, since
        an evaluation asks for the same few factor sets once per op)."""
        memo = self.__dict__.get("_or_memo")
        if memo is None or memo[0] is not plans:
            memo = self.__dict__["_or_memo"] = (plans, {})
        key = tuple(sorted(set(idxs)))
        out = memo[1].get(key)
        if out is None:
            out = np.zeros(plans.shape[0], dtype=np.int64)
            for i in key:
                out |= plans[:, i]
            out.flags.writeable = False
            memo[1][key] = out
        return out

    def _sync_count(self, kind: str, count: float, per_device: np.ndarray) -> np.ndarray | float:
        """Collectives issued: gradients go in buckets of `bucket_bytes` of the per-device buffer (TAP
        §4.7.1, as DDP and Megatron pack them; `per_device`: all the gradient bytes reduced over one set
        of axes): a 32B layer's gradients at tensor-parallel 8 fill an eighth of the buckets they fill
        unsharded. Other collectives: one per op execution."""
        if kind != "grad":
            return count
        return np.where(per_device > 0, np.maximum(1.0, np.ceil(per_device / self.options.bucket_bytes)), 0.0)

    def _coll(self, kind: str, nbytes_: np.ndarray, mask: np.ndarray, count: float = 1.0) -> np.ndarray:
        """Time of `count` collectives moving `nbytes_` in total over the axes in `mask`."""
        alpha, beta = self.coll[kind]
        t = count * alpha[mask] + nbytes_ * beta[mask]
        return np.where(mask == 0, 0.0, t)

    def evaluate(self, plans: np.ndarray, storage: str) -> dict[str, np.ndarray]:
        """Per-plan step time, memory and breakdown for plans[C, K] (axis masks per factor)."""
        return self.evaluate_modes(plans, (storage,))[storage]

    def evaluate_modes(self, plans: np.ndarray, modes: Sequence[str]) -> dict[str, dict[str, np.ndarray]]:
        """`evaluate` under each storage mode of `modes`: the compute, collectives and activations do not
        depend on how parameters and optimizer state are stored, so they are priced once."""
        C = plans.shape[0]
        base = {k: np.zeros(C) for k in ("compute", "fwd_comm", "bwd_comm", "opt_comm", "grad_sync",
                                          "storage_comm", "params", "grads", "optimizer",
                                          "activations", "data", "cpu_temp_extra", "regathered", "regather_comm")}
        self._add_times(base, plans)
        shared = self._shared_memory(base, plans)
        for fs, b in self.data:
            base["data"] += b / self.msize[self._or(plans, fs)]
        results = {}
        # no parameters, optimizer state or gathered copies among the priced bytes (an evaluator of
        # some ops alone): every storage mode prices the same, so one is priced and copied
        same = not (self.params or self.state or self.gathered)
        for storage in modes:
            if same and results:
                results[storage] = {k: v.copy() for k, v in next(iter(results.values())).items()}
                continue
            out = {k: v.copy() for k, v in base.items()}
            self._storage_memory(out, plans, storage, shared)
            # the sync hides behind the backward (one micro-batch here; SearchOptions.overlap)
            bwd_compute = out["compute"] * self.bwd_share
            sync_exposed = np.maximum(0.0, out["grad_sync"] - self.options.overlap * bwd_compute)
            out["step_time"] = (out["compute"] + out["fwd_comm"] + out["bwd_comm"] + out["opt_comm"]
                                + sync_exposed + out["storage_comm"])
            out["memory"] = (out["params"] + out["grads"] + out["optimizer"] + out["activations"]
                             + out["data"])
            results[storage] = out
        return results

    def _add_times(self, out: dict[str, np.ndarray], plans: np.ndarray) -> None:
        """Compute and the tensor-parallel / gradient collectives of plans[C, K] into `out`."""
        C = plans.shape[0]
        # gradients are packed into buckets per set of axes (TAP §4.7.1; XLA's all-reduce combiner): the
        # latencies paid are the buckets the plan's gradients fill together, not one per kind of op
        grad_bytes = np.zeros((C, self.nm))
        for (loop, red, kind), work, ar_bytes, count in self.groups:
            s_mask = self._or(plans, loop)
            n = self.msize[s_mask]
            out["compute"] += work / n
            if red and ar_bytes:
                r_mask = self._or(plans, red)
                per_device = ar_bytes * self.msize[r_mask] / n
                if kind == "grad":
                    np.add.at(grad_bytes, (np.arange(C), r_mask), per_device)
                    continue
                out[_BUCKET[kind]] += self._coll("all-reduce", per_device, r_mask, count)
        for m in range(1, self.nm):
            if grad_bytes[:, m].any():
                mask = np.full(C, m)
                out["grad_sync"] += self._coll("all-reduce", grad_bytes[:, m], mask,
                                               self._sync_count("grad", 1.0, grad_bytes[:, m]))
        if self.gemm_costs is not None:
            out["compute"] += self.gemm_costs.seconds(plans, self.msize, self._or)
        for kind, mask, per_dev, w, phase, moves in self._reshard_moves(plans):
            t = self._coll(kind, per_dev * w, np.broadcast_to(mask, (C,)), w)
            out["fwd_comm" if phase == "forward" else "bwd_comm"] += np.where(moves, t, 0.0)
        for kind, buf, mask, w, count, phase in self._partial_sums(plans):
            out[_BUCKET[phase]] += self._coll(kind, buf * w, mask, count)
        for (fs, phase), b in self.gathers:
            m = self._or(plans, fs)
            out["fwd_comm" if phase == "forward" else "bwd_comm"] += self._coll(
                "all-gather", b * np.ones(C), m)
        for mask, per_dev, w, phase in self._regathers(plans):
            out["fwd_comm" if phase == "forward" else "bwd_comm"] += self._coll("all-gather", per_dev * w, mask, w)

    def op_shares(self, row: np.ndarray) -> list[tuple[int, float, float, float]]:
        """Per priced op under one plan (a row of axis masks): (op index, executions, flops, bytes),
        the last two per device and execution as the evaluator divides them (by the shards of the
        factors splitting the op; a GEMM on a kernel model is priced on that same shard's shape)."""
        plans = np.asarray(row).reshape(1, -1)
        out = []
        for i, w, loop in self.op_loops:
            n = float(self.msize[int(self._or(plans, loop)[0])])
            op = self.graph.ops[i]
            out.append((i, w, op.flops / n, op.bytes / n))
        return out

    def row(self, factor_axes: dict[int, tuple[str, ...]]) -> np.ndarray:
        """One plan as a row of axis masks per candidate factor (factors outside the candidates drop)."""
        row = np.zeros(len(self.cands), dtype=np.int64)
        for f, axes in factor_axes.items():
            if f in self.cidx:
                row[self.cidx[f]] = sum(1 << self.mesh.names.index(a) for a in axes)
        return row

    def evaluate_one(self, factor_axes: dict[int, tuple[str, ...]], storage: str) -> PlanChoice:
        return self.evaluate_many([(factor_axes, storage)])[0]

    def evaluate_many(self, assignments: Sequence[tuple[dict[int, tuple[str, ...]], str]]) -> list[PlanChoice]:
        """`evaluate_one` of each (factor axes, storage), priced together: one pass over the summaries for all
        (each plan's numbers are its own: every term is per plan)."""
        if not assignments:
            return []
        rows = np.stack([self.row(fa) for fa, _ in assignments])
        by_mode = self.evaluate_modes(rows, tuple(dict.fromkeys(storage for _, storage in assignments)))
        return [self._choice(rows[i], by_mode[storage], i, storage, 1) for i, (_, storage) in enumerate(assignments)]

    def _choice(self, row: np.ndarray, res: dict, i: int, storage: str, n_plans: int) -> PlanChoice:
        fa = {f: _mask_axes(self.mesh, int(row[k])) for k, f in enumerate(self.cands) if row[k]}
        bd = {k: float(res[k][i]) for k in ("compute", "fwd_comm", "bwd_comm", "opt_comm",
                                             "grad_sync", "storage_comm")}
        mem = {k: float(res[k][i]) for k in ("params", "grads", "optimizer", "activations", "data",
                                             "cpu_temp_extra")}
        mem["total"] = float(res["memory"][i])
        return PlanChoice(fa, storage, float(res["step_time"][i]), bd, mem, CommBytes(self, row, storage), n_plans,
                          bool(res["memory"][i] <= self.budget))
