"""Pipeline schedules as plain data, and their validator.

A schedule is a DAG of stages plus, per rank, the ordered list of tasks that rank runs, and a
placement: the rank of every stage (default: stage s on rank s). Interleaved schedules place several
stages (virtual stages / model chunks) on one rank, e.g. stage k on rank k % S.

Stage s splits the mini-batch into `num_microbatches[s]` equal micro-batches; micro-batch
m of a stage with n micro-batches covers the fraction [m/n, (m+1)/n) of the mini-batch, so a
consumer's micro-batch depends on every producer micro-batch it overlaps (GraphPipe's per-stage
micro-batch sizes). Chain schedules use edges (0,1), ..., (p-2,p-1) and one count for every stage.

Nothing here imports jax: the runtime reads these tables, the validator and simulator check them.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import networkx as nx

from ...core.errors import ScheduleError

Kind = Literal["F", "B"]


@dataclass(frozen=True, order=True)
class Task:
    """One unit of work: the forward ("F") or backward ("B") of one micro-batch on one stage."""

    stage: int
    microbatch: int
    kind: Kind

    @property
    def label(self) -> str:
        return f"{self.kind}{self.microbatch}"

    def to_list(self) -> list:
        return [self.stage, self.microbatch, self.kind]


@dataclass(frozen=True)
class Schedule:
    """Stage DAG + per-rank task order: `ranks[r]` is rank r's tasks in order, and rank r runs the
    stages s with `rank_of[s] == r`. `placement` None is the identity (rank r runs stage r); an
    identity tuple is stored as None, so old schedules and their JSON compare and load unchanged."""

    name: str
    num_stages: int
    edges: tuple[tuple[int, int], ...]
    num_microbatches: tuple[int, ...]
    ranks: tuple[tuple[Task, ...], ...]
    placement: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.placement, (list, tuple)):  # anything else is left for validate() to report
            placement = tuple(self.placement)
            identity = placement == tuple(range(len(placement))) and len(placement) == len(self.ranks)
            object.__setattr__(self, "placement", None if identity else placement)

    @property
    def rank_of(self) -> tuple[int, ...]:
        """The rank running each stage."""
        return tuple(range(self.num_stages)) if self.placement is None else self.placement

    def stages_on(self, rank: int) -> tuple[int, ...]:
        """The stages placed on `rank`, in stage order."""
        return tuple(s for s, r in enumerate(self.rank_of) if r == rank)

    def predecessors(self, stage: int) -> tuple[int, ...]:
        return tuple(u for u, v in self.edges if v == stage)

    def successors(self, stage: int) -> tuple[int, ...]:
        return tuple(v for u, v in self.edges if u == stage)

    def dependencies(self, task: Task) -> tuple[Task, ...]:
        """Tasks that must finish before `task` may start (across stage edges and on its own stage)."""
        return _task_dependencies(self, task, self.predecessors(task.stage), self.successors(task.stage))

    def to_dict(self) -> dict[str, Any]:
        data = {
            "name": self.name,
            "num_stages": self.num_stages,
            "edges": [list(e) for e in self.edges],
            "num_microbatches": list(self.num_microbatches),
            "ranks": [[t.to_list() for t in rank] for rank in self.ranks],
        }
        if self.placement is not None:  # identity placements keep the pre-placement format
            data["placement"] = list(self.placement)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Schedule:
        try:
            sched = cls(
                name=str(data["name"]),
                num_stages=int(data["num_stages"]),
                edges=tuple((int(u), int(v)) for u, v in data["edges"]),
                num_microbatches=tuple(int(n) for n in data["num_microbatches"]),
                ranks=tuple(tuple(Task(int(s), int(m), str(k)) for s, m, k in rank) for rank in data["ranks"]),
                placement=None if data.get("placement") is None else tuple(int(r) for r in data["placement"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ScheduleError(
                f"Schedule.from_dict: malformed schedule data ({type(err).__name__}: {err}). Expected keys "
                "name, num_stages, edges [[u, v], ...], num_microbatches [n_0, ...] and ranks "
                "[[[stage, microbatch, 'F'|'B'], ...], ...] (optional placement [rank of stage 0, ...]), as written "
                "by Schedule.to_dict()."
            ) from err
        validate(sched)
        return sched

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        return cls.from_dict(json.loads(text))


def chain_edges(num_stages: int) -> tuple[tuple[int, int], ...]:
    return tuple((s, s + 1) for s in range(num_stages - 1))


def overlapping(n_from: int, n_to: int, microbatch: int) -> range:
    """Micro-batches of a stage with `n_to` micro-batches that overlap micro-batch `microbatch` of a
    stage with `n_from` micro-batches (both split the same mini-batch into equal parts)."""
    lo = microbatch * n_to // n_from
    hi = -(-(microbatch + 1) * n_to // n_from)  # ceil: a partial overlap still needs the data
    return range(lo, hi)


def _task_dependencies(sched: Schedule, task: Task, preds: Sequence[int], succs: Sequence[int]) -> tuple[Task, ...]:
    n, s, m = sched.num_microbatches, task.stage, task.microbatch
    if task.kind == "F":
        return tuple(Task(u, j, "F") for u in preds for j in overlapping(n[s], n[u], m))
    # A backward needs its own forward's activations and the gradients of every consumer.
    return (Task(s, m, "F"),) + tuple(Task(v, j, "B") for v in succs for j in overlapping(n[s], n[v], m))


def dependency_table(sched: Schedule) -> dict[Task, tuple[Task, ...]]:
    """Dependencies of every task the stage DAG and micro-batch counts call for (built once per pass)."""
    preds = {s: sched.predecessors(s) for s in range(sched.num_stages)}
    succs = {s: sched.successors(s) for s in range(sched.num_stages)}
    return {
        task: _task_dependencies(sched, task, preds[s], succs[s])
        for s in range(sched.num_stages)
        for m in range(sched.num_microbatches[s])
        for task in (Task(s, m, "F"), Task(s, m, "B"))
    }


def check_positive_int(fn: str, arg: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ScheduleError(f"{fn}: {arg} must be a positive int, got {value!r}.")
    return int(value)


def inflight_order(stage: int, n: int, cap: int, k: int = 1) -> tuple[Task, ...]:
    """Task order of one stage under an in-flight cap: forwards while fewer than `cap` micro-batches
    are in flight, then `k` backwards (oldest first), repeat; leftover backwards drain at the end.
    cap=n gives GPipe, cap=p-s on a chain gives 1F1B, k>1 gives GraphPipe's kFkB."""
    cap = max(1, min(cap, n))
    order: list[Task] = []
    f = b = 0
    while b < n:
        if f < n and f - b < cap:
            order.append(Task(stage, f, "F"))
            f += 1
            continue
        for _ in range(min(k, f - b)):
            order.append(Task(stage, b, "B"))
            b += 1
    return tuple(order)


