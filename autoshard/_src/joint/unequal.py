"""Pipeline stages on unequal submeshes: Alpa's inter-op DP over a unit chain (pure: no jax import).

Each stage takes a contiguous range of units and its own submesh shape (data d x model t) from a
given list; the stages' device counts sum to exactly N (Zheng et al., "Alpa", OSDI 2022, §5.2:
stages of 2, 2 and 4 devices when one stage is twice as heavy). Under 1F1B a stage keeps
min(r, M) micro-batches in flight, r = stages from it to the end (itself included), so, like
Alpa's F(s, k, d; t_max), the state holds the stages to go, the first unit and the devices left.
It also holds the submesh classes of the stage and of the one before it: a boundary's transfer
time depends on both neighbours (`send_seconds`), and a stage pays for the transfers at both its
ends (its forward send, its backward send), as in the equal-submesh search.

Objective, as `partition.best_split`: Σ v_s + (M - 1) · max v_s over the stages' times per
micro-batch v_s, through bottleneck thresholds T: the least Σ v_s with every v_s <= T (a min-plus
DP), plus (M - 1) times that split's own max. Thresholds run over the distinct stage times from a
lower bound of the least bottleneck up to bound / M (no split over it can beat the caller's bound),
by branch and bound: Σ(T) only falls as T grows, so an interval of thresholds whose lowest T and
highest Σ cannot beat the best found is dropped. Exact for its space (tests: brute force).

Three DPs, from the last position to the first, each vectorised over the stages starting at a
position (end, shape), the stages to go and the devices left:
* `least_bottleneck`: max in place of +, each transfer at its cheapest over the neighbours'
  classes (no classes in the state): a lower bound of the least bottleneck;
* `_admitted`: exact sums, but a stage is admitted when it is within T with its transfers at their
  cheapest, so the state needs only the class of the stage at a position (both transfers at a
  boundary are added where both neighbours are known): a lower bound of Σ(T), and exact whenever
  its split keeps every stage within T — the common case, transfers being small;
* `_run`: the exact DP with both classes in the state, for the thresholds the bounds cannot drop.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

Stage = tuple[int, int, int]          # (first unit, unit after the last, shape index)


@dataclasses.dataclass(frozen=True)
class ChainProblem:
    """A unit chain to split into stages on unequal submeshes, as plain arrays.

    `values[k, l, c]`: seconds per micro-batch (the step's tail spread over the micro-batches
    included, transfers excluded) of a stage of composition c on `shapes[k]` with `levels[l]`
    micro-batches in flight; inf when nothing fits its memory. `comp_id[i, j]`: the composition of
    units i..j-1. `cut_dep` / `cut_const`: bytes crossing each unit boundary that do / do not scale
    with the batch. `intra` / `inter`: (latency s, s per byte) of a point-to-point send inside a
    node / across nodes. `positions`: the unit boundaries where stages may start and end (empty:
    every one)."""

    shapes: tuple[tuple[int, int], ...]
    values: np.ndarray
    comp_id: np.ndarray
    levels: tuple[int, ...]
    schedule: str
    microbatches: int
    devices: int
    devices_per_node: int
    cut_dep: np.ndarray
    cut_const: np.ndarray
    intra: tuple[float, float]
    inter: tuple[float, float]
    positions: tuple[int, ...] = ()
    # (latency s, s per full-buffer byte) of an all-gather over n devices of a node: the receivers'
    # half of Megatron's scatter/gather send (None: every device sends the whole boundary tensor)
    gather: Callable[[int], tuple[float, float]] | None = None

    @property
    def units(self) -> int:
        return self.comp_id.shape[0] - 1

    def inflight(self, to_go: int) -> int:
        """Micro-batches a stage keeps in flight with `to_go` stages from it to the end."""
        return min(to_go, self.microbatches) if self.schedule == "1f1b" else self.microbatches

    def shape_class(self, k: int) -> tuple[int, bool, int]:
        """What a transfer to or from a stage on shape k depends on: its data degree, whether it fills
        whole nodes (then its neighbours sit on other nodes), and its model degree (scatter/gather)."""
        d, t = self.shapes[k]
        return d, self.devices > self.devices_per_node and d * t >= self.devices_per_node, \
            (t if self.gather is not None else 1)


def send_seconds(pb: ChainProblem, boundary: int, before: tuple[int, bool, int], after: tuple[int, bool, int],
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of the transfer at unit `boundary` (an array of boundaries)
    between a stage of class `before` and one of class `after` (`shape_class`).

    Each stage splits its micro-batch over its own data degree. When the two degrees differ the
    boundary tensor is resharded on the way; it is priced with the larger of the two per-device
    byte counts, the one of the side with fewer data shards (equal degrees: the equal search's
    cost). A send across nodes when either stage fills whole nodes. With model degrees, each of the
    smaller degree's devices sends its part and the receivers all-gather it (`SearchState.sends`)."""
    d, m = min(before[0], after[0]), min(before[2], after[2])
    alpha, beta = pb.inter if before[1] or after[1] else pb.intra
    dep = np.asarray(pb.cut_dep)[boundary] / (pb.microbatches * d)
    gather = 0.0
    if m > 1 and pb.gather is not None:
        a_g, b_g = pb.gather(m)
        gather = np.where(dep > 0, a_g + b_g * dep, 0.0)
    const = np.asarray(pb.cut_const)[boundary]
    seconds = lambda b: np.where(b > 0, alpha + beta * b, 0.0)  # noqa: E731
    return (np.minimum(seconds(dep + const), seconds(dep / m + const) + gather),
            np.minimum(seconds(dep), seconds(dep / m) + gather))


