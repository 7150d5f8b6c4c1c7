"""The Megatron-LM grid people tune by hand, priced by the 3-D search's own model (pure: no jax import).

Tensor-parallel size t in 1, 2, 4, 8 (inside a node), pipeline size p over the divisors of the unit
(layer) count, data parallel the rest; layers split uniformly; 1F1B, or interleaved 1F1B with v
virtual stages per rank when p x v divides the layers and p the micro-batch count (Megatron-LM's
conditions); recompute none, selective or full; ZeRO-1 over data when there is data parallelism;
every micro-batch count that splits the batch evenly. Inside a
stage the tensor plan is Megatron's: the batch on the data axis, attention heads / FFN hidden /
vocabulary on the model axis (`tensor.experts`). Every grid point is priced with the same tables,
in-flight memory and event simulator as the search's own points, so the comparison is like for like.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .space import (
    INTERLEAVED,
    SIMULATED,
    JointPoint,
    JointStage,
    SearchState,
    inflight,
    lower_bound_work,
    microbatch_counts,
    simulated,
)
from .stage_choice import choice_table

TENSOR_SIZES = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True)
class GridResult:
    best: JointPoint | None
    points: int                  # grid points priced
    feasible: int                # of which fit the memory budget
    reason: str = ""             # why there is no best


def megatron_grid(srch: SearchState) -> GridResult:
    """The best point of the Megatron-LM grid for the search's step and devices. Its (t, p, M, v)
    combinations run in order of the search's lower bound (`lower_bound_work`, over Megatron's plans
    only) and stop once the bound cannot reach the SIMULATED best formulas found."""
    cands, reasons = _grid_candidates(srch)
    found: list[JointPoint] = []
    priced = feasible = 0
    for bound, (d, t, p, M, sched, v), tables, plans in sorted(cands, key=lambda c: (c[0], c[1][1:])):
        if len(found) >= SIMULATED and bound > sorted(q.objective for q in found)[SIMULATED - 1]:
            break
        storage = "zero1" if d > 1 and "zero1" in tables.storage_modes else "replicated"
        points = _grid_points(srch, tables, plans, storage, d, t, p, M, sched, v)
        priced += len(points)
        found += [q for q in points if q is not None]
        feasible += sum(q is not None for q in points)
    # the formula ranks them, the simulator times the best few (as for the search's own points)
    timed = [simulated(p) for p in sorted(found, key=lambda p: p.objective)[:SIMULATED]]
    best = min(timed, key=lambda p: p.step_time) if timed else None
    reason = "" if best is not None else ("no grid point fits the memory budget" if priced else
                                          "; ".join(reasons) or "no grid point applies")
    return GridResult(best, priced, feasible, reason)


def _grid_candidates(srch: SearchState) -> tuple[list, list[str]]:
    """(lower bound, (d, t, p, M, schedule, v), tables, Megatron plan indices) of every grid combination,
    and why shapes without Megatron's plan were left out."""
    U, N = len(srch.units), srch.N
    out, reasons = [], []
    fixed_s, fixed_shape = srch.joint.stages, srch.joint.shape      # a "pipe" mesh: its shape only
    for t in TENSOR_SIZES:
        if t > srch.hw.devices_per_node or N % t or (fixed_shape is not None and t != fixed_shape[1]):
            continue
        for p in (p for p in range(1, U + 1) if U % p == 0 and N % (t * p) == 0 and fixed_s in (None, p)):
            d = N // (t * p)
            tables = srch.table(d, t)
            plans = tables.megatron_plans()
            if not plans:
                reasons.append(f"t={t}, p={p}: {tables.megatron}")
                continue
            mask = np.zeros(tables.n_plans, dtype=bool)
            mask[plans] = True
            for M in microbatch_counts(srch.batch, srch.joint.max_microbatches, srch.joint.microbatches, d):
                valid = mask & ((srch.batch // M) % tables.batch_split.astype(np.int64) == 0)
                if not valid.any():
                    continue
                work = lower_bound_work(srch, tables, M, valid)
                for sched, v in _schedules(srch, p, M):
                    out.append((work * (M * v + p - 1) / (p * v), (d, t, p, M, sched, v), tables,
                                [i for i in plans if valid[i]]))
    return out, reasons


def _schedules(srch: SearchState, p: int, M: int) -> list[tuple[str, int]]:
    """Megatron-LM's schedules for p stages and M micro-batches: 1F1B, and interleaved 1F1B with each
    v whose p x v chunks split the layers evenly (and p divides M)."""
    U, out = len(srch.units), []
    if "1f1b" in srch.joint.schedules or INTERLEAVED not in srch.joint.schedules:
        out.append(("1f1b", 1))
    if INTERLEAVED in srch.joint.schedules and p > 1 and M % p == 0:
        out += [(INTERLEAVED, v) for v in srch.joint.virtual if v > 1 and U % (p * v) == 0]
    return out


def _grid_points(srch: SearchState, tables, plans: list[int], storage: str, d: int, t: int, S: int, M: int,
                 schedule: str, virtual: int) -> list[JointPoint | None]:
    """Megatron's uniform split under each of its plans and each recompute policy (None: over budget),
    from one choice table over the split's distinct compositions."""
    U, n = len(srch.units), S * virtual
    bounds = [s * U // n for s in range(n + 1)]
    qs = inflight(schedule, S, M, virtual)
    ids = [int(srch.comp_id[bounds[s], bounds[s + 1]]) for s in range(n)]
    distinct = sorted(set(ids))
    combos = srch.combos[(d, t)]
    # only Megatron's plans (the arrays are [compositions, plans, storage]): a table of a few choices
    ct = choice_table({k: a[distinct][:, plans] for k, a in combos.items()}, M, np.inf, srch.joint.remat,
                      np.ones(len(plans), dtype=bool), srch.options.overlap)
    send_f, send_b = srch.sends(d, M, d * t, t)
    z, R = tables.storage_modes.index(storage), len(srch.joint.remat)
    out = []
    for remat in (r for r in ("none", "selective", "full") if r in srch.joint.remat):
        for p_idx, r_idx in enumerate(plans):         # Megatron-LM without / with sequence parallelism
            flat = (p_idx * len(tables.storage_modes) + z) * R + srch.joint.remat.index(remat)
            out.append(_grid_point(srch, tables, ct, distinct, ids, flat, r_idx, (storage, remat), bounds, qs,
                                   (send_f, send_b), d, t, M, schedule, virtual))
    return out


def _grid_point(srch: SearchState, tables, ct, distinct: list[int], ids: list[int], flat: int, r_idx: int,
                choice: tuple[str, str], bounds: list[int], qs: list[int], sends, d: int, t: int, M: int,
                schedule: str, virtual: int) -> JointPoint | None:
    U, (storage, remat), (send_f, send_b) = len(srch.units), choice, sends
    row, sp = tables.plan(r_idx)
    stages = []
    ranks = len(ids) // virtual
    rank_memory = [0.0] * ranks          # a rank holds its v stages (k, k + ranks, ...)
    for s, u in enumerate(ids):
        c = distinct.index(u)
        k = int(np.flatnonzero(ct.order[c] == flat)[0])
        mem = float(ct.static[c, k] + ct.transient[c, k] + qs[s] * ct.held[c, k])
        rank_memory[s % ranks] += mem
        if rank_memory[s % ranks] > srch.budget:
            return None
        i, j = bounds[s], bounds[s + 1]
        f = float(ct.f[c, k] + (send_f[j] if j < U else 0.0))
        b = float(ct.b[c, k] + (send_b[i] if i > 0 else 0.0))
        stages.append(JointStage(i, j, row, storage, remat, f, b, float(ct.tail[c, k]), mem, qs[s], d, t, sp))
    v = [st.forward + st.backward + st.tail / M for st in stages]
    S = len(stages) // virtual
    label = (f"Megatron grid: tp {t} x pp {S} x dp {d}" + (", sequence parallel" if sp else "")
             + (f", interleaved v {virtual}" if virtual > 1 else ""))
    return JointPoint(tuple(stages), d, t, M, schedule, sum(v) / virtual + (M * virtual - 1) * max(v), np.inf,
                      label=label, virtual=virtual)
