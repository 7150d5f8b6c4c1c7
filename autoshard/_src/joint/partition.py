"""Contiguous stage split of a unit chain minimising Σ v_s + (M - 1) · max v_s (pure: no jax import).

`v_s = cost[s][i, j]` is stage s's time per micro-batch when it holds units i..j-1 (inf when no
choice fits its memory with the micro-batches it keeps in flight). For 1F1B and GPipe with equal
micro-batches the step is Σ v_s + (M - 1) · max v_s when one stage is the bottleneck, so:

1. T* = the least achievable max v_s: binary search over the distinct finite costs, each test a
   reachability DP over (stage, boundary);
2. for thresholds T = T*, the next distinct cost, ... the least Σ v_s with every v_s <= T (a
   min-plus DP) plus (M - 1) times that split's own max; stop once (M - 1) · T plus the
   unconstrained least sum cannot beat the best found. Exact for the objective.
"""

from __future__ import annotations

import numpy as np


def _reachable(cost: list[np.ndarray], T: float) -> bool:
    n = cost[0].shape[0]
    reach = np.zeros(n, dtype=bool)
    reach[0] = True
    for c in cost:
        reach = (reach[:, None] & (c <= T)).any(axis=0)
        if not reach.any():
            return False
    return bool(reach[-1])


def _min_sum(cost: list[np.ndarray], T: float) -> tuple[float, list[int]]:
    """Least Σ v_s over splits with every v_s <= T, and the split's boundaries [0, b1, ..., n-1]."""
    n = cost[0].shape[0]
    best = np.full(n, np.inf)
    best[0] = 0.0
    back = []
    for c in cost:
        tot = best[:, None] + np.where(c <= T, c, np.inf)
        arg = np.argmin(tot, axis=0)
        best = tot[arg, np.arange(n)]
        back.append(arg)
    if not np.isfinite(best[-1]):
        return np.inf, []
    bounds = [n - 1]
    for arg in reversed(back):
        bounds.append(int(arg[bounds[-1]]))
    return float(best[-1]), bounds[::-1]


def best_split(cost: list[np.ndarray], microbatches: int) -> tuple[float, list[int]]:
    """(objective, boundaries) of the best contiguous split into len(cost) stages; (inf, []) if none fits."""
    if microbatches == 1:                            # no bottleneck term: the least sum
        total, bounds = _min_sum(cost, np.inf)
        return total, bounds
    values = np.unique(np.concatenate([c[np.isfinite(c)] for c in cost]))
    if values.size == 0 or not _reachable(cost, values[-1]):
        return np.inf, []
    lo, hi = 0, values.size - 1
    while lo < hi:                                    # the least feasible bottleneck
        mid = (lo + hi) // 2
        if _reachable(cost, values[mid]):
            hi = mid
        else:
            lo = mid + 1
    free_sum, _ = _min_sum(cost, np.inf)
    best, best_bounds = np.inf, []
    for k in range(lo, values.size):
        T = values[k]
        if (microbatches - 1) * T + free_sum >= best:
            break
        total, bounds = _min_sum(cost, T)
        if not bounds:
            continue
        peak = max(cost[s][bounds[s], bounds[s + 1]] for s in range(len(cost)))
        obj = total + (microbatches - 1) * peak
        if obj < best:
            best, best_bounds = obj, bounds
    return best, best_bounds
