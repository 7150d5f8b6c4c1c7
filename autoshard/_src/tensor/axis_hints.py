"""Mesh axis names as hints where plans tie (pure: no jax import).

A mesh's axes are interchangeable to the cost model when their sizes and links agree: on {"data": 2, "model": 2}
the plan with the batch on `data` and Megatron's splits on `model` and its mirror (batch on `model`, splits on
`data`) predict the same step, and enumeration order alone would pick whichever axis comes first. The user named
the axes for a reason: among plans whose predicted steps differ by at most `TIE` (relative), the search prefers
the batch on axes named for data (data, batch, dp, fsdp, replica) and the other splits (heads, FFN, vocabulary,
a split sequence) on axes named for the model (model, tensor, tp, mp). A hint never outweighs a cost difference
beyond `TIE`.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from ..core.mesh import MeshSpec

# relative step-time difference below which two plans tie: the evaluator sums a few hundred float64 terms per
# plan (rounding ~1e-14 relative), so 1e-9 merges only plans the cost model cannot tell apart, while any cost
# the model resolves (one collective, one kernel) is far larger; the same bound `Plan.explain` uses to call an
# expert plan a tie, so a hint never makes the chosen plan "slower" than an expert it ties with
TIE = 1e-9
DATA_WORDS = frozenset({"data", "batch", "dp", "ddp", "fsdp", "replica", "replicas"})
MODEL_WORDS = frozenset({"model", "tensor", "tp", "mp"})


def axis_kind(name: str) -> int:
    """+1 for an axis named for data ("data", "dp_replica", "fsdp"), -1 for one named for the model ("model",
    "tensor", "tp"), 0 otherwise; by the words of its name split at non-alphanumerics."""
    words = set(re.split(r"[^a-z0-9]+", name.lower()))
    return 1 if words & DATA_WORDS else -1 if words & MODEL_WORDS else 0


def _mask_kinds(mesh: MeshSpec) -> np.ndarray:
    """Per axis mask (bit i: mesh axis i): the sum of its axes' kinds."""
    kinds = [axis_kind(n) for n in mesh.names]
    return np.array([sum(k for i, k in enumerate(kinds) if m >> i & 1) for m in range(1 << len(kinds))],
                    dtype=np.int64)


def row_hints(rows: np.ndarray, cands: Sequence[int], batch: Collection[int], mesh: MeshSpec) -> np.ndarray:
    """Per plan (rows of axis masks over `cands`): how well its axes match their names, one point per axis a
    batch factor sits on that is named for data or another factor on one named for the model, minus one per
    axis the other way round."""
    sign = np.array([1 if f in batch else -1 for f in cands], dtype=np.int64)
    if not len(sign):
        return np.zeros(rows.shape[0], dtype=np.int64)
    return (_mask_kinds(mesh)[rows] * sign).sum(axis=1)


def choice_hint(factor_axes: Mapping[int, Sequence[str]], batch: Collection[int]) -> int:
    """`row_hints` of one plan given as factor -> mesh axes."""
    return sum((1 if f in batch else -1) * axis_kind(a) for f, axes in factor_axes.items() for a in axes)


def break_tie(i0: int, step_time: np.ndarray, ok: np.ndarray, rows: np.ndarray, cands: Sequence[int],
              batch: Collection[int], mesh: MeshSpec) -> int:
    """The plan to take instead of `i0` (the fastest by enumeration order among the plans `ok`): the first in
    enumeration order with the best hint among those within `TIE` of it; `i0` itself when no tie changes it."""
    near = np.flatnonzero(ok & (np.abs(step_time - step_time[i0]) <= TIE * step_time[i0]))
    if len(near) < 2:
        return i0
    hints = row_hints(rows[near], cands, batch, mesh)
    best = int(hints.max())
    if int(hints[np.searchsorted(near, i0)]) == best:
        return i0
    return int(near[int(np.argmax(hints == best))])


def ties(a: float, b: float) -> bool:
    """Do two predicted step times tie (`TIE`)?"""
    return abs(a - b) <= TIE * min(abs(a), abs(b))


def hint_note(chosen: Mapping[int, Sequence[str]], mirror: Mapping[int, Sequence[str]], batch: Collection[int]
              ) -> str:
    """What the axis-name hint decided between two plans of the same predicted step (factor -> axes each)."""
    def axes(fa: Mapping[int, Sequence[str]], of_batch: bool) -> str:
        names = sorted({a for f, ax in fa.items() if (f in batch) == of_batch for a in ax})
        return ", ".join(f"'{n}'" for n in names) or "no axis"

    what = "batch" if axes(chosen, True) != axes(mirror, True) else "tensor-parallel splits"
    on_batch = what == "batch"
    return (f"{what} on {axes(chosen, on_batch)} (axis-name hint; same predicted step as the mirror plan with "
            f"the {what} on {axes(mirror, on_batch)})")
