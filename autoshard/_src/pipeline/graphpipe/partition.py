"""GraphPipe stage partitioner (Jeon et al., ASPLOS'25, §5 Algorithm 1) (pure: no jax import).

Splits a LayerGraph into a DAG of stages, each on `d` devices (data parallel inside the stage: the
stage's micro-batch is split over its replicas, gradients all-reduced once per step), so that the
bottleneck time-per-sample (TPS) is minimal and every device fits its memory:

* binary search on the target TPS over the finite set of single-stage TPS values (so the search is
  exact, not epsilon-close);
* for a target t, a DP over the SP tree (`_sp.sp_decompose`): a subproblem is a series or parallel
  node's suffix of children; its options are "the first piece, then the rest", where a piece is one
  child solved recursively or several consecutive children as ONE stage (the base case). Every
  stage of the result is thus a union of consecutive whole SP children. Parallel children are
  ordered by work (heaviest first), so stages that merge small branches take similar ones. A
  series node also offers variant children lists where the last (first) k children of one branch
  of a parallel child move after (before) it, next to a light join (source), so MMT's tiny
  concat + head + loss can share a stage with the end of one branch instead of taking a device of
  its own (`_variant_lists`; this only adds order, so stages stay convex and their DAG acyclic);
* the DP value, per (devices <= d, successor depth r), is the least pipeline depth of the part (the
  in-flight count of its source stages, Algorithm 1's objective) such that every stage runs at
  TPS <= t and fits memory. With one micro-batch size per plan, graph-1F1B (`static_inflight`,
  Table 2 with bx = by) holds 1 + (depth below) micro-batches on a stage, so memory only depends
  on r, and series parts compose by adding depths, parallel ones by taking the max;
* memoisation: subproblems with identical costs and structure (the identical branches of MMT,
  DLRM, CANDLE-Uno, and the variants of identical branches) share one DP table, keyed by a
  structural signature (costs at 24-bit precision);
* the schedule configuration is the paper's default (§6/§7): graph-1F1B (k = 1) and one
  micro-batch size b for all stages, b a power of two dividing the mini-batch, searched in an outer
  loop over every such b up to `max_microbatch_size`. Per b the DP gives t*(b) and its depth h;
  the step estimate t*·(B + (h-1)·b) picks b (the largest b within 1% of the best estimate: fewer
  micro-batches cost less in the simulator and on real devices), trading fill/drain ((h-1)·b)
  against per-sample efficiency (t*(b) falls with b on memory-bound layers). Sizes are tried
  largest first and skipped once a lower bound on t (`tps_floor`) times B exceeds the best
  estimate, which is exact for this pick. The chosen plan is then scheduled (graph-1F1B) and
  simulated (`simulate`), and its memory re-checked with the schedule's actual in-flight counts.

Stage costs reuse RaNNC's `stage_cost` (`_costs.py`): per micro-batch, forward = the stage's
seconds for its replica's share p = ceil(b/d) of the micro-batch (the sum of its nodes' curves at
p, `curve_seconds`; p x seconds per sample when the graph has no curves) + one send of the outputs
leaving the stage; backward likewise + the
gradient all-reduce among its replicas (ring, inter-node when the stage has more devices than a
node) and optimizer update, amortised over the micro-batches; memory = 2 x parameters + optimizer
state + saved activations x in-flight micro-batches. Sends are charged to the sending stage (as in
RaNNC), so the simulator's transfer lag is zero.

`spp_partition` (`_spp.py`) runs the same search on a chain of the nodes in topological order.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import time
import types
from typing import Any

import networkx as nx
import numpy as np

from ...core.errors import InfeasiblePlanError, PipelineError
from ...core.hardware import HardwareSpec, get_hardware
from ..costs import PipelineCosts, stage_cost
from ..rannc.blocks import DEFAULT_MEMORY_FRACTION
from .layer_graph import LayerGraph, curve_seconds
from .plan_types import GraphPipePlan, GraphStage
from .refine import evaluate, refine_sizes
from .sp import SPTree, sp_decompose

INF = math.inf
_TOLERANCE = 0.01   # b choice: the largest micro-batch within 1% of the best estimated step time
_STATS = ("fwd", "bwd", "step", "params", "state", "act", "cut_in", "cut_out")


def graphpipe_partition(graph: LayerGraph, devices: int, hardware: Any, *,
                        memory_budget: float | None = None, max_microbatch_size: int | None = None,
                        per_stage_microbatch: bool = False) -> GraphPipePlan:
    """GraphPipe's graph pipeline (module doc) of `graph` on `devices` devices of `hardware`.
    `memory_budget`: bytes per device (default: the RaNNC default fraction of device memory);
    `max_microbatch_size`: the largest micro-batch considered; `per_stage_microbatch`: give each
    stage its own micro-batch size (`_graphpipe_refine`; off by default, as in the paper). Raises
    InfeasiblePlanError when no partition fits memory, PipelineError on bad arguments."""
    _check_args("graphpipe_partition", graph, devices, memory_budget, max_microbatch_size, per_stage_microbatch)
    t0 = time.perf_counter()
    return _partition(graph, sp_decompose(graph), devices, hardware, memory_budget, max_microbatch_size,
                      method="graphpipe", t0=t0, per_stage=per_stage_microbatch)


# ---------------------------------------------------------------------------------------------
# Arguments


def _check_args(fn: str, graph: Any, devices: Any, budget: Any, max_mb: Any, per_stage: Any = False) -> None:
    if not isinstance(per_stage, bool):
        raise PipelineError(f"{fn}: per_stage_microbatch={per_stage!r} must be True or False.")
    if not isinstance(graph, LayerGraph):
        raise PipelineError(f"{fn}: graph must be a pipeline.LayerGraph, got {type(graph).__name__}.")
    if isinstance(devices, bool) or not isinstance(devices, numbers.Integral) or devices < 1:
        raise PipelineError(f"{fn}: devices={devices!r} must be a positive int.")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, numbers.Real)
                               or not math.isfinite(budget) or budget <= 0):
        raise PipelineError(f"{fn}: memory_budget={budget!r} must be a finite number of bytes > 0 (or None for "
                            "the default fraction of device memory).")
    if max_mb is not None and (isinstance(max_mb, bool) or not isinstance(max_mb, numbers.Integral)
                               or max_mb < 1):
        raise PipelineError(f"{fn}: max_microbatch_size={max_mb!r} must be a positive int (or None: up to "
                            "the mini-batch).")


# ---------------------------------------------------------------------------------------------
# Subproblems


@dataclasses.dataclass
class _Inst:
    """One subproblem instance. A single stage (`nodes`) or a suffix of an SP node's children,
    whose options are (piece, rest or None) = the first piece then the remaining suffix."""

    sig: int
    kind: str                                  # "single", "series", "parallel"
    nodes: tuple[int, ...] = ()
    options: tuple[tuple[_Inst, _Inst | None], ...] = ()


class _Problem:
    """Subproblem instances of an SP tree, deduplicated into signatures for the DP tables.

    `variants`: a series node also offers its children lists with one branch's tail (head) moved
    after (before) a parallel child next to a light sibling, see `_variant_lists`; SPP and the
    brute-force tests' concrete trees pass False."""

    def __init__(self, graph: LayerGraph, tree: SPTree, variants: bool = True) -> None:
        self.graph = graph
        nodes = graph.nodes
        self.variants = variants
        self.work = [nd.forward + nd.backward for nd in nodes]
        self._sigs: dict[Any, int] = {}
        self.sig_kind: list[str] = []
        self.sig_options: list[tuple[tuple[int, int], ...]] = []   # (piece sig, rest sig or -1)
        self.single_stats: list[tuple[float, ...]] = []              # per single sig, _STATS
        self.single_curves: list[tuple[tuple[float, ...], tuple[float, ...]]] = []   # forward, backward
        self.single_index: dict[int, int] = {}                       # sig -> row in single_stats
        self._single_nodes: dict[int, tuple[int, ...]] = {}
        self._built: dict[int, tuple[SPTree, _Inst, int]] = {}       # id(tree) -> (tree, inst, height)
        self.root, self.R = self._build(tree)   # R: the deepest pipeline any option forms

    def _intern(self, key: Any, kind: str, options=(), stats=None) -> int:
        sig = self._sigs.get(key)
        if sig is None:
            sig = self._sigs[key] = len(self.sig_kind)
            self.sig_kind.append(kind)
            self.sig_options.append(options)
            if stats is not None:
                self.single_index[sig] = len(self.single_stats)
                self.single_stats.append(stats[0])
                self.single_curves.append(stats[1])
        return sig

    def _collect_nodes(self, sig: int) -> tuple[int, ...]:
        """The node set of a single-stage signature (tests; identical sets share a signature only
        if their costs match, so this is the first instance's set)."""
        return self._single_nodes[sig]

    def single_sig(self, nodes: tuple[int, ...]) -> int:
        """The signature of the single stage made of `nodes` (interned by the build)."""
        return self._sigs[("single", _cost_key(self._stats(nodes)))]

    def _single(self, nodes: tuple[int, ...]) -> _Inst:
        stats = self._stats(nodes)
        sig = self._intern(("single", _cost_key(stats)), "single", stats=stats)
        self._single_nodes.setdefault(sig, nodes)
        return _Inst(sig, "single", nodes)

    def _stats(self, nodes: tuple[int, ...]) -> tuple[tuple[float, ...], tuple[tuple[float, ...], ...]]:
        """(_STATS, (forward curve, backward curve)) of the stage made of `nodes`; exactly rounded
        sums (fsum), so the same costs summed in another order give the same signature."""
        g, inside = self.graph, set(nodes)
        nd = [g.nodes[v] for v in nodes]
        cut_out = math.fsum(g.nodes[u].output_bytes for u in nodes if any(v not in inside for v in g.succ[u]))
        feeders = sorted({u for v in nodes for u in g.pred[v] if u not in inside})
        cut_in = math.fsum(g.nodes[u].output_bytes for u in feeders)
        # curves are additive over nodes: the stage's seconds at size 2**i are the sum of its nodes'
        curves = tuple(tuple(math.fsum(c) for c in zip(*(getattr(x, f) for x in nd), strict=True))
                       for f in ("forward_curve", "backward_curve"))
        return (tuple(math.fsum(getattr(x, f) for x in nd) for f in
                      ("forward", "backward", "update", "param_bytes", "state_bytes", "activation_bytes"))
                + (cut_in, cut_out), curves)

    def _build(self, tree: SPTree) -> tuple[_Inst, int]:
        """(instance, height): height = nodes on the longest chain of any option (bounds depths)."""
        hit = self._built.get(id(tree))
        if hit is not None:
            return hit[1], hit[2]
        if tree.kind == "leaf":
            inst, height = self._single(tree.nodes), 1
        elif tree.kind == "parallel":  # heaviest first, so merged pieces group similar branches
            kids = sorted(tree.children, key=lambda c: (-sum(self.work[v] for v in c.nodes), c.nodes[0]))
            built = [self._build(c) for c in kids]
            inst = self._chain("parallel", kids, [i for i, _ in built])
            height = max(h for _, h in built)
        else:
            lists = [list(tree.children)] + (_variant_lists(tree.children, self.work) if self.variants else [])
            options: dict[tuple[int, int], tuple[_Inst, _Inst | None]] = {}
            height = 0
            for kids in lists:
                built = [self._build(c) for c in kids]
                inst = self._chain("series", kids, [i for i, _ in built])
                for piece, rest in inst.options:
                    options.setdefault((piece.sig, -1 if rest is None else rest.sig), (piece, rest))
                height = max(height, sum(h for _, h in built))
            if len(lists) > 1:   # the union of the lists' first-piece options
                key = ("series", tuple(options))
                inst = _Inst(self._intern(key, "series", tuple(sorted(options))), "series",
                             options=tuple(options.values()))
        self._built[id(tree)] = (tree, inst, height)
        return inst, height

    def _chain(self, kind: str, kids: list[SPTree], insts: list[_Inst]) -> _Inst:
        """The suffix instances of a children list; returns the whole list's."""
        k = len(kids)
        suffix: list[_Inst | None] = [None] * (k + 1)
        for i in range(k - 1, -1, -1):
            options = []
            for m in range(i + 1, k + 1):
                piece = insts[i] if m == i + 1 else self._single(
                    tuple(sorted(v for c in kids[i:m] for v in c.nodes)))
                options.append((piece, suffix[m]))
            key = (kind, tuple((p.sig, -1 if r is None else r.sig) for p, r in options))
            sig = self._intern(key, kind, tuple(sorted(set(key[1]))))
            suffix[i] = _Inst(sig, kind, options=tuple(options))
        assert suffix[0] is not None
        return suffix[0]