# ---------------------------------------------------------------------------------------------
# Validator.
# Schedule validator: counts, per-stage order and deadlock freedom, reported on a tick x rank grid.
#
# Ticks come from running the schedule with unit-time tasks: at each tick every rank runs its next
# task if all of that task's dependencies finished at an earlier tick. That is the table a static
# SPMD runtime executes, and a stall in it is exactly a deadlock (a cycle between rank orders and
# data dependencies), so cross-stage ordering errors show up as the tasks stuck waiting.

_MAX_COLUMNS = 64  # wider grids are cut to a window around the first marked cell
_MAX_LISTED = 6  # problems listed in one message; the grid marks all of them

Cell = tuple[int, int]  # (rank, position in that rank's task list)


@dataclass(frozen=True)
class _Problem:
    text: str
    cells: tuple[Cell, ...] = ()


def validate(sched: Schedule) -> None:
    """Raise `ScheduleError` (message with the tick x rank grid, offending tasks in brackets) unless
    every stage runs each of its micro-batches exactly once forward and once backward, forward
    before backward, and the rank orders can run to completion under the stage DAG's dependencies."""
    _check_dag(sched)
    deps = dependency_table(sched)
    problems = _check_tasks(sched, deps)
    ticks, stalled = run_ticks(sched, deps)
    if not problems and stalled:
        problems = [_deadlock_problem(sched, deps, stalled, ticks)]
    if problems:
        stall_tick = ticks[stalled[0]] if stalled else None
        raise ScheduleError(_message(sched, problems, ticks, stall_tick))


