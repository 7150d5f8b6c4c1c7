"""group(): TAP's PruneGraph over an OpGraph (pure: no jax import).

TAP (§4.3, Algorithm 1) walks the module tree and groups nodes whose names share a prefix and whose
operator composition is similar; a model that is one block repeated L times then needs a sharding
search over one block, whatever L is. Here:

* the module tree comes from op module paths (name scopes, or parameter attribution for nnx and
  plain jax), so forward, backward and optimizer ops of a module sit under the same node;
* a node is a repetition candidate when its name is numbered (`block_3`, `layers_0`, nnx `blocks/3`)
  or when its ops run inside a loop (`nn.scan`: one node, trip-count instances);
* candidates with the same name stem and the same parameter shapes are compared by their *forward*
  op composition (primitive and shapes per relative sub-module), with a tolerance, because instances
  legitimately differ (the first block's backward lacks the input-gradient ops; loop-invariant ops
  are hoisted out of scans; the residual add of the last block can join the head);
* a group with at least `min_duplicate` instances is a block type at that depth; the shallowest
  types win, unless most of their forward ops lie in a deeper type's instances (a branch made of 8
  layers is reported as layers, so all branches share one type).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import re
from collections import Counter, defaultdict
from collections.abc import Iterable

import numpy as np

from .errors import GroupingError
from .graph import OpGraph, inputs_with_role
from .optable import PHASE_CODES

_NUMBERED = re.compile(r"^(.*?)(\d+)$")
PHASE_ORDER = ("forward", "backward", "optimizer", "other")


@dataclasses.dataclass(frozen=True)
class BlockInstance:
    """One occurrence of a block type: a module subtree (or one iteration of a scanned one)."""

    path: str
    ops: tuple[int, ...]
    iteration: int | None = None
    missing_forward_ops: int = 0     # vs the type's reference composition (tolerated differences)
    extra_forward_ops: int = 0


@dataclasses.dataclass(frozen=True)
class BlockType:
    """A unique block: its instances share forward composition and parameter shapes."""

    name: str
    depth: int
    signature: str
    instances: tuple[BlockInstance, ...]
    params: tuple[tuple[str, tuple[int, ...], str], ...]   # (relative keypath, shape, dtype)
    ops_per_phase: dict[str, int]                          # of the reference instance
    flops_per_instance: float
    scanned: bool = False

    @property
    def count(self) -> int:
        return len(self.instances)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A repeated group found at one depth of the module tree (reported, maybe not selected)."""

    name: str
    depth: int
    count: int
    forward_ops: int
    selected: bool


