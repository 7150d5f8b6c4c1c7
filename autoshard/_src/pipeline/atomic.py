"""RaNNC atomic-level partitioning (Tanaka et al., §III-A) over an OpGraph (pure: no jax import).

The partition is found on the *forward* part of the traced step:

1. Forward reachability from the model's data inputs (`Value.role == "data"`) marks the
   *non-constant* tasks: forward ops with an input that is data or the output of a non-constant op.
   Every other forward op is *constant* (it depends only on parameters, literals and constants:
   parameter transposes and casts, `iota`-based position tables, broadcast literals).
2. A backward pass (reverse program order, which is reverse topological order) forms one atomic
   component per non-constant task. A constant op joins the component(s) its forward consumers are
   in; when they are in several components the op is *cloned*: each of those components holds a
   copy (recorded in `AtomicPartition.clones`; its cost counts once in each), and so do its constant
   predecessors, exactly as the paper clones a constant task "and its (constant) predecessors".

Every component holds exactly one non-constant task, and values cross between components only
along edges between non-constant tasks (constant outputs never leave their component). Components
are numbered in program order of their task, a topological order.

The backward, optimizer and other ops, and *orphan* constants (forward constants none of whose
forward consumers is in a component, e.g. a transpose only the backward pass reads), are then
*attached* to the component of the forward op they differentiate or update (constants feeding an
orphan are cloned into the orphan's component too). The rule, first match:

a. an op reading a parameter, or optimizer state matched to a parameter (same module, same leaf
   name and shape; `mu['fc1']['kernel']` ↔ `params['fc1']['kernel']`), joins the parameter's owner:
   the first component whose forward ops read it (a tied embedding belongs to its first use);
b. (reverse program order) an op all of whose consumers were attached by (a)/(b) to one component,
   with a compatible module (unset, equal, or a submodule of the task's), joins it: a weight
   gradient flows only into its kernel's update, so `dW = xᵀ·g` joins the matmul that owns W;
c. (program order) an op whose module is the module of some tasks joins the one it reads forward
   values from (a saved activation: `tanh'` reads the tanh output), else the one its already
   attached producers are in, else the last of them;
d. anything left inherits the component of its most recently produced attached producer, else the
   last component (the loss).

Rules (a)–(b) are exact for parameter-owning ops; (c)–(d) are heuristics that err by at most a few
components, which matters only at block and stage boundaries.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from ..core.errors import PipelineError
from ..core.graph import OpGraph

_VALUE_LEAVES = (".value", ".raw_value")


class PipelineError(PipelineError):
    """The OpGraph cannot be partitioned for a pipeline (e.g. no forward op depends on data)."""


@dataclasses.dataclass(frozen=True, eq=False)
class AtomicPartition:
    """Atomic components of a traced step: component c holds the non-constant forward op
    `tasks[c]`, the constant forward ops `constants[c]` (clones appear in several components) and
    the backward/optimizer/other ops `attached[c]`. `edges` maps (producer component, consumer
    component) to the bytes of the values passed (each value once per consumer component)."""

    graph: OpGraph
    tasks: tuple[int, ...]
    constants: tuple[tuple[int, ...], ...]
    attached: tuple[tuple[int, ...], ...]
    component_of: dict[int, int]              # task and attached op -> component
    clones: dict[int, tuple[int, ...]]        # constant op held by several components -> them
    edges: dict[tuple[int, int], int]
    rule_counts: dict[str, int]               # how many ops each attachment rule placed
    _succ: list[list[int]] = dataclasses.field(default_factory=list, repr=False)
    _pred: list[list[int]] = dataclasses.field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        succ: list[list[int]] = [[] for _ in self.tasks]
        pred: list[list[int]] = [[] for _ in self.tasks]
        for a, b in sorted(self.edges):
            succ[a].append(b)
            pred[b].append(a)
        object.__setattr__(self, "_succ", succ)
        object.__setattr__(self, "_pred", pred)

    def __len__(self) -> int:
        return len(self.tasks)

    def successors(self, c: int) -> list[int]:
        return self._succ[c]

    def predecessors(self, c: int) -> list[int]:
        return self._pred[c]

    def ops(self, c: int) -> tuple[int, ...]:
        """All op indices of component c (task, constants including clones, attached), sorted."""
        return tuple(sorted((self.tasks[c], *self.constants[c], *self.attached[c])))

    def components_of(self, op: int) -> tuple[int, ...]:
        """The component(s) holding op: one, except for cloned constants; () for none."""
        if op in self.component_of:
            return (self.component_of[op],)
        if op in self.clones:
            return self.clones[op]
        return self._constant_home.get(op, ())

    @property
    def _constant_home(self) -> dict[int, tuple[int, ...]]:
        cache = self.__dict__.get("_home_cache")
        if cache is None:
            cache = {o: (c,) for c, ops in enumerate(self.constants) for o in ops if o not in self.clones}
            object.__setattr__(self, "_home_cache", cache)
        return cache

    def is_convex(self, components: Iterable[int]) -> bool:
        """No path of the component DAG leaves the set and re-enters it. Components are numbered
        topologically, so a re-entering path only visits nodes between the set's min and max."""
        inside = set(components)
        if not inside:
            return True
        hi = max(inside)
        stack = [s for c in inside for s in self._succ[c] if s not in inside and s < hi]
        seen = set(stack)
        while stack:
            n = stack.pop()
            for s in self._succ[n]:
                if s in inside:
                    return False
                if s < hi and s not in seen:
                    seen.add(s)
                    stack.append(s)
        return True

    def summary(self) -> dict:
        return {"components": len(self.tasks), "constant_ops": len({o for c in self.constants for o in c}),
                "cloned_ops": len(self.clones), "clone_copies": sum(len(v) for v in self.clones.values()),
                "attached_ops": sum(len(a) for a in self.attached), "edges": len(self.edges),
                "attachment_rules": dict(self.rule_counts)}