def tick_table(sched: Schedule) -> tuple[tuple[Task | None, ...], ...]:
    """Rows = ranks, columns = ticks, `None` = idle: the static table a lock-step runtime executes."""
    validate(sched)
    ticks, _ = run_ticks(sched, dependency_table(sched))
    width = max(ticks.values(), default=-1) + 1
    rows = [[None] * width for _ in sched.ranks]
    for (r, i), t in ticks.items():
        rows[r][t] = sched.ranks[r][i]
    return tuple(tuple(row) for row in rows)


def _check_dag(sched: Schedule) -> None:
    """Errors in the stage DAG itself; no grid, since tasks cannot be placed without it."""
    p = sched.num_stages
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ScheduleError(f"schedule {sched.name!r}: num_stages must be a positive int, got {p!r}.")
    counts = sched.num_microbatches
    if len(counts) != p or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
        raise ScheduleError(
            f"schedule {sched.name!r}: num_microbatches must hold one positive int per stage ({p}), got {list(counts)}."
        )
    bad = [e for e in sched.edges if len(e) != 2 or not all(0 <= s < p for s in e) or e[0] == e[1]]
    if bad:
        raise ScheduleError(f"schedule {sched.name!r}: edges {bad} are not between two distinct stages 0..{p - 1}.")
    graph = nx.DiGraph(list(sched.edges))
    if not nx.is_directed_acyclic_graph(graph):
        cycle = nx.find_cycle(graph)
        raise ScheduleError(f"schedule {sched.name!r}: the stage graph has a cycle {cycle}; stages must form a DAG.")
    if len(set(sched.edges)) != len(sched.edges):
        raise ScheduleError(f"schedule {sched.name!r}: duplicate stage edges in {list(sched.edges)}.")
    if sched.placement is None and len(sched.ranks) != p:
        raise ScheduleError(
            f"schedule {sched.name!r}: {len(sched.ranks)} rank task lists for {p} stages; without a placement "
            "one rank runs one stage. Fix: give one task list per stage, or placement=(rank of each stage)."
        )
    if sched.placement is not None:
        _check_placement(sched)


def _check_placement(sched: Schedule) -> None:
    place, n = sched.placement, len(sched.ranks)
    ok = isinstance(place, tuple) and all(isinstance(r, int) and not isinstance(r, bool) for r in place)
    if not ok or len(place) != sched.num_stages or not all(0 <= r < n for r in place):
        raise ScheduleError(
            f"schedule {sched.name!r}: placement={place!r} must give, for each of the {sched.num_stages} stages, "
            f"the rank 0..{n - 1} that runs it ({n} rank task lists). Fix: one rank index per stage."
        )
    empty = sorted(set(range(n)) - set(place))
    if empty:
        raise ScheduleError(
            f"schedule {sched.name!r}: placement={list(place)} leaves ranks {empty} without a stage. Fix: drop "
            "their task lists or place a stage on each rank."
        )