def stage_times(pb: ChainProblem, stages: Sequence[Stage]) -> list[float]:
    """v_s of each stage of a split (the reference the DP is exact against)."""
    level = {q: i for i, q in enumerate(pb.levels)}
    S, out = len(stages), []
    for s, (i, j, k) in enumerate(stages):
        v = float(pb.values[k, level[pb.inflight(S - s)], pb.comp_id[i, j]])
        if s + 1 < S:
            v += float(send_seconds(pb, j, pb.shape_class(k), pb.shape_class(stages[s + 1][2]))[0])
        if s > 0:
            v += float(send_seconds(pb, i, pb.shape_class(stages[s - 1][2]), pb.shape_class(k))[1])
        out.append(v)
    return out


def objective(pb: ChainProblem, stages: Sequence[Stage]) -> float:
    v = stage_times(pb, stages)
    return sum(v) + (pb.microbatches - 1) * max(v)


@dataclasses.dataclass(frozen=True)
class UnequalSplit:
    stages: tuple[Stage, ...]
    objective: float
    passes: int                    # DP passes it took


def solve(pb: ChainProblem, bound: float = math.inf) -> UnequalSplit | None:
    """The split of least objective below `bound` (None when there is none)."""
    M = pb.microbatches
    cap = bound / M if math.isfinite(bound) else math.inf      # below `bound`: every v_s < bound / M
    prep = _Prepared(pb, cap)
    if not prep.ok:
        return None
    if M == 1:                                                 # no bottleneck term: the least sum
        return _better(pb, prep.least_sum(cap)[0], bound, prep.passes)
    t_low = prep.least_bottleneck()
    if not t_low <= cap:
        return None
    path = _bisect_thresholds(pb, prep, prep.thresholds(t_low, cap), bound)
    return _better(pb, path, bound, prep.passes)