def _leaf(parts: tuple) -> str:
    parts = tuple(parts)
    while parts and parts[-1] in _VALUE_LEAVES:
        parts = parts[:-1]
    return str(parts[-1]).lstrip(".") if parts else ""


def _compatible(op_module: str, task_module: str) -> bool:
    """The op's module is unset, the task's, or inside it."""
    return not op_module or op_module == task_module or op_module.startswith(task_module + "/")


def forward_ops(graph: OpGraph) -> np.ndarray:
    """Boolean mask of the forward part: phase "forward", plus "other" ops feeding it."""
    ops = graph.ops
    fwd = np.array([op.phase == "forward" for op in ops], dtype=bool)
    for op in reversed(ops):
        if op.phase == "other" and any(fwd[c] for v in op.outputs for c in graph.values[v].consumers):
            fwd[op.index] = True
    return fwd


def non_constant_ops(graph: OpGraph, mask: np.ndarray | None = None) -> np.ndarray:
    """Ops (within `mask`, default all) reachable from the data inputs through ops in `mask`."""
    values, ops = graph.values, graph.ops
    mask = np.ones(len(ops), dtype=bool) if mask is None else mask
    dep = np.zeros(len(ops), dtype=bool)
    for op in ops:
        if not mask[op.index]:
            continue
        for v in op.inputs:
            val = values[v]
            p = val.producer
            if (p is None and val.kind == "input" and val.role == "data") or (p is not None and dep[p]):
                dep[op.index] = True
                break
    return dep


def atomic_partition(graph: OpGraph) -> AtomicPartition:
    """RaNNC's atomic components of `graph` (see the module docstring for the rules)."""
    ops, values = graph.ops, graph.values
    n = len(ops)
    fwd = forward_ops(graph)
    nonconst = non_constant_ops(graph, fwd)
    tasks = [i for i in range(n) if nonconst[i]]
    if not tasks:
        data = [values[v].keypath or f"value {v}" for v in graph.inputs if values[v].role == "data"]
        raise PipelineError(
            f"pipeline: no forward op of {graph.name or 'the graph'} depends on a data input (data inputs: "
            f"{data or 'none'}), so there is no non-constant task to form atomic components around. "
            "Trace the training step with its batch as an argument (role 'data'), not closed over.")
    comp = np.full(n, -1, dtype=np.int64)
    comp[tasks] = np.arange(len(tasks))

    # constants, reverse program order: the union of their forward consumers' components
    const_comps, orphans = _constant_homes(graph, fwd, comp, {})
    attached, rules = _attach(graph, tasks, comp, const_comps, fwd, nonconst, orphans)
    if orphans:   # constants feeding an orphan also go where the orphan was attached
        const_comps, _ = _constant_homes(graph, fwd, comp, {o: attached[o] for o in orphans})
    constants: list[list[int]] = [[] for _ in tasks]
    clones: dict[int, tuple[int, ...]] = {}
    for i in sorted(const_comps):
        cs = const_comps[i]
        if len(cs) > 1:
            clones[i] = cs
        for c in cs:
            constants[c].append(i)

    component_of = {t: c for c, t in enumerate(tasks)}
    att_lists: list[list[int]] = [[] for _ in tasks]
    for op_i, c in sorted(attached.items()):
        att_lists[c].append(op_i)
        component_of[op_i] = c

    edges: dict[tuple[int, int], int] = defaultdict(int)
    for c, t in enumerate(tasks):
        op = ops[t]
        for v in op.outputs:
            nb = values[v].nbytes * op.repeat
            dsts = {int(comp[d]) for d in values[v].consumers if nonconst[d]}
            for d in dsts:
                if d != c:
                    edges[(c, d)] += nb
    return AtomicPartition(graph, tuple(tasks), tuple(tuple(x) for x in constants),
                           tuple(tuple(x) for x in att_lists), component_of, clones, dict(edges), rules)