def _check_tasks(sched: Schedule, deps: dict[Task, tuple[Task, ...]]) -> list[_Problem]:
    problems: list[_Problem] = []
    where: dict[Task, list[Cell]] = {}
    rank_of, p = sched.rank_of, sched.num_stages
    for r, rank in enumerate(sched.ranks):
        for i, task in enumerate(rank):
            cell = (r, i)
            if task.kind not in ("F", "B"):
                problems.append(_Problem(f"rank {r} step {i}: task kind {task.kind!r} is not 'F' or 'B'.", (cell,)))
            elif not 0 <= task.stage < p:
                problems.append(_Problem(f"rank {r} step {i}: stage {task.stage} is not a stage 0..{p - 1}.", (cell,)))
            elif rank_of[task.stage] != r:
                on = sched.stages_on(r)
                here = ("stage " if len(on) == 1 else "stages ") + ", ".join(map(str, on))
                problems.append(
                    _Problem(
                        f"rank {r} step {i}: {task.label} belongs to stage {task.stage}, but rank {r} runs "
                        f"{here}. Fix: move it to rank {rank_of[task.stage]}.",
                        (cell,),
                    )
                )
            elif not 0 <= task.microbatch < sched.num_microbatches[task.stage]:
                n = sched.num_microbatches[task.stage]
                problems.append(
                    _Problem(
                        f"rank {r} step {i}: {task.label} is out of range; stage {task.stage} has "
                        f"{n} micro-batches (0..{n - 1}).",
                        (cell,),
                    )
                )
            else:
                where.setdefault(task, []).append(cell)
    for task, cells in where.items():
        if len(cells) > 1:
            steps = ", ".join(str(i) for _, i in cells)
            problems.append(
                _Problem(
                    f"stage {task.stage}: {task.label} runs {len(cells)} times (rank {cells[0][0]}, steps {steps}); "
                    "each micro-batch runs exactly one forward and one backward per stage. Fix: drop the extra.",
                    tuple(cells[1:]),
                )
            )
    missing = [task for task in deps if task not in where]
    users: dict[Task, list[Cell]] = {}
    if missing:
        for t, ds in deps.items():
            for d in ds:
                if t in where:
                    users.setdefault(d, []).append(where[t][0])
    for task in missing:
        have = sum(1 for t in where if t.stage == task.stage)
        # Mark what depends on the missing task; a missing backward also strands its forward.
        marked = users.get(task, []) + where.get(Task(task.stage, task.microbatch, "F"), [])[: task.kind == "B"]
        problems.append(
            _Problem(
                f"stage {task.stage}: {task.label} is missing (rank {rank_of[task.stage]} has {have} of "
                f"{2 * sched.num_microbatches[task.stage]} tasks); the marked tasks need it. Fix: add it.",
                tuple(marked),
            )
        )
    for task, cells in where.items():
        forward = where.get(Task(task.stage, task.microbatch, "F"))
        if task.kind == "B" and forward and cells[0][1] < forward[0][1]:
            problems.append(
                _Problem(
                    f"rank {cells[0][0]}: {task.label} at step {cells[0][1]} comes before its forward "
                    f"F{task.microbatch} at step {forward[0][1]}; a backward needs its forward's activations. "
                    f"Fix: put F{task.microbatch} before B{task.microbatch}.",
                    (cells[0],),
                )
            )
    return problems


def run_ticks(sched: Schedule, deps: dict[Task, tuple[Task, ...]]) -> tuple[dict[Cell, int], list[Cell]]:
    """Unit-time run of the rank orders. Returns the tick of every (rank, step) and the stuck heads.
    Dependencies on tasks absent from the schedule are ignored so broken schedules still lay out;
    after a stall the remaining tasks are placed one per tick so the grid shows all of them."""
    present = {task for rank in sched.ranks for task in rank}
    done: dict[Task, int] = {}
    ticks: dict[Cell, int] = {}
    heads = [0] * len(sched.ranks)
    tick = 0
    remaining = sum(len(rank) for rank in sched.ranks)
    stalled: list[Cell] = []
    while remaining:
        ready = []
        for r, rank in enumerate(sched.ranks):
            if heads[r] < len(rank):
                needs = deps.get(rank[heads[r]], ())
                if all(d not in present or done.get(d, tick) < tick for d in needs):
                    ready.append(r)
        if not ready:
            stalled = [(r, heads[r]) for r, rank in enumerate(sched.ranks) if heads[r] < len(rank)]
            break
        for r in ready:
            ticks[(r, heads[r])] = tick
            done.setdefault(sched.ranks[r][heads[r]], tick)
            heads[r] += 1
            remaining -= 1
        tick += 1
    for r, rank in enumerate(sched.ranks):
        for k, i in enumerate(range(heads[r], len(rank))):
            ticks[(r, i)] = tick + k
    return ticks, stalled