def _cost_key(stats: tuple[tuple[float, ...], tuple[tuple[float, ...], ...]]) -> tuple[int, ...]:
    """Costs rounded to 24 bits (~7 significant digits) for interning: stage costs that differ only by
    rounding noise (identical branches whose traced ops sum in another order) share one DP
    table; the DP and the plan then use the first instance's exact costs."""
    m, e = np.frexp(np.array(stats[0] + stats[1][0] + stats[1][1], dtype=float))
    return tuple(np.round(m * (1 << 24)).astype(np.int64).tolist()) + tuple(e.tolist())


def _variant_lists(children: tuple[SPTree, ...], work: list[float]) -> list[list[SPTree]]:
    """Children lists of a series node besides its own: for a parallel child P, one of its series
    branches S(b_0 ; ... ; b_{L-1}) and 1 <= k < L, the last k children moved after P
    (P' ; b_{L-k} ; ... ; b_{L-1} ; next) when P's next sibling is *light*: less work (forward +
    backward per sample) than b_{L-1}; likewise the first k moved before P when its previous
    sibling is lighter than b_0. This only adds order (the moved part now follows, or precedes,
    every other branch of P), so stages built from a variant are convex and their DAG acyclic;
    it lets a light join or source (MMT's concat + head + loss) share a stage with the adjacent
    end of a branch instead of taking a device of its own (a heavy one can have its own stage at
    no loss, and skipping it keeps the search small). One move per list; every branch is tried
    (identical branches give identical signatures, so the DP work is shared)."""
    def w(t: SPTree) -> float:
        return math.fsum(work[v] for v in t.nodes)

    out: list[list[SPTree]] = []
    kids = list(children)
    for j, par in enumerate(kids):
        if par.kind != "parallel":
            continue
        for bi, br in enumerate(par.children):
            if br.kind != "series":
                continue
            L = len(br.children)
            for after in (True, False):
                nb = j + 1 if after else j - 1
                if not (0 <= nb < len(kids)) or w(kids[nb]) >= w(br.children[-1 if after else 0]):
                    continue
                for k in range(1, L):
                    keep, moved = ((br.children[:L - k], br.children[L - k:]) if after
                                   else (br.children[k:], br.children[:k]))
                    rest = keep[0] if len(keep) == 1 else SPTree("series", keep, artificial=br.artificial)
                    # canonical form: a parallel remainder's branches join P's directly
                    others = par.children[:bi] + par.children[bi + 1:]
                    par2 = SPTree("parallel", others + (rest.children if rest.kind == "parallel" else (rest,)))
                    mid = [par2, *moved] if after else [*moved, par2]
                    out.append(kids[:j] + mid + kids[j + 1:])
    return out