def _constant_homes(graph: OpGraph, fwd: np.ndarray, comp: np.ndarray,
                    orphan_home: dict[int, int]) -> tuple[dict[int, tuple[int, ...]], set[int]]:
    """Components of each constant forward op (reverse program order), and the orphans (constants
    without forward consumers in a component). `orphan_home`: known homes of orphans."""
    ops, values = graph.ops, graph.values
    homes: dict[int, tuple[int, ...]] = {}
    orphans: set[int] = set()
    for i in range(len(ops) - 1, -1, -1):
        if not fwd[i] or comp[i] >= 0 or i in orphan_home:
            continue
        acc: set[int] = set()
        for v in ops[i].outputs:
            for c in values[v].consumers:
                if not fwd[c]:
                    continue
                if comp[c] >= 0:
                    acc.add(int(comp[c]))
                elif c in orphan_home:
                    acc.add(orphan_home[c])
                else:
                    acc.update(homes.get(c, ()))
        if acc:
            homes[i] = tuple(sorted(acc))
        else:
            orphans.add(i)
    return homes, orphans


def _parameter_owners(graph: OpGraph, comp: np.ndarray, const_comps: dict[int, tuple[int, ...]],
                      fwd: np.ndarray, orphans: set[int]) -> dict[int, int]:
    """Owner component of each parameter input (the first component whose forward ops read it), and
    of optimizer state matched to its parameter by (module, leaf, shape) (rule a)."""
    values = graph.values

    def readers(v: int) -> list[int]:
        out: list[int] = []
        for c in values[v].consumers:
            if fwd[c] and c not in orphans:
                out.extend([int(comp[c])] if comp[c] >= 0 else const_comps.get(c, ()))
        return out

    owner: dict[int, int] = {}
    by_key: dict[tuple, int] = {}
    for v in graph.inputs:
        val = values[v]
        if val.role == "parameter":
            rs = readers(v)
            if rs:
                owner[v] = min(rs)
                by_key.setdefault((val.module, _leaf(val.keypath_parts), val.shape), v)
    for v in graph.inputs:
        val = values[v]
        if val.role == "state":
            p = by_key.get((val.module, _leaf(val.keypath_parts), val.shape))
            if p is not None:
                owner[v] = owner[p]
    return owner


def _attach_strong(graph: OpGraph, todo: list[int], owner: dict[int, int], task_module: list[str],
                   counts: dict[str, int]) -> dict[int, int]:
    """Rules a and b, in reverse program order: ops reading an owned input join its owner; ops
    all of whose consumers were so attached to one component with a compatible module join it."""
    ops, values = graph.ops, graph.values
    strong: dict[int, int] = {}
    for i in reversed(todo):
        op = ops[i]
        owners = [owner[v] for v in op.inputs if v in owner]
        if owners:
            strong[i] = min(owners)
            counts["parameter"] += 1
            continue
        cons = {c for v in op.outputs for c in values[v].consumers}
        if cons and all(c in strong for c in cons):
            targets = {strong[c] for c in cons}
            if len(targets) == 1:
                t = targets.pop()
                if _compatible(op.module, task_module[t]):
                    strong[i] = t
                    counts["consumers"] += 1
    return strong


def _attach_rest(graph: OpGraph, todo: list[int], out: dict[int, int], comp: np.ndarray,
                 const_comps: dict[int, tuple[int, ...]], nonconst: np.ndarray, task_module: list[str],
                 counts: dict[str, int]) -> None:
    """Rules c and d, in program order, for the ops of `todo` not in `out` yet (adds them to it)."""
    ops, values = graph.ops, graph.values
    last = len(task_module) - 1
    by_module: dict[str, list[int]] = defaultdict(list)
    for c, m in enumerate(task_module):
        by_module[m].append(c)
    for i in todo:
        if i in out:
            continue
        op = ops[i]
        fwd_hint: list[int] = []
        att_hint: list[tuple[int, int]] = []
        for v in op.inputs:
            p = values[v].producer
            if p is None:
                continue
            if nonconst[p]:
                fwd_hint.append(int(comp[p]))
            elif p in const_comps:
                fwd_hint.extend(const_comps[p])
            elif p in out:
                att_hint.append((p, out[p]))
        cands = by_module.get(op.module) if op.module else None
        if cands:
            cset = set(cands)
            hits = [c for c in fwd_hint if c in cset] or [c for _, c in att_hint if c in cset]
            out[i] = max(hits) if hits else cands[-1]
            counts["module"] += 1
        elif att_hint or fwd_hint:
            out[i] = max(att_hint)[1] if att_hint else max(fwd_hint)
            counts["producers"] += 1
        else:
            out[i] = last
            counts["fallback"] += 1


def _attach(graph: OpGraph, tasks: list[int], comp: np.ndarray, const_comps: dict[int, tuple[int, ...]],
            fwd: np.ndarray, nonconst: np.ndarray, orphans: set[int]) -> tuple[dict[int, int], dict[str, int]]:
    """Attachment of non-forward ops and orphan constants to components (rules a–d)."""
    ops = graph.ops
    todo = [op.index for op in ops if not fwd[op.index] or op.index in orphans]
    owner = _parameter_owners(graph, comp, const_comps, fwd, orphans)
    task_module = [ops[t].module for t in tasks]
    counts = dict.fromkeys(("parameter", "consumers", "module", "producers", "fallback"), 0)
    out = _attach_strong(graph, todo, owner, task_module, counts)
    _attach_rest(graph, todo, out, comp, const_comps, nonconst, task_module, counts)
    return out, counts
