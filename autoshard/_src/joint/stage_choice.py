"""The best tensor plan, storage mode and remat policy of a stage, by its units and in-flight count
(pure: no jax import).

A stage is a contiguous unit range; what it costs depends only on how many units of each kind it
holds (its composition), the micro-batch count M and how many micro-batches it keeps in flight q
(the schedule's). For every composition and every choice (plan p, storage z, remat r) the time per
micro-batch and the memory are linear in the kind arrays of `ShapeTables`:

    f = fwd / M + gather,   b = bwd / M + const + recompute(r),   tail = exposed sync + step
    value = f + b + tail / M                      (the step spreads over the M micro-batches)
    memory = static + transient(r) + q * held(r)  (held: saved activations per micro-batch in flight)

remat 'none' keeps every saved activation; 'selective' keeps all but the attention scores and
probabilities ([B, H, S, S] each: Korthikanti et al. 2022, arXiv:2205.05198 §4) and reruns their
forward (scores matmul, mask, softmax, dropout) in the backward pass, one unit at a time (the
recomputed scores are the transient); 'dots' keeps the matmul outputs and each unit's input and
recomputes the rest (jax.checkpoint_policies.dots_saveable); 'full' keeps only each unit's input
and recomputes its forward in the backward pass, one unit at a time (its activations are the
transient). Without attention 'selective' costs what 'none' does, and ties go to the policy
listed first in REMAT (fewest recomputes), so it is never chosen there.

Per composition the choices are sorted by value once; the best choice for any q is the first whose
memory allows q micro-batches in flight, found by binary search on the running maximum of that
allowance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from ..core.attention import selective_ops
from ..core.graph import OpGraph
from .tables import ShapeTables
from .units import Units

REMAT = ("none", "selective", "dots", "full")    # by how much they recompute: ties keep the first



def remat_notes(graph: OpGraph, units: Units, stages: Sequence) -> tuple[str, ...]:
    """A line per stage (`JointStage`s) whose remat 'selective' has nothing to recompute: none of its
    units holds an attention core, so it keeps every activation, as 'none' (the search itself never
    prefers it there; a caller's remat='selective' can force it)."""
    attn = selective_ops(graph)
    out = []
    for i, s in enumerate(stages):
        if s.remat == "selective" and not any(o in attn for u in range(s.start, s.stop) for o in units.ops[u]):
            out.append(f"stage {i} ({units.labels[s.start]} .. {units.labels[s.stop - 1]}): remat 'selective' "
                       "finds no attention scores to recompute there, so it runs as 'none' (keeps every activation)")
    return tuple(out)

class SortedParts:
    """One part (f, b, tail, memory terms) of every choice, read in each composition's sorted order:
    `parts[u, k]` is the part of composition u's k-th best choice, `parts[u]` its whole row, and
    `np.asarray(parts)` the [U, X] array. Gathered on access: the search reads a few choices per
    table (a point's stages), and sorting six parts of each of its ~300 tables up front cost more
    than building them."""

    __slots__ = ("raw", "order", "per")

    def __init__(self, raw: np.ndarray, order: np.ndarray, per: int = 1) -> None:
        self.raw, self.order, self.per = raw, order, per   # raw[u, x // per]: the part of choice x

    @property
    def shape(self) -> tuple[int, int]:
        return self.order.shape

    def __getitem__(self, index):
        if isinstance(index, tuple):
            u, k = index
            return self.raw[u, self.order[u, k] // self.per]
        return self.raw[index, self.order[index] // self.per]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = np.take_along_axis(self.raw, self.order // self.per, axis=1)
        return out if dtype is None else out.astype(dtype)


@dataclasses.dataclass
class ChoiceTable:
    """Per composition: choices sorted by value, their f/b/tail/memory parts and the running
    maximum of the in-flight allowance (`allow_max`, nondecreasing along the sorted order). Unsorted
    (`allow_max` None, `order` the identity): `best` scans per in-flight count instead, cheaper than
    sorting when a table answers a few counts."""

    value: np.ndarray           # [U, X] sorted ascending
    order: np.ndarray           # [U, X] choice index (p, z, r) flattened as ((p * Z) + z) * R + r
    allow_max: np.ndarray       # [U, X]
    f: SortedParts
    b: SortedParts
    tail: SortedParts
    static: SortedParts
    held: SortedParts           # bytes per micro-batch in flight
    transient: SortedParts
    shape: tuple[int, int, int]   # (plans, storage modes, remat policies)
    allow: np.ndarray | None = None   # [U, X] unsorted tables (allow_max None): each choice's allowance

    def best(self, qs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(value [Q, U], position [Q, U]) of each composition's best choice for each in-flight count
        in `qs` (value inf, position -1 where nothing fits); a position indexes `order` and the parts."""
        if self.allow_max is None:
            return self._best_unsorted(np.asarray(qs, dtype=np.float64))
        U, X = self.value.shape
        qs = np.asarray(qs, dtype=np.float64)
        # allow_max rows are nondecreasing: the first position reaching q = how many stay below it
        pos = (self.allow_max[None, :, :] < qs[:, None, None]).sum(axis=2)
        ok = pos < X
        idx = np.where(ok, pos, 0)
        val = np.take_along_axis(self.value, idx.T, axis=1).T
        return np.where(ok, val, np.inf), np.where(ok, pos, -1)

    def _best_unsorted(self, qs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`best` of an unsorted table: the least value among the choices allowing q, ties to the
        first choice (as the stable sort orders them). One scan finds each composition's best at the
        largest q; only choices below it that allow a smaller q but not the largest can beat it there,
        few enough to sort and scan once per q."""
        value, allow = self.value, self.allow
        rows = np.arange(value.shape[0])
        top = np.where(allow >= qs.max(), value, np.inf)
        x_top = top.argmin(axis=1)
        v_top = top[rows, x_top]
        val = np.repeat(v_top[None], len(qs), axis=0)
        pos = np.repeat(np.where(np.isfinite(v_top), x_top, -1)[None], len(qs), axis=0)
        u, x = np.nonzero((allow >= qs.min()) & (allow < qs.max()) & (value <= v_top[:, None]))
        if u.size == 0:
            return val, pos
        v, a = value[u, x], allow[u, x]
        o = np.lexsort((x, v, u))                    # by composition, value, choice
        u, x, v, a = u[o], x[o], v[o], a[o]
        starts = np.flatnonzero(np.r_[True, u[1:] != u[:-1]])
        n, idx = u.size, np.arange(u.size)
        for i, q in enumerate(qs):
            first = np.minimum.reduceat(np.where(a >= q, idx, n), starts)    # per composition
            hit = first < n
            fu, fx, fv = u[starts[hit]], x[first[hit]], v[first[hit]]
            cv, cx = val[i, fu], pos[i, fu]
            better = (fv < cv) | ((fv == cv) & (fx < cx))
            val[i, fu[better]], pos[i, fu[better]] = fv[better], fx[better]
        return val, pos


def compositions(tables: ShapeTables, comps: np.ndarray, kind_inputs: np.ndarray) -> dict[str, np.ndarray]:
    """The kind arrays summed over each composition in `comps` [U, K] -> [U, P, Z] (independent of
    the micro-batch count: computed once per submesh shape), plus the largest unit's activations
    and the units' input bytes per device. Plan-major, as `choice_table` orders the choices (it
    runs once per micro-batch count on contiguous arrays)."""
    v = tables.values
    out = {name: _summed(comps, v[name]) for name in v}
    present = comps > 0
    # the largest unit's activations: recomputed one unit at a time under remat
    out["unit_acts"] = _largest(present, v["acts"])
    out["unit_rest"] = _largest(present, v["acts"] - v["acts_dots"])
    out["unit_attn"] = _largest(present, v["acts_attn"])
    out = {name: np.ascontiguousarray(np.transpose(a, (0, 2, 1))) for name, a in out.items()}
    split = tables.batch_split * (tables.sequence_split if tables.sequence_split is not None else 1.0)
    out["inputs"] = np.broadcast_to((comps @ kind_inputs)[:, None, None] / split[None, :, None],
                                    out["fwd"].shape)
    return out


_HEAP_READY: list[bool] = []


def keep_heap_warm() -> None:
    """Let the allocator keep the search's freed tables for the next one (once per process).

    A 3-D search builds a few hundred choice tables of a few MB each (GPT-39B on 64 devices: 141
    compositions x 235 plans x 3 storage modes x 4 remat policies, 3.2 MB per array) and drops each
    before the next. glibc returns the top of its heap to the kernel whenever more than twice the
    largest freed mmap'ed block is free (M_TRIM_THRESHOLD, raised dynamically: glibc malloc.c,
    `free`'s "dynamic threshold"), so every table was page-faulted in afresh: 0.31M minor faults and
    0.6 s of kernel time in that search. Freeing one block of 30 MB (below glibc's 32 MB cap on the
    dynamic threshold) raises the threshold as any numpy program freeing a large array does; the
    block is never touched, so it costs no faults. Other allocators ignore it."""
    if not _HEAP_READY:
        block = np.empty(30 * 2**20 // 8)
        del block
        _HEAP_READY.append(True)


def _summed(comps: np.ndarray, kinds: np.ndarray) -> np.ndarray:
    """comps [U, K] @ kinds [K, Z, P] -> [U, Z, P], one kind at a time (few kinds, large tables:
    cheaper than einsum's generic loop)."""
    out = np.zeros((comps.shape[0], *kinds.shape[1:]))
    for k in range(comps.shape[1]):
        out += comps[:, k, None, None] * kinds[k][None]
    return out


def _largest(present: np.ndarray, kinds: np.ndarray) -> np.ndarray:
    """Per composition (`present` [U, K]), the largest of `kinds` [K, Z, P] over the kinds it holds
    (0 where it holds none)."""
    out = np.where(present[:, 0, None, None], kinds[0][None], 0.0)
    for k in range(1, present.shape[1]):
        np.maximum(out, np.where(present[:, k, None, None], kinds[k][None], 0.0), out=out)
    return out


def choice_table(c: dict[str, np.ndarray], microbatches: int, budget: float, remat: tuple[str, ...],
                 valid_plans: np.ndarray, overlap: float,
                 fits: Callable[[np.ndarray], bool] | None = None, sort: bool = True,
                 restricted: dict[str, np.ndarray] | None = None) -> ChoiceTable | None:
    """Every (plan, storage, remat) of every composition of `c` (`compositions`) at M = `microbatches`.
    `valid_plans[p]`: the plan splits a micro-batch evenly. `fits(most)`, given the most micro-batches
    in flight any choice of each composition allows, says whether any point could use the table: None
    is returned without sorting when it cannot (most of a large search's tables do not fit memory).
    `sort=False`: an unsorted table (see ChoiceTable). `restricted`: `c` over the valid plans only
    (`restrict`), for callers building many tables with one mask."""
    P = c["fwd"].shape[1]
    keep = np.flatnonzero(valid_plans)
    if keep.size == P:
        return _table(c, microbatches, budget, remat, overlap, fits, sort=sort)
    # only the plans that split a micro-batch evenly (the others can never be chosen): a smaller
    # table, its choices renumbered over all P plans for `split_choice`
    sub = _table(restrict(c, keep) if restricted is None else restricted, microbatches, budget, remat, overlap,
                 fits, sort=sort)
    if sub is None:
        return None
    _, Z, R = sub.shape
    if not sort:        # the identity order: renumber one row, shared by every composition
        flat = (keep[:, None] * (Z * R) + np.arange(Z * R)).reshape(-1)
        return dataclasses.replace(sub, order=np.broadcast_to(flat, sub.order.shape), shape=(P, Z, R))
    p, rest = np.divmod(sub.order, Z * R)
    return dataclasses.replace(sub, order=keep[p] * (Z * R) + rest, shape=(P, Z, R))


def restrict(c: dict[str, np.ndarray], keep: np.ndarray) -> dict[str, np.ndarray]:
    """The arrays of `c` over the plans `keep` only."""
    return {k: a[:, keep] for k, a in c.items()}


def cheapest_fitting(c: dict[str, np.ndarray], microbatches: int, budget: float, remat: tuple[str, ...],
                     valid_plans: np.ndarray, inflight: float) -> np.ndarray:
    """Per composition of `c`, the least value of a choice whose memory allows `inflight` micro-batches
    in flight (inf where none does): what `choice_table(...).best` gives, without sorting."""
    keep = np.flatnonzero(valid_plans)
    if keep.size == 0:
        return np.full(c["fwd"].shape[0], np.inf)
    return _table({k: a[:, keep] for k, a in c.items()}, microbatches, budget, remat, 0.0, None, inflight)


def _terms(c: dict[str, np.ndarray], microbatches: int, overlap: float, remat: tuple[str, ...]):
    """(f, tail, static [U, P, Z], per remat policy a thunk of its (b, held, transient))."""
    phi = 1.0 / microbatches
    fwd, bwd, dots, const = c["fwd"], c["bwd"], c["fwd_dots"], c["const"]
    f = phi * fwd + c["gather"]
    b_base = phi * bwd + const
    tail = np.maximum(0.0, c["sync"] - overlap * phi * bwd) + c["step"]
    acts, acts_dots, data, inputs = c["acts"], c["acts_dots"], c["data"], c["inputs"]
    parts = {"none": lambda: (b_base, phi * (acts + data), 0.0 * acts),
             "selective": lambda: (b_base + phi * c["fwd_attn"], phi * (acts - c["acts_attn"] + data),
                                   phi * c["unit_attn"]),
             "dots": lambda: (b_base + phi * (fwd - dots), phi * (acts_dots + inputs + data), phi * c["unit_rest"]),
             "full": lambda: (b_base + phi * fwd, phi * (inputs + data), phi * c["unit_acts"])}
    return f, tail, c["static"], [parts[r] for r in remat]


def _allowance(budget: float, static: np.ndarray, held: np.ndarray, transient: np.ndarray,
               value: np.ndarray) -> np.ndarray:
    """Micro-batches in flight the memory allows: room / held, or +-inf when a choice holds nothing."""
    room = budget - static - transient
    allow = np.where(room >= 0, np.inf, -np.inf)
    np.divide(room, held, out=allow, where=held > 0)
    allow[~np.isfinite(value)] = -np.inf
    return allow


def _table(c: dict[str, np.ndarray], microbatches: int, budget: float, remat: tuple[str, ...], overlap: float,
           fits: Callable[[np.ndarray], bool] | None, cheapest_at: float | None = None, sort: bool = True):
    """`choice_table` over plans that are all valid (`cheapest_at`: `cheapest_fitting`'s answer instead)."""
    if cheapest_at is None and (c["fwd"].shape[0] > 1 or not sort):
        return _lean(c, microbatches, budget, remat, overlap, fits, sort)
    # the [U, P, Z] arrays are plan-major, so every [U, P, Z, R] array below is already laid out as
    # the flat [U, X] choices (the search builds ~300 tables: no copies per array)
    f, tail, static, thunks = _terms(c, microbatches, overlap, remat)
    per_remat = [t() for t in thunks]
    b, held, transient = (np.stack([pr[i] for pr in per_remat], axis=-1) for i in range(3))    # [U, P, Z, R]
    value = np.add(f[..., None], b)
    value += (tail / microbatches)[..., None]
    allow = _allowance(budget, static[..., None], held, transient, value)
    U, P, Z, R = b.shape
    X = P * Z * R
    if cheapest_at is not None:
        return np.where(allow >= cheapest_at, value, np.inf).reshape(U, X).min(axis=1)
    if fits is not None and not fits(allow.reshape(U, X).max(axis=1)):
        return None
    fv = value.reshape(U, X)
    pz = (U, P * Z)                                    # parts without a remat axis
    order, value, allow_max = _sorted(fv, allow.reshape(U, X))
    return ChoiceTable(
        value=value, order=order, allow_max=allow_max,
        f=SortedParts(f.reshape(pz), order, R), b=SortedParts(b.reshape(U, X), order),
        tail=SortedParts(tail.reshape(pz), order, R), static=SortedParts(static.reshape(pz), order, R),
        held=SortedParts(held.reshape(U, X), order), transient=SortedParts(transient.reshape(U, X), order),
        shape=(P, Z, R))


def _sorted(value: np.ndarray, allow: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order, sorted values, running maximum of the sorted allowances) of [U, X] choices."""
    order = np.argsort(value, axis=1, kind="stable")    # stable: ties keep fewer splits
    at = order + (np.arange(value.shape[0]) * value.shape[1])[:, None]    # flat positions, sorted
    return order, np.take(value, at), np.maximum.accumulate(np.take(allow, at), axis=1)


def _lean(c: dict[str, np.ndarray], microbatches: int, budget: float, remat: tuple[str, ...], overlap: float,
          fits: Callable[[np.ndarray], bool] | None, sort: bool) -> ChoiceTable | None:
    """A table built from each choice's value and allowance only, written per remat policy (no
    stacked parts); a composition's parts are built when a point reads them (`_RowParts`), from the
    same elementwise arithmetic, so they match the full table's bit for bit."""
    f, tail, static, thunks = _terms(c, microbatches, overlap, remat)
    U, P, Z = f.shape
    R, X = len(thunks), P * Z * len(thunks)
    value, allow = np.empty((U, P, Z, R)), np.empty((U, P, Z, R))
    per_mb_tail = tail / microbatches
    for i, thunk in enumerate(thunks):
        b, held, transient = thunk()
        v = np.add(f, b)
        v += per_mb_tail
        value[..., i] = v
        allow[..., i] = _allowance(budget, static, held, transient, v)
    value, allow = value.reshape(U, X), allow.reshape(U, X)
    if fits is not None and not fits(allow.max(axis=1)):
        return None
    cells: dict[tuple, ChoiceTable] = {}

    def cell(u: int, pz: slice = slice(None)) -> ChoiceTable:
        """The full table of composition u over plan-storage pairs `pz` (all, or the one a point reads)."""
        key = (u, pz.start)
        if key not in cells:
            cells[key] = _table({k: a[u:u + 1].reshape(1, P * Z)[:, pz].reshape(1, -1, 1) if pz.start is not None
                                 else a[u:u + 1] for k, a in c.items()}, microbatches, budget, remat, overlap, None)
        return cells[key]

    if sort:
        order, value, allow_max = _sorted(value, allow)
        allow = None
    else:
        order, allow_max = np.broadcast_to(np.arange(X), (U, X)), None
    parts = {name: _RowParts(cell, name, order, R) for name in ("f", "b", "tail", "static", "held", "transient")}
    return ChoiceTable(value=value, order=order, allow_max=allow_max, shape=(P, Z, R), allow=allow, **parts)


class _RowParts:
    """A part of a lean table, read at [composition, position]: from a full table of that composition
    and the one plan-storage pair of the choice (`order` gives the choice at each position; the full
    tables' raw parts are unsorted)."""

    __slots__ = ("cell", "name", "order", "R")

    def __init__(self, cell: Callable[..., ChoiceTable], name: str, order: np.ndarray, R: int) -> None:
        self.cell, self.name, self.order, self.R = cell, name, order, R

    @property
    def shape(self) -> tuple[int, int]:
        return self.order.shape

    def __getitem__(self, index):
        u, k = int(index[0]), int(index[1])
        pz, r = divmod(int(self.order[u, k]), self.R)
        part = getattr(self.cell(u, slice(pz, pz + 1)), self.name)
        return part.raw[0, r // part.per]

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        rows = [getattr(self.cell(u), self.name) for u in range(self.order.shape[0])]
        out = np.stack([p.raw[0, self.order[u] // p.per] for u, p in enumerate(rows)])
        return out if dtype is None else out.astype(dtype)


def split_choice(flat_index: int, shape: tuple[int, int, int]) -> tuple[int, int, int]:
    """(plan, storage, remat) indices of a flat choice index (plan-major, as ChoiceTable orders them)."""
    P, Z, R = shape
    p, rest = divmod(int(flat_index), Z * R)
    z, r = divmod(rest, R)
    return p, z, r
