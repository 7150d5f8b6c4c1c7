"""Activations and their gradients between MPMD stages that split the batch differently (GraphPipe's
per-stage micro-batch sizes).

Stage s splits the mini-batch of B rows into n_s equal micro-batches; micro-batch m holds rows
[m B / n_s, (m + 1) B / n_s). A consumer's micro-batch is assembled from the rows of every producer
micro-batch it overlaps (`schedule.overlapping`, the dependencies the schedule already orders), and the
gradient of that input is cut back into the same pieces and returned to the producers, where each
micro-batch's pieces are joined in row order and summed over the consumers. Equal counts on both sides
of an edge take the direct path (one piece, no slicing). The batch is the leading dimension of every
value crossing such an edge: anything else is a typed error naming the value's shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from ...core.errors import PipelineError
from ...pipeline.schedules.schedule import overlapping

Move = Callable[[Any, int], Any]         # (tree, destination stage) -> the tree on that stage's mesh


class Flow:
    """The values in flight between stages: outputs waiting for their consumers' forwards, gradient pieces
    waiting for their producers' backwards."""

    def __init__(self, counts: Sequence[int], batch: int, preds: Sequence[Sequence[int]],
                 succs: Sequence[Sequence[int]], move: Move):
        self.n, self.B, self.preds, self.succs, self.move = tuple(counts), batch, preds, succs, move
        self.sent: dict[tuple[int, int, int], Any] = {}      # (producer, consumer, its micro-batch) -> output
        self.pieces: dict[tuple[int, int], dict[int, list[tuple[int, Any]]]] = {}   # (stage, mb) -> grads

    def rows(self, s: int, m: int) -> tuple[int, int]:
        b = self.B // self.n[s]
        return m * b, (m + 1) * b

    def send(self, s: int, m: int, y: Any) -> None:
        """Stage s's forward output for micro-batch m, moved to each consumer."""
        for v in self.succs[s]:
            if self.n[v] != self.n[s]:
                _check_leading(y, self.B // self.n[s], s, v)
            self.sent[(s, v, m)] = self.move(y, v)

    def inputs(self, v: int, m: int) -> list[Any]:
        """Stage v's inputs for micro-batch m, one per predecessor (assembled from overlapping pieces)."""
        out = []
        for u in self.preds[v]:
            if self.n[u] == self.n[v]:
                out.append(self.sent.pop((u, v, m)))
                continue
            lo, hi = self.rows(v, m)
            parts = []
            for mu in overlapping(self.n[v], self.n[u], m):
                ulo, uhi = self.rows(u, mu)
                a, b = max(lo, ulo), min(hi, uhi)
                y = self.sent[(u, v, mu)]
                parts.append(y if (a, b) == (ulo, uhi) else _rows_of(y, a - ulo, b - ulo))
                if m == overlapping(self.n[u], self.n[v], mu)[-1]:     # its last consumer micro-batch
                    del self.sent[(u, v, mu)]
            out.append(parts[0] if len(parts) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts))
        return out

    def give_back(self, v: int, m: int, dxs: Sequence[Any]) -> None:
        """The gradients of stage v's inputs for micro-batch m, cut into the producers' micro-batches."""
        lo, hi = self.rows(v, m)
        for u, dx in zip(self.preds[v], dxs, strict=True):
            for mu in overlapping(self.n[v], self.n[u], m):
                ulo, uhi = self.rows(u, mu)
                a, b = max(lo, ulo), min(hi, uhi)
                piece = dx if (a, b) == (lo, hi) else _rows_of(dx, a - lo, b - lo)
                self.pieces.setdefault((u, mu), {}).setdefault(v, []).append((a, self.move(piece, u)))

    def gradient(self, s: int, m: int) -> Any:
        """The gradient of stage s's output for micro-batch m: each consumer's pieces joined in row order,
        summed over the consumers."""
        by_consumer = self.pieces.pop((s, m))
        total = None
        for v in sorted(by_consumer):
            parts = [p for _, p in sorted(by_consumer[v], key=lambda ap: ap[0])]
            whole = parts[0] if len(parts) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts)
            total = whole if total is None else jax.tree.map(jnp.add, total, whole)
        return total


def _rows_of(tree: Any, a: int, b: int) -> Any:
    return jax.tree.map(lambda x: x[a:b], tree)


def _check_leading(tree: Any, rows: int, s: int, v: int) -> None:
    for x in jax.tree.leaves(tree):
        if not getattr(x, "ndim", 0) or x.shape[0] != rows:
            raise PipelineError(
                f"autoshard MPMD pipeline: stage {s} sends stage {v} a value of shape {tuple(getattr(x, 'shape', ()))} "
                f"whose leading dim is not its micro-batch of {rows} rows; the two stages split the batch into "
                "different micro-batch counts, which needs the batch leading in every value they exchange. Fix: give "
                "both stages one micro-batch count (pipeline_options={'per_stage_microbatch': False}).")