def _deadlock_problem(
    sched: Schedule, deps: dict[Task, tuple[Task, ...]], stalled: list[Cell], ticks: dict[Cell, int]
) -> _Problem:
    done_before = {sched.ranks[r][i] for (r, i), t in ticks.items() if t < ticks[stalled[0]]}
    waits = []
    for r, i in stalled:
        task = sched.ranks[r][i]
        missing = [d for d in deps.get(task, ()) if d not in done_before]
        waits.append(f"rank {r} {task.label} waits for " + ", ".join(f"{d.label} of stage {d.stage}" for d in missing))
    return _Problem(
        f"deadlock at tick {ticks[stalled[0]]}: " + "; ".join(waits) + ". Every rank is blocked on a task that "
        "comes later in another rank's order. Fix: reorder so each task's producers run first, e.g. give the "
        "blocked stages more warm-up forwards before their first backward.",
        tuple(stalled),
    )


def _message(sched: Schedule, problems: list[_Problem], ticks: dict[Cell, int], stall_tick: int | None) -> str:
    counts = sorted(set(sched.num_microbatches))
    mbs = str(counts[0]) if len(counts) == 1 else f"per-stage {list(sched.num_microbatches)}"
    head = f"invalid schedule {sched.name!r} ({sched.num_stages} stages, {mbs} micro-batches):"
    lines = [head] + [f"  - {p.text}" for p in problems[:_MAX_LISTED]]
    if len(problems) > _MAX_LISTED:
        lines.append(f"  ... and {len(problems) - _MAX_LISTED} more")
    marks = {cell for p in problems for cell in p.cells}
    lines.append("tick x rank grid (rows = ranks, [..] = offending task, . = idle):")
    lines.append(render_grid(sched, ticks, marks))
    if stall_tick is not None:
        lines.append(f"(the run stalls at tick {stall_tick}; from there each rank's remaining tasks follow in order)")
    return "\n".join(lines)


def render_grid(sched: Schedule, ticks: dict[Cell, int], marks: set[Cell] = frozenset()) -> str:
    """ASCII grid: one row per rank, one column per tick, cells like "F3"/"B0", marked cells in []."""
    width = max(ticks.values(), default=-1) + 1
    cells: dict[tuple[int, int], str] = {}
    for (r, i), t in ticks.items():
        label = sched.ranks[r][i].label
        cells[(r, t)] = f"[{label}]" if (r, i) in marks else label
    lo, hi = 0, width
    if width > _MAX_COLUMNS:
        first = min((ticks[c] for c in marks), default=0)
        lo = max(0, min(first - _MAX_COLUMNS // 3, width - _MAX_COLUMNS))
        hi = lo + _MAX_COLUMNS
    cw = max([len(c) for c in cells.values()] + [len(str(hi - 1)), 1]) + 1
    name_w = len(f"rank {len(sched.ranks) - 1}")
    out = ["tick".ljust(name_w) + " |" + "".join(str(t).rjust(cw) for t in range(lo, hi))]
    for r in range(len(sched.ranks)):
        row = "".join(cells.get((r, t), ".").rjust(cw) for t in range(lo, hi))
        out.append(f"rank {r}".ljust(name_w) + " |" + row)
    if (lo, hi) != (0, width):
        out.append(f"(ticks {lo}..{hi - 1} of 0..{width - 1} shown)")
    return "\n".join(out)
