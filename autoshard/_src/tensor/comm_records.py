"""The collectives one plan issues, as a compiled program shows them (pure: no jax import).

`CommRecords` is a mixin of `evaluator._Evaluator`: for one plan row it lists every collective by kind, mesh
axes and phase with its per-device buffer bytes and count (what `autoshard.audit` compares with the HLO),
reading the summaries the evaluator built (`groups`, `gathers`, `params`, `gathered`) and its mesh tables.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping

import numpy as np

from ..core.mesh import MeshSpec


def _mask_axes(mesh: MeshSpec, mask: int) -> tuple[str, ...]:
    return tuple(a for i, a in enumerate(mesh.names) if mask >> i & 1)


class CommRecords:
    """Per-plan collective records (see the module docstring)."""

    def _scatter_gradients(self, out: dict, plans: np.ndarray, storage: str) -> None:
        """Under ZeRO a gradient is reduce-scattered over the axes its shards are stored on (all of
        its reduction axes): move its bytes from the gradient all-reduce records to reduce-scatter."""
        reduce_axes = 0
        for (_, red, kind), _, ar_bytes, _ in self.groups:
            if kind == "grad" and red and ar_bytes:
                reduce_axes |= int(self._or(plans, red)[0])
        reduce_axes &= sum(1 << i for i, s in enumerate(self.mesh.sizes) if s > 1)
        for dims, shape, b in self.params:
            m, free = self._storage_masks(plans, dims, shape, self.nm - 1)
            mask = reduce_axes & ~int(m[0])
            if not mask or int(free[0]) & mask != mask:
                continue
            key = ("all-reduce", _mask_axes(self.mesh, mask), "grad")
            rec = out.get(key)
            if rec is None or rec[0] <= 0:
                continue
            moved = min(rec[0], b / self.msize[int(m[0])])
            share = rec[1] * moved / rec[0]
            rec[0] -= moved
            rec[1] -= share
            rs = out[("reduce-scatter", key[1], "grad")]
            rs[0] += moved
            rs[1] += share
        for key in [k for k, rec in out.items() if rec[0] <= 1e-6]:     # moved whole
            del out[key]

    def comm_records(self, row: np.ndarray, storage: str) -> dict[tuple[str, tuple[str, ...], str], list[float]]:
        """The collectives one plan issues: (kind, axes, phase) -> [per-device buffer bytes, count].
        Buffer bytes are what a compiled program's collective operates on per device (an
        all-reduce's operand, an all-gather's result): the quantity an audit reads from the HLO."""
        plans = row.reshape(1, -1)
        out: dict[tuple[str, tuple[str, ...], str], list[float]] = defaultdict(lambda: [0.0, 0.0])

        def add(kind: str, mask: int, phase: str, b: float, count: float) -> None:
            # axes of size 1 move nothing and are invisible in a compiled program's replica groups
            mask = sum(1 << i for i, s in enumerate(self.mesh.sizes) if mask >> i & 1 and s > 1)
            if mask and b > 0:
                rec = out[(kind, _mask_axes(self.mesh, mask), phase)]
                rec[0] += float(b)
                rec[1] += float(count)

        for (loop, red, kind), _, ar_bytes, count in self.groups:
            if red and ar_bytes:
                r_mask = int(self._or(plans, red)[0])
                n = self.msize[int(self._or(plans, loop)[0])]
                per_device = ar_bytes * self.msize[r_mask] / n
                add("all-reduce", r_mask, kind, per_device, 0.0 if kind == "grad" else count)
        for (fs, phase), b in self.gathers:
            add("all-gather", int(self._or(plans, fs)[0]), phase, b, 1.0)
        for mask, per_dev, w, phase in self._regathers(plans):
            add("all-gather", int(mask[0]), phase, float(per_dev[0]) * w, w)
        for kind, mask, per_dev, w, phase, moves in self._reshard_moves(plans):
            if moves[0]:
                add(kind, int(np.broadcast_to(mask, (1,))[0]), phase, float(per_dev[0]) * w, w)
        for kind, buf, mask, w, _, phase in self._partial_sums(plans):
            add(kind, int(mask[0]), phase, float(buf[0]) * w, w)
        for key, rec in out.items():        # gradients: the buckets they fill together (evaluator._add_times)
            if key[0] == "all-reduce" and key[2] == "grad":
                rec[1] = float(self._sync_count("grad", 1.0, np.array(rec[0])))
        if storage != "replicated":
            full = self.nm - 1
            for dims, shape, b in self.params:
                m, free = self._storage_masks(plans, dims, shape, full)
                n = self.msize[int(m[0])]
                if storage == "zero1":
                    add("all-gather", int(free[0]), "optimizer", b / n, 1.0)
            self._scatter_gradients(out, plans, storage)
            if storage == "zero3":
                for dims, shape, b in self.gathered:
                    m, free = self._storage_masks(plans, dims, shape, full)
                    add("all-gather", int(free[0]), "forward", b / self.msize[int(m[0])], 1.0)
        return dict(out)


class CommBytes(Mapping):
    """A plan's per-device collective buffer bytes by "kind@axes", listed when first read: the search makes
    a choice per storage mode and space, and prices expert plans, but only the plan it returns is read."""

    def __init__(self, evaluator: CommRecords, row: np.ndarray, storage: str) -> None:
        self._source: tuple | None = (evaluator, np.array(row), storage)
        self._bytes: dict[str, float] = {}

    def _listed(self) -> dict[str, float]:
        if self._source is not None:
            ev, row, storage = self._source
            self._bytes, self._source = comm_bytes_of(ev.comm_records(row, storage)), None
        return self._bytes

    def __getitem__(self, key: str) -> float:
        return self._listed()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._listed())

    def __len__(self) -> int:
        return len(self._listed())

    def __repr__(self) -> str:
        return repr(self._listed())


def comm_bytes_of(records: dict[tuple[str, tuple[str, ...], str], list[float]]) -> dict[str, float]:
    """Collective records (`comm_records`) summed by "kind@axes" over phases."""
    comm: dict[str, float] = defaultdict(float)
    for (k, axes, _), (b, _) in sorted(records.items()):
        comm[f"{k}@{','.join(axes)}"] += b
    return dict(comm)
