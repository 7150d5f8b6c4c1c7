"""The 3-D search's points with unequal stage submeshes (pure: no jax import).

Which part of Alpa's inter-op space is searched, and why it stays fast:

* the (micro-batch count, schedule) combinations of the UNEQUAL_COMBOS best equal-submesh points
  (the equal search ranks all of them first; the micro-batch count and schedule are global);
* per stage a submesh of Alpa's set, restricted to powers of two: 1, 2, 4, ... devices up to a
  node, then whole nodes, each as data d x model t with t within a node (as the equal search:
  t at most `max_model`, 1 when stages stay data parallel), the device count within a factor of
  two of that combination's best equal point's per-stage count (stages lighter or heavier than
  the balanced split get fewer or more devices);
* the stages' devices sum to exactly the search's N, every micro-batch splits evenly over each
  stage's plan (`tables.batch_split`);
* only points whose formula beats every equal point's are kept (the DP's bound prunes the rest).

Within that space `unequal.solve` is exact. Each stage's cost is the equal search's: the best
(tensor plan, storage, remat) for its units and in-flight count from the submesh's choice table,
plus its transfers (`unequal.send_seconds`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .space import JointPoint, JointStage, SearchState
from .stage_choice import ChoiceTable, choice_table, split_choice
from .unequal import ChainProblem, UnequalSplit, send_seconds, solve

UNEQUAL_COMBOS = 2


def unequal_points(srch: SearchState, points: Sequence[JointPoint]) -> list[JointPoint]:
    """The best unequal-submesh point of each of the best equal points' (micro-batches, schedule)
    combinations, when it beats every equal point by the formula."""
    joint = srch.joint
    if joint.equal_submeshes or joint.stages is not None or joint.shape is not None or not points:
        return []
    ranked = sorted(points, key=lambda p: p.objective)
    bound = ranked[0].objective
    combos: dict[tuple[int, str], int] = {}
    for p in ranked:
        if (p.microbatches, p.schedule) not in combos and len(combos) < UNEQUAL_COMBOS:
            combos[(p.microbatches, p.schedule)] = p.devices // p.num_stages
    out = []
    for (M, schedule), per_stage in combos.items():
        shapes = stage_shapes(srch, per_stage)
        point = best_unequal(srch, shapes, M, schedule, bound) if len(shapes) > 1 else None
        if point is not None and not point.runnable:
            out.append(point)
    return out


def stage_shapes(srch: SearchState, per_stage: int) -> list[tuple[int, int]]:
    """(data, model) submeshes a stage may take around a balanced split's `per_stage` devices."""
    node, N = srch.hw.devices_per_node, srch.N
    max_model = min(srch.joint.max_model or node, node)
    out = []
    count = 1
    while count <= N:
        if per_stage <= 2 * count and count <= 2 * per_stage and (count <= node or count % node == 0):
            t = 1
            while t <= min(count, max_model) and (t == 1 or srch.joint.tensor_in_stages):
                out.append((count // t, t))
                t *= 2
        count *= 2
    return out


def best_unequal(srch: SearchState, shapes: list[tuple[int, int]], M: int, schedule: str,
                 bound: float) -> JointPoint | None:
    """The best point below `bound` (by the formula) whose stages take submeshes among `shapes`."""
    U = len(srch.units)
    levels = tuple(range(1, min(M, U, srch.N) + 1)) if schedule == "1f1b" else (M,)
    tables: list[ChoiceTable | None] = []
    values = np.full((len(shapes), len(levels), srch.comps.shape[0]), np.inf)
    for k, (d, t) in enumerate(shapes):
        split = srch.table(d, t).batch_split.astype(np.int64)
        valid = (srch.batch // M) % split == 0
        ct = None
        if srch.batch % M == 0 and valid.any():
            ct = choice_table(srch.combos[(d, t)], M, srch.budget, srch.joint.remat, valid, srch.options.overlap,
                              sort=False,     # unsorted: cheaper than sorting for the levels `best` reads
                              restricted=srch.restricted(d, t, valid))
            values[k] = ct.best(np.array(levels))[0]
        tables.append(ct)
    node = srch.hw.devices_per_node
    pb = ChainProblem(tuple(shapes), values, srch.comp_id, levels, schedule, M, srch.N, node,
                      srch.units.cut_dep, srch.units.cut_const, srch.p2p(1), srch.p2p(node), gather=srch.gather)
    found = solve(pb, bound)
    return None if found is None else _as_point(srch, pb, found, tables)


def _as_point(srch: SearchState, pb: ChainProblem, found: UnequalSplit, tables: list[ChoiceTable | None]) -> JointPoint:
    """The split as a JointPoint: each stage's choice, costs and memory from its submesh's table."""
    S, M = len(found.stages), pb.microbatches
    stages = []
    for s, (i, j, k) in enumerate(found.stages):
        ct, (d, t) = tables[k], pb.shapes[k]
        q, u = pb.inflight(S - s), srch.comp_id[i, j]
        pos = int(ct.best(np.array([q]))[1][0, u])
        p, z, r = split_choice(ct.order[u, pos], ct.shape)
        ahead = send_seconds(pb, j, pb.shape_class(k), pb.shape_class(found.stages[s + 1][2]))[0] if s + 1 < S else 0.0
        behind = send_seconds(pb, i, pb.shape_class(found.stages[s - 1][2]), pb.shape_class(k))[1] if s else 0.0
        mem = float(ct.static[u, pos] + ct.transient[u, pos] + q * ct.held[u, pos])
        st = srch.table(d, t)
        row, sp = st.plan(p)
        stages.append(JointStage(i, j, row, st.storage_modes[z], srch.joint.remat[r],
                                 float(ct.f[u, pos] + ahead), float(ct.b[u, pos] + behind), float(ct.tail[u, pos]),
                                 mem, q, d, t, sp))
    v = [st.forward + st.backward + st.tail / M for st in stages]
    runnable = len({(st.data, st.model) for st in stages}) == 1
    d, t = (stages[0].data, stages[0].model) if runnable else (None, None)
    return JointPoint(tuple(stages), d, t, M, pb.schedule, sum(v) + (M - 1) * max(v), math.inf)