def _bisect_thresholds(pb: ChainProblem, prep: _Prepared, th: np.ndarray, bound: float) -> list[Stage] | None:
    """Branch and bound over the candidate bottlenecks `th` (ascending). The least sum with every
    stage at most T, Σ(T), only falls as T grows, so no split whose bottleneck lies in th(i..j]
    beats (M - 1) · th[i + 1] + Σ(th[j]): such intervals are dropped, the others halved. Σ comes
    from the cheap admitted pass (a lower bound, and any split it returns is a real one); the
    exact pass runs only for single thresholds that bound cannot drop."""
    M, best, best_path = pb.microbatches, bound, None
    sums: dict[int, float] = {}
    exact: set[int] = set()

    def offer(path: list[Stage] | None) -> None:
        nonlocal best, best_path
        if path and (obj := objective(pb, path)) < best:
            best, best_path = obj, path

    def evaluate(k: int, strict: bool) -> None:
        path, sums[k], is_exact = prep.least_sum(float(th[k]), strict)
        offer(path)
        if is_exact:
            exact.add(k)

    if not th.size:
        return None
    evaluate(th.size - 1, False)
    stack = [(-1, th.size - 1)]
    while stack:
        i, j = stack.pop()
        if (M - 1) * th[i + 1] + sums[j] >= best:
            continue
        if j - i == 1:
            if j not in exact:
                evaluate(j, True)
            continue
        m = (i + j) // 2
        evaluate(m, False)
        stack += [(m, j), (i, m)]                               # the lower half first
    return best_path


def _better(pb: ChainProblem, path: list[Stage] | None, bound: float, passes: int) -> UnequalSplit | None:
    if not path:
        return None
    obj = objective(pb, path)
    return UnequalSplit(tuple(path), obj, passes) if obj < bound else None