@dataclasses.dataclass(frozen=True)
class Grouping:
    """Contract: `block_types` (each with `.instances`), plus the remainder and per-depth report."""

    graph: OpGraph
    block_types: tuple[BlockType, ...]
    remainder: tuple[int, ...]
    levels: tuple[Candidate, ...]
    min_duplicate: int

    def block_of(self, op_index: int) -> tuple[int, int] | None:
        """(block type index, instance index) of an op; None for remainder ops. For ops of a
        scanned block, the first instance."""
        types, insts = self._op_block
        t = int(types[op_index])
        return None if t < 0 else (t, int(insts[op_index]))

    @property
    def _op_block(self) -> tuple[np.ndarray, np.ndarray]:
        """Per op, its block type and instance (-1: the remainder), as two columns: built once, from each
        instance's op array (a dict over every op of a deep step cost more than the passes asking it)."""
        cache = self.__dict__.get("_op_block_cache")
        if cache is None:
            n = len(self.graph.ops)
            types, insts = np.full(n, -1, dtype=np.int32), np.full(n, -1, dtype=np.int32)
            # the first instance holding an op wins (a scanned block's instances share their ops):
            # filled last instance first, each overwriting
            for t in reversed(range(len(self.block_types))):
                matrix, row_of = self.op_rows(t)
                for i, inst in reversed(list(enumerate(self.block_types[t].instances))):
                    ops = matrix[row_of[i]] if row_of[i] >= 0 else np.asarray(inst.ops, dtype=np.int64)
                    types[ops], insts[ops] = t, i
            cache = (types, insts)
            object.__setattr__(self, "_op_block_cache", cache)
        return cache

    def op_rows(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """The ops of the instances of block type `t` that have its most common op count, as one int64 matrix
        (row x op, program order), and per instance its row (-1: another count). Set by `group` from its own
        arrays, or built here."""
        return self.memo(("op rows", t), lambda: _op_rows([inst.ops for inst in self.block_types[t].instances]))

    def memo(self, key: tuple, make):
        """`make()`, computed once per grouping and `key`: the analyses of its blocks (representative
        instances, factors, periods) that every planner of one step asks for again."""
        cache = self.__dict__.get("_memo")
        if cache is None:
            cache = {}
            object.__setattr__(self, "_memo", cache)
        if key not in cache:
            cache[key] = make()
        return cache[key]

    def summary(self) -> dict:
        """JSON-able summary (for benches and the CLI)."""
        g = self.graph
        return {
            "ops": len(g.ops),
            "block_types": [
                {"name": bt.name, "depth": bt.depth, "instances": bt.count,
                 "scanned": bt.scanned, "signature": bt.signature,
                 "ops_per_instance": bt.ops_per_phase,
                 "params_per_instance": len(bt.params),
                 "gflops_per_instance": bt.flops_per_instance / 1e9}
                for bt in self.block_types],
            "remainder_ops": len(self.remainder),
            "levels": [dataclasses.asdict(c) for c in self.levels],
        }

    def table(self) -> str:
        """The block table: one row per unique block type, then the remainder and depth report."""
        rows = [("block type", "depth", "instances", "fwd", "bwd", "opt", "params", "GFLOP/inst")]
        for bt in self.block_types:
            p = bt.ops_per_phase
            inst = f"{bt.count}" + (" (scan)" if bt.scanned else "")
            rows.append((bt.name, str(bt.depth), inst, str(p["forward"]), str(p["backward"]),
                         str(p["optimizer"]), str(len(bt.params)),
                         f"{bt.flops_per_instance / 1e9:.4g}"))
        rem = Counter(self.graph.ops[i].phase for i in self.remainder)
        rows.append(("(remainder)", "-", "1", str(rem["forward"]), str(rem["backward"]),
                     str(rem["optimizer"]), "-", "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append("")
        lines.append(f"repeated groups by depth (min_duplicate={self.min_duplicate}):")
        for c in self.levels:
            mark = "selected" if c.selected else "-"
            lines.append(f"  depth {c.depth}: {c.name} x{c.count} "
                         f"({c.forward_ops} forward ops) {mark}")
        return "\n".join(lines)


def _stem(name: str) -> str | None:
    m = _NUMBERED.match(name)
    return m.group(1) if m else None


def _natural(node: tuple[str, ...]) -> tuple:
    """Sort key putting block_2 before block_10."""
    out = []
    for comp in node:
        m = _NUMBERED.match(comp)
        out.append((m.group(1), int(m.group(2))) if m else (comp, -1))
    return tuple(out)


def _common_prefix(paths: list[tuple[str, ...]]) -> tuple[str, ...]:
    first, last = paths[0], paths[-1]  # sorted: their common prefix is everyone's
    i = 0
    while i < min(len(first), len(last)) and first[i] == last[i]:
        i += 1
    return first[:i]


def _pattern(paths: Iterable[tuple[str, ...]]) -> str:
    paths = list(paths)
    out = []
    for comps in zip(*paths, strict=True):
        if len(set(comps)) == 1:
            out.append(comps[0])
        else:
            stems = {_stem(c) for c in comps}
            out.append((stems.pop() or "") + "*" if len(stems) == 1 and None not in stems else "*")
    return "/".join(out)


_Node = tuple[str, ...]
# (depth, member nodes, reference forward composition, per member (missing, extra) forward ops)
_Cluster = tuple[int, list[_Node], Counter, dict[_Node, tuple[int, int]]]


def group(graph: OpGraph, min_duplicate: int = 2, tolerance: float = 0.1,
          descend_fraction: float = 0.8) -> Grouping:
    """Group `graph` into unique block types with their instances (TAP PruneGraph).

    min_duplicate: a group needs at least this many instances to be a block type (TAP's
        minDuplicate). tolerance: the largest fraction of forward ops by which an instance may
        differ from its type's reference composition. descend_fraction: a candidate whose forward
        ops lie at least this much in deeper candidates' instances is reported as those instead.
    """
    if not isinstance(min_duplicate, int) or min_duplicate < 2:
        raise GroupingError(f"autoshard.group: min_duplicate={min_duplicate!r} must be an int >= 2 "
                            "(a block type needs at least two instances).")
    if not 0.0 <= tolerance < 1.0:
        raise GroupingError(f"autoshard.group: tolerance={tolerance!r} must be in [0, 1).")
    tree = _ModuleTree(graph, tolerance)
    clusters = _cluster_by_composition(_candidate_buckets(tree), tree, tolerance)
    repeated = _repeated_clusters(clusters, tree, min_duplicate)
    block_types, levels = _select_block_types(repeated, tree, descend_fraction)
    in_block = np.zeros(len(graph.ops), dtype=bool)
    for bt in block_types:
        for path in dict.fromkeys(inst.path for inst in bt.instances):      # a scanned body's instances share ops
            in_block[tree.node_ops(tuple(path.split("/")))] = True
    remainder = tuple(np.flatnonzero(~in_block).tolist())
    levels.sort(key=lambda c: (c.depth, c.name))
    out = Grouping(graph, tuple(block_types), remainder, tuple(levels), min_duplicate)
    for t, bt in enumerate(block_types):     # the instances' ops as a matrix, from the arrays they were made of
        arrays = [tree.node_ops(tuple(inst.path.split("/"))) for inst in bt.instances]
        out.memo(("op rows", t), lambda arrays=arrays: _op_rows(arrays))
    return out


def _op_rows(ops: list) -> tuple[np.ndarray, np.ndarray]:
    """(matrix of the op sequences of the most common length, row per sequence or -1): Grouping.op_rows."""
    counts = Counter(len(o) for o in ops)
    n = counts.most_common(1)[0][0] if counts else 0
    row_of = np.full(len(ops), -1, dtype=np.int64)
    chosen = [k for k, o in enumerate(ops) if len(o) == n]
    row_of[chosen] = np.arange(len(chosen))
    if not chosen or isinstance(ops[chosen[0]], np.ndarray):
        matrix = np.stack([ops[k] for k in chosen]) if chosen else np.zeros((0, 0), dtype=np.int64)
    else:
        flat = np.fromiter(itertools.chain.from_iterable(ops[k] for k in chosen), dtype=np.int64)
        matrix = flat.reshape(len(chosen), n)
    return matrix, row_of


class _ModuleTree:
    """The module tree of a graph, precomputed once: ops and forward composition per module,
    parameters per module, and the trip count of the loop bodies (nn.scan) among its nodes."""

    def __init__(self, graph: OpGraph, tolerance: float) -> None:
        self.graph, self.ops = graph, graph.ops
        # ops by module, in order of the modules' first ops (the table numbers modules so): one stable sort
        t = graph.table()
        order = np.argsort(t.module, kind="stable")
        ends = np.cumsum(np.bincount(t.module, minlength=len(t.modules))).tolist()
        starts = [0, *ends[:-1]] if ends else []
        self.by_module: dict[_Node, np.ndarray] = {tuple(m.split("/")) if m else (): order[start:end] for m, start, end
                                                   in zip(t.modules, starts, ends, strict=True)}
        self.node_modules: dict[_Node, list[_Node]] = defaultdict(list)
        for mod in self.by_module:
            for d in range(1, len(mod) + 1):
                self.node_modules[mod[:d]].append(mod)
        self.fwd_key, self.kinds = _forward_compositions(graph, self.by_module)
        self.fwd_count = {mod: sum(c.values()) for mod, c in self.fwd_key.items()}
        self.fwd_ids: dict[_Node, int] | None = None
        self.node_op_arrays: dict[_Node, np.ndarray] = {}
        self.param_ids: dict[_Node, int] | None = None
        self.fwd_totals: dict[_Node, int] = {}
        self.params_of = _params_by_module(graph)
        self.trip_of = _loop_bodies(self, tolerance)

    def fwd_total(self, node: _Node) -> int:
        """Forward ops under the node."""
        hit = self.fwd_totals.get(node)
        if hit is None:
            hit = self.fwd_totals[node] = sum(self.fwd_count[m] for m in self.node_modules[node])
        return hit

    def composition_id(self, node: _Node) -> frozenset:
        """A key equal for two nodes exactly when their `composition`s are: (relative path, interned forward
        composition) of each module under the node with forward ops (each module's relative path is its own)."""
        ids = self.fwd_ids
        if ids is None:
            interned: dict[frozenset, int] = {}
            ids = self.fwd_ids = {mod: interned.setdefault(frozenset(c.items()), len(interned))
                                  for mod, c in self.fwd_key.items() if c}
        return frozenset(("/".join(mod[len(node):]), ids[mod]) for mod in self.node_modules[node] if mod in ids)

    def composition(self, node: _Node) -> Counter:
        """Forward op kinds under the node, by sub-module relative to it."""
        # each module has its own relative path: its (path, kind) keys are the node's once
        out: dict[tuple[str, int], int] = {}
        for mod in self.node_modules[node]:
            rel = "/".join(mod[len(node):])
            out.update({(rel, k): n for k, n in self.fwd_key[mod].items()})
        return Counter(out)

    def param_sig(self, node: _Node) -> tuple:
        """Sorted (relative keypath, shape, dtype) of the parameters under the node."""
        out = []
        for mod in self.node_modules[node]:
            rel = "/".join(mod[len(node):])
            for leaf, shape, dtype in self.params_of.get(mod, ()):
                out.append((f"{rel}/{leaf}" if rel else leaf, shape, dtype))
        return tuple(sorted(out))

    def param_sig_id(self, node: _Node) -> frozenset:
        """A key equal for two nodes exactly when their `param_sig`s are: (relative path, interned parameter
        list) of each module under the node holding parameters."""
        ids = self.param_ids
        if ids is None:
            interned: dict[tuple, int] = {}
            ids = self.param_ids = {mod: interned.setdefault(tuple(sorted(ps)), len(interned))
                                    for mod, ps in self.params_of.items()}
        return frozenset(("/".join(mod[len(node):]), ids[mod]) for mod in self.node_modules[node] if mod in ids)

    def node_ops(self, node: _Node) -> np.ndarray:
        """Indices of all ops under the node, in program order (int64; do not modify)."""
        hit = self.node_op_arrays.get(node)
        if hit is None:
            parts = [self.by_module[mod] for mod in self.node_modules[node]]
            hit = self.node_op_arrays[node] = np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
        return hit

    def multiplicity(self, node: _Node) -> int:
        """How many times the node's body runs per step: product of enclosing layer loops."""
        mult = 1
        for k in range(1, len(node) + 1):
            mult *= self.trip_of.get(node[:k], 1)
        return mult

    def instance_count(self, members: list[_Node]) -> int:
        """Instances of a group: its members times their loop multiplicities."""
        return sum(self.multiplicity(n) for n in members)


def _forward_compositions(graph: OpGraph, by_module: dict[_Node, np.ndarray]
                          ) -> tuple[dict[_Node, dict[int, int]], list[tuple]]:
    """Per module, the count of each forward op kind (primitive, shapes) by interned id; and the
    kinds, indexed by id. Forward ops that only feed the backward pass (the residuals of an input
    gradient, which the first block of a network fed by data does not compute) are left out: they
    are what legitimately differs between the first instance and the others."""
    t = graph.table()
    fwd = t.phase == PHASE_CODES["forward"]
    # reaches a step output through forward ops only: one walk up the forward edges from the ops writing one
    writers = t.producers_of(graph.outputs)
    writers = writers[writers >= 0]
    feeds_forward = t.feeding(np.unique(writers[fwd[writers]]), fwd)
    if feeds_forward.sum() * 2 < fwd.sum():  # the step returns no loss: nothing to tell residuals by
        feeds_forward = fwd
    # count each (module, kind) pair among them: one sort of pair ids, not a dict update per op
    counted = np.flatnonzero(feeds_forward)
    n_kinds = max(len(t.kinds), 1)
    pairs, counts = np.unique(t.module[counted].astype(np.int64) * n_kinds + t.kind[counted], return_counts=True)
    nodes = [tuple(m.split("/")) if m else () for m in t.modules]      # by module id
    fwd_key: dict[_Node, dict[int, int]] = {node: {} for node in by_module}
    mods, kinds = (pairs // n_kinds).tolist(), (pairs % n_kinds).tolist()
    starts = np.flatnonzero(np.diff(pairs // n_kinds, prepend=-1)).tolist()      # pairs sort by module first
    counts_l = counts.tolist()
    for a, b in zip(starts, [*starts[1:], len(mods)][:len(starts)], strict=True):
        fwd_key[nodes[mods[a]]] = dict(zip(kinds[a:b], counts_l[a:b], strict=True))
    return fwd_key, list(t.kinds)  # kind id -> (primitive, in_shapes, out_shapes)


def _params_by_module(graph: OpGraph) -> dict[_Node, list[tuple[str, tuple[int, ...], str]]]:
    """(leaf name, shape, dtype) of the parameters of each module."""
    params_of: dict[_Node, list[tuple[str, tuple[int, ...], str]]] = defaultdict(list)
    for vid in inputs_with_role(graph, "parameter"):
        v = graph.values[vid]
        m = v.module
        leaf = str(v.keypath_parts[-1]) if v.keypath_parts else ""
        if leaf in (".value", ".raw_value") and len(v.keypath_parts) > 1:
            leaf = str(v.keypath_parts[-2])
        params_of[tuple(m.split("/"))].append((leaf, v.shape, v.dtype))
    return params_of


def _loop_bodies(tree: _ModuleTree, tolerance: float) -> dict[_Node, int]:
    """Trip count of each node that is the body of a loop over layers (nn.scan)."""
    # Loops over layers (nn.scan): each loop of forward ops with a known trip count >= 2 has a
    # body node, the longest common module prefix of its forward ops ("GPT/blocks"). The node must
    # be (nearly) all loop: invariants hoisted out of the body are tolerated, other content not.
    loop_mods: dict[int, set[_Node]] = defaultdict(set)
    loop_trip: dict[int, int] = {}
    loop_ops: Counter = Counter()
    mods: dict[str, _Node] = {}      # most steps have no loops: one quick filter over the ops
    t = tree.graph.table()
    for op in map(tree.ops.__getitem__, np.flatnonzero(t.looped & (t.phase == PHASE_CODES["forward"])).tolist()):
        mod = mods.get(op.module)
        if mod is None:
            mod = mods[op.module] = tuple(op.module.split("/")) if op.module else ()
        for loop in op.loops:        # the order is immaterial: sets, counts, then sorted by uid
            if loop.trip_count and loop.trip_count >= 2:
                loop_mods[loop.uid].add(mod)
                loop_trip[loop.uid] = loop.trip_count
                loop_ops[loop.uid] += 1
    trip_of: dict[_Node, int] = {}
    best_loop: dict[_Node, int] = {}
    for uid in sorted(loop_mods):
        node = _common_prefix(sorted(loop_mods[uid]))
        if not node or loop_ops[uid] < (1.0 - tolerance) * tree.fwd_total(node):
            continue
        if node not in best_loop or loop_ops[uid] > loop_ops[best_loop[node]]:
            best_loop[node], trip_of[node] = uid, loop_trip[uid]
    return trip_of


def _candidate_buckets(tree: _ModuleTree) -> dict[tuple, list[_Node]]:
    """Candidate groups per depth: loop bodies and numbered nodes, by name stem and parameters."""
    buckets: dict[tuple, list[_Node]] = defaultdict(list)
    for node in tree.node_modules:
        if not tree.fwd_total(node):
            continue  # no forward ops: nothing to search over
        stem = _stem(node[-1])
        if node in tree.trip_of:
            buckets[(len(node), "scan:" + node[-1], tree.param_sig_id(node))].append(node)
        elif stem is not None:
            buckets[(len(node), stem, tree.param_sig_id(node))].append(node)
    return buckets


def _cluster_by_composition(buckets: dict[tuple, list[_Node]], tree: _ModuleTree,
                            tolerance: float) -> list[_Cluster]:
    """Split each bucket into clusters of nodes within `tolerance` of the most common exact
    forward composition among the nodes not yet clustered."""
    clusters: list[_Cluster] = []
    for (depth, _, _), nodes in buckets.items():
        # compositions compared by key: most nodes have the most common one (no differences to count)
        keys = {n: tree.composition_id(n) for n in nodes}
        comps: dict[_Node, Counter] = {}
        remaining = sorted(nodes, key=_natural)
        while remaining:
            exact = Counter(keys[n] for n in remaining)
            ref_key = exact.most_common(1)[0][0]
            ref = tree.composition(next(n for n in remaining if keys[n] == ref_key))
            size = max(sum(ref.values()), 1)
            members, diffs, rest = [], {}, []
            for n in remaining:
                missing = extra = 0
                if keys[n] != ref_key:
                    if n not in comps:
                        comps[n] = tree.composition(n)
                    missing, extra = sum((ref - comps[n]).values()), sum((comps[n] - ref).values())
                if (missing + extra) <= tolerance * size:
                    members.append(n)
                    diffs[n] = (missing, extra)
                else:
                    rest.append(n)
            clusters.append((depth, members, ref, diffs))
            remaining = rest
    return clusters


def _repeated_clusters(clusters: list[_Cluster], tree: _ModuleTree, min_duplicate: int) -> list[_Cluster]:
    """Clusters with at least `min_duplicate` instances: shallowest first, then most instances."""
    repeated = [c for c in clusters if tree.instance_count(c[1]) >= min_duplicate]
    repeated.sort(key=lambda c: (c[0], -tree.instance_count(c[1]), _natural(c[1][0])))
    return repeated


def _best_inner_coverage(depth: int, members: list[_Node], repeated: list[_Cluster],
                         fwd_count: dict[_Node, int]) -> float:
    """Largest share of the members' forward ops held by one deeper repeated group."""
    total = sum(fwd_count[m] for m in members) or 1
    best = 0
    member_set = set(members)
    for d2, inner, _, _ in repeated:
        if d2 <= depth:
            continue
        held = sum(fwd_count[n] for n in inner if n[:depth] in member_set)
        best = max(best, held)
    return best / total


def _select_block_types(repeated: list[_Cluster], tree: _ModuleTree,
                        descend_fraction: float) -> tuple[list[BlockType], list[Candidate]]:
    """Walk the repeated clusters shallowest first: a cluster becomes a block type unless it lies
    inside one already selected or most of its forward ops lie in a deeper cluster. Returns the
    block types and every cluster as a Candidate (unsorted)."""
    # forward ops of each repeated node, to decide when to descend
    fwd_count = {n: tree.fwd_total(n) for c in repeated for n in c[1]}
    selected_paths: set[_Node] = set()
    block_types: list[BlockType] = []
    levels: list[Candidate] = []
    for depth, members, ref, diffs in repeated:
        name = _pattern(members)
        if members[0] in tree.trip_of:
            name += f"[scan x{tree.trip_of[members[0]]}]"
        fwd = sum(ref.values())
        inside = any(m[:d] in selected_paths for m in members for d in range(len(m) + 1))
        descend = not inside and _best_inner_coverage(depth, members, repeated, fwd_count) >= descend_fraction
        select = not inside and not descend
        levels.append(Candidate(name, depth, tree.instance_count(members), fwd, select))
        if not select:
            continue
        selected_paths.update(members)
        block_types.append(_block_type(name, depth, members, ref, diffs, tree))
    return block_types, levels


def _block_type(name: str, depth: int, members: list[_Node], ref: Counter,
                diffs: dict[_Node, tuple[int, int]], tree: _ModuleTree) -> BlockType:
    """The BlockType of a selected cluster: its instances (one per loop iteration of scanned
    members), and ops per phase, FLOPs and signature of a reference member."""
    instances: list[BlockInstance] = []
    for m in members:
        o = tuple(tree.node_ops(m).tolist())
        miss, extra = diffs[m]
        mult = tree.multiplicity(m)
        for it in range(mult) if mult > 1 else [None]:
            instances.append(BlockInstance("/".join(m), o, it, miss, extra))
    # describe the type by a member that matches the reference composition exactly
    ref_node = next((m for m in members if diffs[m] == (0, 0)), members[0])
    per_phase = dict.fromkeys(PHASE_ORDER, 0)
    flops = 0.0
    ops = tree.ops
    for i in tree.node_ops(ref_node).tolist():
        per_phase[ops[i].phase] += 1
        flops += ops[i].flops * ops[i].repeat
    flops /= tree.multiplicity(ref_node)
    psig = tree.param_sig(ref_node)
    composition_key = sorted((rel, tree.kinds[k], n) for (rel, k), n in ref.items())
    digest = hashlib.sha1(repr((composition_key, psig)).encode()).hexdigest()[:12]
    return BlockType(name, depth, digest, tuple(instances), psig, per_phase,
                     flops, scanned=any(tree.multiplicity(m) > 1 for m in members))
