"""The best tensor plan, storage mode and remat policy of a stage, by its units and in-flight count
(pure: no jax import).

A stage is a contiguous unit range; what it costs depends only on how many units of each kind it
holds (its composition), the micro-batch count M and how many micro-batches it keeps in flight q
(the schedule's). For every composition and every choice (plan p, storage z, remat r) the time per
micro-batch and the memory are linear in the kind arrays of `ShapeTables`:

    f = fwd / M + gather,   b = bwd / M + const + recompute(r),   tail = exposed sync + step
    value = f + b + tail / M                      (the step spreads over the M micro-batches)
    memory = static + transient(r) + q * held(r)  (held: saved activations per micro-batch in flight)

remat 'none' keeps every saved activation; 'dots' keeps the matmul outputs and each unit's input
and recomputes the rest (jax.checkpoint_policies.dots_saveable); 'full' keeps only each unit's
input and recomputes its forward in the backward pass, one unit at a time (its activations are the
transient). Per composition the choices are sorted by value once; the best choice for any q is the
first whose memory allows q micro-batches in flight, found by binary search on the running
maximum of that allowance.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .tables import ShapeTables

REMAT = ("none", "dots", "full")


@dataclasses.dataclass
class ChoiceTable:
    """Per composition: choices sorted by value, their f/b/tail/memory parts and the running
    maximum of the in-flight allowance (`allow_max`, nondecreasing along the sorted order)."""

    value: np.ndarray           # [U, X] sorted ascending
    order: np.ndarray           # [U, X] choice index (p, z, r) flattened as ((p * Z) + z) * R + r
    allow_max: np.ndarray       # [U, X]
    f: np.ndarray
    b: np.ndarray
    tail: np.ndarray
    static: np.ndarray
    held: np.ndarray            # bytes per micro-batch in flight
    transient: np.ndarray
    shape: tuple[int, int, int]   # (plans, storage modes, remat policies)

    def best(self, qs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(value [Q, U], sorted position [Q, U]) of each composition's best choice for each in-flight
        count in `qs` (value inf, position -1 where nothing fits)."""
        U, X = self.value.shape
        qs = np.asarray(qs, dtype=np.float64)
        # allow_max rows are nondecreasing: the first position reaching q = how many stay below it
        pos = (self.allow_max[None, :, :] < qs[:, None, None]).sum(axis=2)
        ok = pos < X
        idx = np.where(ok, pos, 0)
        val = np.take_along_axis(self.value, idx.T, axis=1).T
        return np.where(ok, val, np.inf), np.where(ok, pos, -1)


def compositions(tables: ShapeTables, comps: np.ndarray, kind_inputs: np.ndarray) -> dict[str, np.ndarray]:
    """The kind arrays summed over each composition in `comps` [U, K] -> [U, Z, P] (independent of
    the micro-batch count: computed once per submesh shape), plus the largest unit's activations
    and the units' input bytes per device."""
    v = tables.values
    out = {name: np.einsum("uk,kzp->uzp", comps, v[name]) for name in v}
    present = comps > 0
    # the largest unit's activations: recomputed one unit at a time under remat
    out["unit_acts"] = np.where(present[:, :, None, None], v["acts"][None], 0.0).max(axis=1)
    out["unit_rest"] = np.where(present[:, :, None, None], (v["acts"] - v["acts_dots"])[None], 0.0).max(axis=1)
    out["inputs"] = np.broadcast_to((comps @ kind_inputs)[:, None, None] / tables.batch_split[None, None, :],
                                    out["fwd"].shape)
    return out


def choice_table(c: dict[str, np.ndarray], microbatches: int, budget: float, remat: tuple[str, ...],
                 valid_plans: np.ndarray, overlap: float) -> ChoiceTable:
    """Every (plan, storage, remat) of every composition of `c` (`compositions`) at M = `microbatches`.
    `valid_plans[p]`: the plan splits a micro-batch evenly."""
    phi = 1.0 / microbatches
    fwd, bwd, dots, const = c["fwd"], c["bwd"], c["fwd_dots"], c["const"]
    sync, step, gather, static = c["sync"], c["step"], c["gather"], c["static"]
    acts, acts_dots, data = c["acts"], c["acts_dots"], c["data"]
    unit_acts, unit_rest, inputs = c["unit_acts"], c["unit_rest"], c["inputs"]
    f = phi * fwd + gather
    b_base = phi * bwd + const
    tail = np.maximum(0.0, sync - overlap * phi * bwd) + step
    parts = {"none": (b_base, phi * (acts + data), 0.0 * acts),
             "dots": (b_base + phi * (fwd - dots), phi * (acts_dots + inputs + data), phi * unit_rest),
             "full": (b_base + phi * fwd, phi * (inputs + data), phi * unit_acts)}
    b = np.stack([parts[r][0] for r in remat], axis=-1)           # [U, Z, P, R]
    held = np.stack([parts[r][1] for r in remat], axis=-1)
    transient = np.stack([parts[r][2] for r in remat], axis=-1)
    f4 = np.broadcast_to(f[..., None], b.shape)
    tail4 = np.broadcast_to(tail[..., None], b.shape)
    static4 = np.broadcast_to(static[..., None], b.shape)
    value = f4 + b + tail4 / microbatches
    value = np.where(valid_plans[None, None, :, None], value, np.inf)
    room = budget - static4 - transient
    allow = np.where(held > 0, room / np.where(held > 0, held, 1.0), np.where(room >= 0, np.inf, -np.inf))
    allow = np.where(np.isfinite(value), allow, -np.inf)
    U = fwd.shape[0]
    # flatten to [U, X] with X ordered (p, z, r) and sort by value (stable: ties keep fewer splits)
    def flat(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(np.transpose(a, (0, 2, 1, 3))).reshape(U, -1)

    fv, fa = flat(value), flat(allow)
    order = np.argsort(fv, axis=1, kind="stable")
    take = lambda a: np.take_along_axis(flat(np.ascontiguousarray(a)), order, axis=1)  # noqa: E731
    return ChoiceTable(
        value=np.take_along_axis(fv, order, axis=1), order=order,
        allow_max=np.maximum.accumulate(np.take_along_axis(fa, order, axis=1), axis=1),
        f=take(f4), b=take(b), tail=take(tail4), static=take(static4), held=take(held), transient=take(transient),
        shape=(value.shape[2], value.shape[1], value.shape[3]))


def split_choice(flat_index: int, shape: tuple[int, int, int]) -> tuple[int, int, int]:
    """(plan, storage, remat) indices of a flat choice index (plan-major, as ChoiceTable orders them)."""
    P, Z, R = shape
    p, rest = divmod(int(flat_index), Z * R)
    z, r = divmod(rest, R)
    return p, z, r