class _Prepared:
    """The DP's tables for one problem: positions, shape classes, transfer times, buckets of
    stages to go (1, 2, ..., R - 1, then ">= R" once in-flight counts stop changing) and, per
    start position, every candidate stage (end, shape) with its time at each bucket."""

    def __init__(self, pb: ChainProblem, cap: float) -> None:
        self.pb, self.passes = pb, 0
        U, N = pb.units, pb.devices
        self.pos = np.array(pb.positions or range(U + 1), dtype=np.int64)
        counts = [d * t for d, t in pb.shapes]
        self.unit = math.gcd(*counts, N)                       # devices are counted in these units
        self.ok = bool(counts) and self.pos[0] == 0 and self.pos[-1] == U and U >= 1
        if not self.ok:
            return
        self.nn = N // self.unit + 1
        self.n_of = np.array(counts) // self.unit
        keys = sorted({pb.shape_class(k) for k in range(len(pb.shapes))})
        self.cls = np.array([keys.index(pb.shape_class(k)) for k in range(len(pb.shapes))])
        self.P, self.K = P, K = len(self.pos), len(keys)
        most = min(P - 1, (self.nn - 1) // int(self.n_of.min()))
        self.R = max(1, min(most, pb.microbatches if pb.schedule == "1f1b" else 1))
        level = {q: i for i, q in enumerate(pb.levels)}
        self.levels = np.array([level[pb.inflight(b)] for b in range(1, self.R + 1)])
        # transfer seconds at each position: fwd[own class, next class, x], bwd[previous class, own class, x]
        self.fwd, self.bwd = np.zeros((K, K, P)), np.zeros((K, K, P))
        for a, ka in enumerate(keys):
            for b, kb in enumerate(keys):
                self.fwd[a, b], self.bwd[a, b] = send_seconds(pb, self.pos, ka, kb)
        self.fwd_lo, self.fwd_hi = self.fwd.min(axis=1), self.fwd.max(axis=1)         # [own, x]
        self.bwd_lo, self.bwd_hi = self.bwd.min(axis=0), self.bwd.max(axis=0)
        self.pad = int(self.n_of.max())
        self.entries = [self._entries(x, cap) for x in range(P - 1)]

    def _entries(self, x: int, cap: float) -> dict[str, np.ndarray]:
        """Stages starting at position x: end position, shape, devices, class, and time per bucket
        (sorted by class, for the per-class reduction); those over `cap` at every bucket dropped."""
        pb, i = self.pb, int(self.pos[x])
        ys, ks = np.meshgrid(np.arange(x + 1, self.P), np.arange(len(pb.shapes)), indexing="ij")
        ys, ks = ys.ravel(), ks.ravel()
        comp = pb.comp_id[i, self.pos[ys]]
        t = pb.values[ks[:, None], self.levels[None, :], comp[:, None]]        # [E, R]
        lowest = t.min(axis=1) + self.fwd_lo[self.cls[ks], ys] + self.bwd_lo[self.cls[ks], x]
        keep = np.isfinite(lowest) & (lowest <= cap)
        order = np.lexsort((ys[keep], ks[keep], self.cls[ks[keep]]))
        ks, ys, t = ks[keep][order], ys[keep][order], t[keep][order]
        a = self.cls[ks]
        starts = np.flatnonzero(np.r_[True, a[1:] != a[:-1]]) if a.size else np.zeros(0, dtype=np.int64)
        return {"y": ys, "k": ks, "n": self.n_of[ks], "a": a, "t": t, "starts": starts, "groups": a[starts],
                "lo": t + (self.fwd_lo[a, ys] + self.bwd_lo[a, x])[:, None],
                "hi": t + (self.fwd_hi[a, ys] + self.bwd_hi[a, x])[:, None]}

    def _times(self, e: dict[str, np.ndarray], x: int, nxt: int) -> np.ndarray:
        """[p, E, R]: each entry's stage time after a stage of class p, before one of class nxt."""
        base = e["t"] + self.fwd[e["a"], nxt, e["y"]][:, None]
        return base[None] + self.bwd[:, e["a"], x][:, :, None]

    def thresholds(self, low: float, high: float) -> np.ndarray:
        """The distinct stage times in [low, high], ascending: the candidate bottlenecks."""
        found = [np.zeros(0)]
        for x, e in enumerate(self.entries):
            near = np.flatnonzero(((e["hi"] >= low) & (e["lo"] <= high)).any(axis=1))
            if not near.size:
                continue
            sub = {name: e[name][near] for name in ("t", "a", "y")}
            for nxt in range(self.K):
                v = self._times(sub, x, nxt).ravel()
                found.append(v[(v >= low) & (v <= high)])
        return np.unique(np.concatenate(found))

    # --- the DP -----------------------------------------------------------------------------
    def least_bottleneck(self) -> float:
        """A lower bound of the least bottleneck: the DP with max in place of +, each transfer at
        its cheapest over the neighbours' classes (so no classes in its state)."""
        self.passes += 1
        P, R, nn, pad = self.P, self.R, self.nn, self.pad
        full = np.full((P, R + 1, nn), np.inf)
        full[P - 1, 0, 0] = 0.0
        sub = np.full((P, R, pad + nn), np.inf)
        sub[P - 1, :, pad:] = _as_sub(full[P - 1], R)
        windows = np.lib.stride_tricks.sliding_window_view(sub, nn, axis=-1)     # [P, R, pad + 1, nn]
        for x in range(P - 2, -1, -1):
            e = self.entries[x]
            if e["y"].size:
                rows = windows[e["y"], :, pad - e["n"]]                           # [E, R, nn]
                full[x, 1:] = np.maximum(e["lo"][..., None], rows).min(axis=0)
                sub[x, :, pad:] = _as_sub(full[x], R)
        return float(full[0, 1:, nn - 1].min())

    def least_sum(self, T: float, strict: bool = True) -> tuple[list[Stage] | None, float, bool]:
        """(split, sum, exact): a split of least sum of stage times with every stage at most T and
        that sum (None, inf when there is none). First the admitted pass (`_admitted`): a lower
        bound, exact whenever its split keeps every stage within T; otherwise the exact pass
        decides, or with `strict=False` the bound and the admitted split are returned as they are."""
        path, total = self._admitted_path(T)
        if path is None or max(stage_times(self.pb, path)) <= T:
            return path, total, True
        if not strict:
            return path, total, False
        return (*self._exact_path(T), True)

    def _admitted(self, T: float) -> None:
        """The DP of the least sum, exact transfers included, over splits whose stages are within T
        with their transfers at their cheapest (a superset of the splits within T, so its least
        sum is a lower bound). Its state needs only the class of the stage at a position: a
        boundary's two transfers are added where both neighbours are known, `full[x, a, b, n]`.
        From position x at most P - 1 - x stages follow: the buckets past that stay inf."""
        self.passes += 1
        P, K, R, nn, pad = self.P, self.K, self.R, self.nn, self.pad
        both = self.fwd + self.bwd                              # [a, next, x]
        full = self._buffer("adm", (P, K, R + 1, nn))
        full[P - 1, :, 0, 0] = 0.0
        lead = self._buffer("adm_lead", (P, K, R, pad + nn))   # [y, a]: best over the class at y, transfers included
        windows = np.lib.stride_tricks.sliding_window_view(lead, nn, axis=-1)
        for x in range(P - 1, -1, -1):
            e = self.entries[x] if x < P - 1 else None
            most = min(R, P - 1 - x)
            if e is not None and e["y"].size:
                rows = windows[e["y"], e["a"], :most, pad - e["n"]]               # [E, most, nn]
                cand = np.where(e["lo"][:, :most] <= T, e["t"][:, :most], np.inf)[..., None] + rows
                full[x, e["groups"], 1:most + 1] = np.minimum.reduceat(cand, e["starts"], axis=0)
            ahead = min(R, most + 1)                            # sub-state rows that can be finite
            lead[x, :, :ahead, pad:] = (both[:, :, x][:, :, None, None] +
                                        _as_sub(full[x], R)[None, :, :ahead]).min(axis=1)
        self.adm = full

    def _buffer(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A table of inf, reused from pass to pass (fresh allocations of this size cost more than
        the pass's arithmetic)."""
        buf = self.__dict__.setdefault("_buffers", {}).get(name)
        if buf is None or buf.shape != shape:
            buf = self._buffers[name] = np.empty(shape)
        buf.fill(np.inf)
        return buf

    def _admitted_path(self, T: float) -> tuple[list[Stage] | None, float]:
        self._admitted(T)
        top = self.adm[0, :, 1:, self.nn - 1]
        a, b = divmod(int(np.argmin(top)), self.R)
        total = target = float(top[a, b])
        if not math.isfinite(total):
            return None, total
        x, b, n, out = 0, b + 1, self.nn - 1, []
        both = self.fwd + self.bwd
        while x < self.P - 1:
            e = self.entries[x]
            left = n - e["n"]
            ok = (e["a"] == a) & (e["lo"][:, b - 1] <= T) & (left >= 0)
            best = (math.inf, 0, 0, 0.0)
            for nxt in range(self.K):
                sub = self._adm_sub(e["y"], nxt, b, np.maximum(left, 0))
                cand = np.where(ok, e["t"][:, b - 1] + (both[a, nxt, e["y"]] + sub), np.inf)
                h = int(np.argmin(np.abs(cand - target)))
                if abs(cand[h] - target) < best[0]:
                    best = (abs(cand[h] - target), h, nxt, float(sub[h]))
            _, h, nxt, target = best
            y = int(e["y"][h])
            out.append((int(self.pos[x]), int(self.pos[y]), int(e["k"][h])))
            n -= int(e["n"][h])
            if b == self.R:       # the merged bucket: its successor has R - 1 or >= R stages to go
                b = self.R if _close(self.adm[y, nxt, self.R - 1, n], target) else self.R + 1
            x, a, b = y, nxt, b - 1
        return out, total

    def _adm_sub(self, y: np.ndarray, nxt: int, b: int, n: np.ndarray) -> np.ndarray:
        """The admitted pass's value of the states after a stage of bucket b (`_as_sub`, read
        without copying the tables)."""
        sub = self.adm[y, nxt, b - 1, n]
        return np.minimum(sub, self.adm[y, nxt, b, n]) if b == self.R else sub

    def _run(self, T: float) -> None:
        """Fill `full[x, a, p, b, n]`: the least sum of stage times, every stage at most T, over
        stages from position x on, the first of class a after one of class p, b stages to go (the
        last bucket: b or more) and n device units left; `sub`, the same as a stage before reads
        it (buckets mapped by `_as_sub`, padded with inf so that a stage of m units reads column
        pad + n - m); and `lead[y, a]`, the best over the class of the stage at y of its transfer
        from a stage of class a plus its sub-state value."""
        self.passes += 1
        P, K, R, nn, pad = self.P, self.K, self.R, self.nn, self.pad
        full = self._buffer("full", (P, K, K, R + 1, nn))
        full[P - 1, :, :, 0, 0] = 0.0                           # past the last unit, nothing left
        sub = self._buffer("sub", (P, K, K, R, pad + nn))
        lead = self._buffer("lead", (P, K, R, pad + nn))
        windows = np.lib.stride_tricks.sliding_window_view(sub, nn, axis=-1)     # [P, K, K, R, pad + 1, nn]
        lead_windows = np.lib.stride_tricks.sliding_window_view(lead, nn, axis=-1)
        for x in range(P - 1, -1, -1):
            e = self.entries[x] if x < P - 1 else None
            if e is not None and e["y"].size:
                most = min(R, P - 1 - x)                        # stages that can follow position x
                self._clear_stages(full[x, :, :, 1:most + 1], e, x, T, lead_windows[:, :, :most])
                self._edge_stages(full[x, :, :, 1:most + 1], e, x, T, windows, most)
            sub[x, :, :, :, pad:] = _as_sub(full[x], R)
            lead[x] = (self.fwd[:, :, x].T[:, :, None, None] + sub[x]).min(axis=0)
        self.full, self.sub = full, sub

    def _clear_stages(self, best: np.ndarray, e: dict, x: int, T: float, lead_windows: np.ndarray) -> None:
        """Stages at most T whatever their neighbours' classes: their transfer at the end joins the
        next stage's choice (`lead`), their transfer at the start is added per previous class."""
        most = best.shape[2]
        clear = e["hi"][:, :most] <= T                                         # [E, most]
        if not clear.any():
            return
        rows = lead_windows[e["y"], e["a"], :, self.pad - e["n"]]              # [E, most, nn]
        cand = np.where(clear, e["t"][:, :most], np.inf)[..., None] + rows
        red = np.minimum.reduceat(cand, e["starts"], axis=0)                   # [groups, R, nn]
        g = e["groups"]
        back = self.bwd[:, g, x].T                                             # [groups, p]
        best[g] = np.minimum(best[g], back[:, :, None, None] + red[:, None])

    def _edge_stages(self, best: np.ndarray, e: dict, x: int, T: float, windows: np.ndarray, most: int) -> None:
        """(stage, bucket) pairs within T for some neighbour classes only: every (next, previous)
        class pair, reduced per (class, bucket)."""
        qe, qb = np.nonzero((e["hi"][:, :most] > T) & (e["lo"][:, :most] <= T))
        if not qe.size:
            return
        a, y = e["a"][qe], e["y"][qe]
        order = np.lexsort((qb, a))                             # group by (class, bucket)
        qe, qb, a, y = qe[order], qb[order], a[order], y[order]
        starts = np.flatnonzero(np.r_[True, (a[1:] != a[:-1]) | (qb[1:] != qb[:-1])])
        ga, gb = a[starts], qb[starts]
        t, back = e["t"][qe, qb], self.bwd[:, a, x]                            # [Q], [p, Q]
        rows = windows[y, :, a, qb, self.pad - e["n"][qe]]                      # [Q, next, nn]
        # most (devices left, successor) states cannot finish the chain: only the columns some
        # successor can finish from are reduced (the others stay inf whatever the stage)
        cols = np.flatnonzero(np.isfinite(rows).any(axis=(0, 1)))
        if not cols.size:
            return
        rows = rows[:, :, cols].transpose(1, 0, 2)                              # [next, Q, cols]
        v = (t[None] + self.fwd[a, :, y].T)[:, None] + back[None]              # [next, p, Q]
        # min over the next class, then per (class, bucket): both are minima, so either order
        cand = (np.where(v <= T, v, np.inf)[..., None] + rows[:, None]).min(axis=0)     # [p, Q, cols]
        red = np.minimum.reduceat(cand, starts, axis=1)                         # [p, groups, cols]
        at = (ga[:, None], slice(None), gb[:, None], cols[None, :])            # best[at]: [groups, cols, p]
        best[at] = np.minimum(best[at], red.transpose(1, 2, 0))

    def _top(self) -> tuple[float, int, int]:
        """(value, class, bucket) of the best whole split: position 0, every device (the class
        before the first stage is moot: no transfer at unit 0)."""
        top = self.full[0, :, 0, 1:, self.nn - 1]             # [a, b - 1]
        flat = int(np.argmin(top))
        a, b = divmod(flat, self.R)
        return float(top[a, b]), a, b + 1

    def _exact_path(self, T: float) -> tuple[list[Stage] | None, float]:
        """A split of least sum with every stage at most T (None when there is none) and its sum."""
        self._run(T)
        target, a, b = self._top()
        total = target
        if not math.isfinite(target):
            return None, total
        x, p, n, out = 0, 0, self.nn - 1, []
        while x < self.P - 1:
            h, nxt, target = self._step(self.entries[x], x, a, p, b, n, T, target)
            e = self.entries[x]
            y = int(e["y"][h])
            out.append((int(self.pos[x]), int(self.pos[y]), int(e["k"][h])))
            n -= int(e["n"][h])
            if b == self.R:       # the merged bucket: its successor has R - 1 or >= R stages to go
                b = self.R if _close(self.full[y, nxt, a, self.R - 1, n], target) else self.R + 1
            x, p, a, b = y, a, nxt, b - 1
        return out, total

    def _step(self, e: dict, x: int, a: int, p: int, b: int, n: int, T: float, target: float,
              ) -> tuple[int, int, float]:
        """(entry, next class, next state's value) of a stage achieving `target` in state
        (x, a, p, b, n): the first within rounding (the DP adds in a different order)."""
        left = n - e["n"]
        best = (math.inf, 0, 0, math.inf)
        for nxt in range(self.K):
            v = self._times(e, x, nxt)[p, :, b - 1]
            rows = np.where(left >= 0, self.sub[e["y"], nxt, a, b - 1, self.pad + np.maximum(left, 0)], np.inf)
            cand = np.where((e["a"] == a) & (v <= T), v + rows, np.inf)
            h = int(np.argmin(np.abs(cand - target)))
            if abs(cand[h] - target) < best[0]:
                best = (abs(cand[h] - target), h, nxt, float(rows[h]))
        if not best[0] <= 1e-9 * max(1.0, abs(target)):
            raise AssertionError("unequal DP: no stage reproduces the state's value; please report")
        return best[1], best[2], best[3]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-12 * max(1.0, abs(b))


def _as_sub(full: np.ndarray, R: int) -> np.ndarray:
    """Per bucket b = 1..R of a stage, the states its successors may be in: b - 1 stages to go,
    or, for the last bucket (b or more), R - 1 or >= R: `[..., R + 1, n]` -> `[..., R, n]`."""
    out = full[..., :R, :].copy()
    out[..., R - 1, :] = np.minimum(full[..., R - 1, :], full[..., R, :])
    return out