# ---------------------------------------------------------------------------------------------
# Costs of single stages, per micro-batch size


class _Costs:
    """Per single-stage signature and device count d = 0..D: TPS, forward, backward, static and
    per-in-flight memory, for one micro-batch size b (uniform over the plan)."""

    def __init__(self, prob: _Problem, hw: HardwareSpec, D: int, b: int, batch: int, budget: float) -> None:
        self.b, self.M = b, batch // b
        S = np.array(prob.single_stats, dtype=float).reshape(-1, len(_STATS))
        K = prob.graph.curve_sizes
        C = np.array(prob.single_curves, dtype=float).reshape(len(S), 2, K)
        d = np.arange(D + 1)
        per_dev = np.where(d > 0, -(-b // np.maximum(d, 1)), 0)   # samples per replica (ceil)
        # compute seconds of a replica's share of the micro-batch, from the curves (K = 0: linear,
        # per_dev x per-sample seconds, bit for bit what stage_cost computes from fraction x fwd);
        # they enter stage_cost as its constant terms, which it only adds to the communication
        t = {c: S[:, i:i + 1] for i, c in enumerate(_STATS[:6])}
        t.update(fwd=0.0, bwd=0.0, act_const=0.0, data=0.0,
                 fwd_const=curve_seconds(C[:, None, 0, :], S[:, 0:1], per_dev[None, :]),
                 bwd_const=curve_seconds(C[:, None, 1, :], S[:, 1:2], per_dev[None, :]))
        shim = types.SimpleNamespace(hardware=hw)  # PipelineCosts' comm formulas only read .hardware
        ar = [PipelineCosts.allreduce(shim, int(x), int(x) > hw.devices_per_node) for x in d]
        kw = dict(fraction=per_dev[None, :], microbatches=self.M, p2p=PipelineCosts.p2p(shim),
                  allreduce=(np.array([a for a, _ in ar])[None, :], np.array([c for _, c in ar])[None, :]))
        f, bw, m0 = stage_cost(t, S[:, 6:7], S[:, 7:8], inflight=0, **kw)
        _, _, m1 = stage_cost(t, S[:, 6:7], S[:, 7:8], inflight=1, **kw)
        ok = (d >= 1) & (d <= b)   # every replica gets at least one sample
        self.fwd = np.where(ok, f, INF)
        self.bwd = np.where(ok, bw, INF)
        self.tps = (self.fwd + self.bwd) / b
        self.m0, self.m1 = np.broadcast_to(m0, self.tps.shape), np.broadcast_to(m1 - m0, self.tps.shape)
        r = np.arange(prob.R + 1)
        inflight = np.minimum(self.M, r + 1)   # graph-1F1B: 1 + depth below, at most M
        self.mem = self.m0[:, :, None] + self.m1[:, :, None] * inflight[None, None, :]   # [single, d, r]
        self.set_budget(budget)

    def set_budget(self, budget: float) -> None:
        self.fits = self.mem <= budget
        self.candidates = np.unique(self.tps[np.isfinite(self.tps) & self.fits[:, :, 0]])


# ---------------------------------------------------------------------------------------------
# DP for one target TPS


class _DP:
    """Least depth per (devices <= d, successor depth r) of every signature at target TPS t."""

    def __init__(self, prob: _Problem, costs: _Costs, D: int, t: float) -> None:
        self.prob, self.costs, self.D, self.R = prob, costs, D, prob.R
        feas = ((costs.tps <= t) & np.isfinite(costs.tps))[:, :, None] & costs.fits   # [single, d, r]
        any_ = feas.any(axis=1)
        self.need = np.where(any_, feas.argmax(axis=1), D + 1)                  # [single, r] fewest devices
        self.feas = feas
        d = np.arange(D + 1)
        self.dd = np.maximum(d[:, None] - d[None, :], 0)                       # [d, x] = d - x
        self.rr = np.arange(self.R + 1)
        self.H: list[np.ndarray | None] = [None] * len(prob.sig_kind)
        for sig, kind in enumerate(prob.sig_kind):
            if kind != "single":
                self.H[sig] = self._solve(sig, kind)

    def feasible(self) -> bool:
        return math.isfinite(self.table(self.prob.root.sig)[self.D, 0])

    def table(self, sig: int) -> np.ndarray:
        h = self.H[sig]
        if h is None:  # a single stage: depth 1 from its fewest feasible devices on
            need = self.need[self.prob.single_index[sig]]
            h = self.H[sig] = np.where(np.arange(self.D + 1)[:, None] >= need[None, :], 1.0, INF)
        return h

    def _solve(self, sig: int, kind: str) -> np.ndarray:
        best = np.full((self.D + 1, self.R + 1), INF)
        for piece, rest in self.prob.sig_options[sig]:
            if rest < 0:
                cand = self.table(piece)
            elif kind == "series":
                cand = (self._series_single(piece, self.table(rest)) if self.prob.sig_kind[piece] == "single"
                        else self._series(self.table(piece), self.table(rest)))
            else:
                cand = (self._parallel_single(piece, self.table(rest)) if self.prob.sig_kind[piece] == "single"
                        else self._parallel(self.table(piece), self.table(rest)))
            np.minimum(best, cand, out=best)
        return best

    def _shift(self, hb: np.ndarray) -> np.ndarray:
        """Successor depth of the upstream part: r + depth of the downstream part (clipped; an
        infeasible downstream entry is masked by its inf anyway)."""
        return np.where(np.isfinite(hb), np.minimum(self.rr[None, :] + np.nan_to_num(hb, posinf=0), self.R),
                        self.R).astype(np.intp)

    def _series(self, ha: np.ndarray, hb: np.ndarray) -> np.ndarray:
        # [d, d2, r]: downstream hb on d2 devices, upstream ha on d - d2 behind it
        tot = ha[self.dd[:, :, None], self._shift(hb)[None, :, :]] + hb[None, :, :]
        return tot.min(axis=1)

    def _series_single(self, piece: int, hb: np.ndarray) -> np.ndarray:
        # a single upstream stage fits on d - d2 devices iff d - d2 >= need[r + hb]
        need = self.need[self.prob.single_index[piece]]
        thr = np.arange(self.D + 1)[:, None] + need[self._shift(hb)]          # [d2, r] least total devices
        z = np.full((self.D + 2, self.R + 1), INF)
        np.minimum.at(z, (np.minimum(thr, self.D + 1), np.broadcast_to(self.rr, thr.shape)), hb)
        return np.minimum.accumulate(z[: self.D + 1], axis=0) + 1.0

    def _parallel(self, ha: np.ndarray, hb: np.ndarray) -> np.ndarray:
        return np.maximum(ha[None, :, :], hb[self.dd]).min(axis=1)

    def _parallel_single(self, piece: int, hb: np.ndarray) -> np.ndarray:
        need = self.need[self.prob.single_index[piece]]                         # [r]
        left = np.arange(self.D + 1)[:, None] - need[None, :]                   # devices left for the rest
        rest = hb[np.clip(left, 0, self.D), self.rr[None, :]]
        return np.where(left >= 1, np.maximum(rest, 1.0), INF)

    # --- reconstruction -----------------------------------------------------------------------
    def stages(self, inst: _Inst, d: int, r: int) -> list[tuple[tuple[int, ...], int, int]]:
        """(nodes, devices, successor depth) of the stages of `inst` on <= d devices at depth r."""
        h = self.table(inst.sig)[d, r]
        if not math.isfinite(h):
            raise PipelineError("pipeline: GraphPipe reconstruction reached an infeasible state; please report.")
        if inst.kind == "single":
            row = self.prob.single_index[inst.sig]
            ok = [x for x in range(1, d + 1) if self.feas[row, x, r]]
            tps = self.costs.tps[row]
            return [(inst.nodes, min(ok, key=lambda x: (tps[x], x)), r)]  # fastest, then fewest devices
        for piece, rest in inst.options:
            if rest is None:
                if self.table(piece.sig)[d, r] == h:
                    return self.stages(piece, d, r)
                continue
            hp, hr = self.table(piece.sig), self.table(rest.sig)
            for x in range(1, d):
                if inst.kind == "series":   # rest (downstream) on x devices, piece on d - x
                    if math.isfinite(hr[x, r]):
                        r2 = min(r + int(hr[x, r]), self.R)
                        if hr[x, r] + hp[d - x, r2] == h:
                            return self.stages(piece, d - x, r2) + self.stages(rest, x, r)
                elif max(hp[x, r], hr[d - x, r]) == h:
                    return self.stages(piece, x, r) + self.stages(rest, d - x, r)
        raise PipelineError("pipeline: GraphPipe reconstruction found no option matching the DP value; please report.")


# ---------------------------------------------------------------------------------------------
# Search


@dataclasses.dataclass
class _Best:
    b: int
    t: float
    depth: int
    estimate: float
    stages: list[tuple[tuple[int, ...], int, int]]
    costs: _Costs


def _search_b(prob: _Problem, costs: _Costs, D: int, lo_t: float = 0.0,
              hi_t: float = INF) -> tuple[float, _DP] | None:
    """Least feasible target TPS in [lo_t, hi_t] for this micro-batch size (binary search over the
    candidates there; None if none is feasible)."""
    cand = costs.candidates[(costs.candidates >= lo_t) & (costs.candidates <= hi_t)]
    if cand.size == 0:
        return None
    lo, hi = 0, cand.size - 1
    best = _DP(prob, costs, D, float(cand[hi]))
    if not best.feasible():
        return None
    while lo < hi:  # invariant: cand[hi] feasible (best is its DP), everything below lo infeasible
        mid = (lo + hi) // 2
        dp = _DP(prob, costs, D, float(cand[mid]))
        if dp.feasible():
            hi, best = mid, dp
        else:
            lo = mid + 1
    return float(cand[hi]), best


def tps_floor(graph: LayerGraph, D: int, b: int) -> float:
    """A lower bound on the bottleneck TPS of any plan at micro-batch b: a stage on d devices
    runs p = ceil(b/d) <= b samples per replica, so TPS x d >= its compute(p) / p >= the sum over
    its nodes of their least seconds per sample at any size <= b, and the devices add up to <= D.
    On the interpolated curves that least value is at a size 2**i <= b or at b."""
    fb = np.array([nd.forward + nd.backward for nd in graph.nodes])
    K = graph.curve_sizes
    if K == 0:
        return math.fsum(fb) / D
    C = np.array([nd.forward_curve for nd in graph.nodes]) + np.array([nd.backward_curve for nd in graph.nodes])
    i = min(b.bit_length() - 1, K - 1)
    per = np.minimum((C[:, :i + 1] / np.exp2(np.arange(i + 1))).min(axis=1),
                     curve_seconds(C, fb, np.full(len(fb), float(b))) / b)
    return math.fsum(per) / D


def _microbatch_sizes(batch: int, max_mb: int | None) -> list[int]:
    cap = min(batch, max_mb or batch)
    return [1 << k for k in range(cap.bit_length()) if (1 << k) <= cap and batch % (1 << k) == 0]


def _partition(graph: LayerGraph, tree: SPTree, devices: int, hardware: Any, budget: float | None,
               max_mb: int | None, *, method: str, t0: float, per_stage: bool = False) -> GraphPipePlan:
    hw = get_hardware(hardware)
    budget_ = float(budget) if budget is not None else DEFAULT_MEMORY_FRACTION * hw.memory_bytes
    prob = _Problem(graph, tree)
    B, D = graph.batch_size, int(devices)
    found: list[_Best] = []
    # largest micro-batch first; a size whose estimate cannot come within the pick tolerance of the
    # best so far is skipped. Estimates are >= t x B, so only targets t <= bound / B matter, and t
    # is at least tps_floor (which grows as b shrinks: every smaller size is then skipped too).
    bound = INF
    for b in reversed(_microbatch_sizes(B, max_mb)):
        lo_t = tps_floor(graph, D, b) * (1 - 1e-9)   # margins: rounding must not cut off t*
        if lo_t * B > bound:
            break
        costs = _Costs(prob, hw, D, b, B, budget_)
        res = _search_b(prob, costs, D, lo_t, bound / B * (1 + 1e-9))
        if res is None:
            continue
        t, dp = res
        stages = dp.stages(prob.root, D, 0)
        depth = int(dp.table(prob.root.sig)[D, 0])
        found.append(_Best(b, t, depth, t * (B + (depth - 1) * b), stages, costs))
        bound = min(bound, found[-1].estimate * (1 + _TOLERANCE))
    if not found:
        raise _infeasible(graph, prob, hw, D, B, budget_, max_mb, method)
    top = min(x.estimate for x in found)
    pick = max((x for x in found if x.estimate <= top * (1 + _TOLERANCE)), key=lambda x: x.b)
    return _plan(graph, prob, pick, D, budget_, method, t0, chain=(method == "spp"), hw=hw,
                 sizes=_microbatch_sizes(B, max_mb) if per_stage else None)


def _plan(graph: LayerGraph, prob: _Problem, pick: _Best, D: int, budget: float, method: str,
          t0: float, *, chain: bool, hw: HardwareSpec, sizes: list[int] | None) -> GraphPipePlan:
    owner: dict[int, int] = {}
    raw = pick.stages
    for s, (nodes, _, _) in enumerate(raw):
        for v in nodes:
            owner[v] = s
    g = nx.DiGraph()
    g.add_nodes_from(range(len(raw)))
    g.add_edges_from({(owner[u], owner[v]) for u, v in graph.edges if owner[u] != owner[v]})
    order = list(nx.lexicographical_topological_sort(g, key=lambda s: raw[s][0][0]))
    pos = {s: i for i, s in enumerate(order)}
    raw = [raw[s] for s in order]
    if chain:   # SPP: a sequential pipeline in the linearised order
        edges = tuple((i, i + 1) for i in range(len(raw) - 1))
    else:
        edges = tuple(sorted((pos[u], pos[v]) for u, v in g.edges))
    B = graph.batch_size
    rows = [prob.single_index[prob.single_sig(nodes)] for nodes, _, _ in raw]
    devs = [d for _, d, _ in raw]
    by_b = {pick.b: pick.costs}

    def costs_at(b: int) -> _Costs:
        if b not in by_b:
            by_b[b] = _Costs(prob, hw, D, b, B, budget)
        return by_b[b]

    def stage_costs(i: int, b: int) -> tuple[float, float, float, float]:
        c, row, d = costs_at(b), rows[i], devs[i]
        return float(c.fwd[row, d]), float(c.bwd[row, d]), float(c.m0[row, d]), float(c.m1[row, d])

    # the DP checked memory with 1 + depth below in flight; the schedule's own counts decide here
    res = evaluate([pick.b] * len(raw), stage_costs, B, edges, INF)
    over = [i for i, m in enumerate(res.memory) if m > budget * (1 + 1e-9)]
    if over:
        i = over[0]
        raise PipelineError(
            f"pipeline: {method} stage {i} needs {res.memory[i]:.4g} bytes with the schedule's "
            f"{res.sim.peak_inflight[i]} in-flight micro-batches, over the budget {budget:.4g} the search "
            "checked; please report.")
    if sizes is not None:
        allowed = [[b for b in sizes if b >= d] for d in devs]
        res = refine_sizes(res, allowed, stage_costs, B, edges, budget)
    stages = tuple(GraphStage(i, tuple(nodes), devs[i], res.sizes[i], B // res.sizes[i], res.forward[i],
                              res.backward[i], res.memory[i]) for i, (nodes, _, _) in enumerate(raw))
    depth = int(nx.dag_longest_path_length(nx.DiGraph(list(edges)))) + 1 if edges else 1
    step = float(res.sim.makespan)
    tps = max(float(costs_at(b).tps[r, d]) for r, d, b in zip(rows, devs, res.sizes, strict=True))
    return GraphPipePlan(method, stages, edges, depth, tps, step, B / step, res.schedule,
                         time.perf_counter() - t0, D, B)


def _fmt(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.3g} B"


def _infeasible(graph: LayerGraph, prob: _Problem, hw: HardwareSpec, D: int, B: int, budget: float,
                max_mb: int | None, method: str) -> InfeasiblePlanError:
    """No micro-batch size admits a partition that fits: find the least peak memory any partition
    reaches (smallest micro-batch, no time target: binary search on the budget) for the message."""
    b = _microbatch_sizes(B, max_mb)[0]
    costs = _Costs(prob, hw, D, b, B, INF)
    mems = np.unique(costs.mem[np.isfinite(costs.tps)])
    lo, hi = 0, mems.size - 1
    while lo < hi:
        mid = (lo + hi) // 2
        costs.set_budget(float(mems[mid]))
        if _DP(prob, costs, D, INF).feasible():
            hi = mid
        else:
            lo = mid + 1
    best = float(mems[lo]) if mems.size else INF
    name = graph.name or "<unnamed>"
    return InfeasiblePlanError(
        f"{method}_partition: no partition of graph {name!r} ({len(graph)} nodes, batch {B}) on {D} devices fits "
        f"the memory budget of {_fmt(budget)} per device; the least peak memory found is {_fmt(best)} per "
        f"device (micro-batch {b}). Raise memory_budget to at least that, use more devices, or shrink the "
        "model or batch.", min_memory=best, budget=budget)
