"""Pipeline schedules as plain data, a registry of builders, and the chain schedules GPipe and 1F1B.

A schedule is a DAG of stages plus, per rank (one rank per stage), the ordered list of tasks that
rank runs. Stage s splits the mini-batch into `num_microbatches[s]` equal micro-batches; micro-batch
m of a stage with n micro-batches covers the fraction [m/n, (m+1)/n) of the mini-batch, so a
consumer's micro-batch depends on every producer micro-batch it overlaps (GraphPipe's per-stage
micro-batch sizes). Chain schedules use edges (0,1), ..., (p-2,p-1) and one count for every stage.

Nothing here imports jax: the runtime reads these tables, the validator and simulator check them.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from autoshard._errors import AutoshardError

Kind = Literal["F", "B"]


class ScheduleError(AutoshardError, ValueError):
    """A pipeline schedule that cannot run: bad arguments, a broken task order, or a deadlock."""


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
    """Stage DAG + per-rank task order. Rank r runs stage r; `ranks[r]` is its tasks in order."""

    name: str
    num_stages: int
    edges: tuple[tuple[int, int], ...]
    num_microbatches: tuple[int, ...]
    ranks: tuple[tuple[Task, ...], ...]

    def predecessors(self, stage: int) -> tuple[int, ...]:
        return tuple(u for u, v in self.edges if v == stage)

    def successors(self, stage: int) -> tuple[int, ...]:
        return tuple(v for u, v in self.edges if u == stage)

    def dependencies(self, task: Task) -> tuple[Task, ...]:
        """Tasks that must finish before `task` may start (across stage edges and on its own stage)."""
        return _task_dependencies(self, task, self.predecessors(task.stage), self.successors(task.stage))

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "num_stages": self.num_stages,
            "edges": [list(e) for e in self.edges],
            "num_microbatches": list(self.num_microbatches),
            "ranks": [[t.to_list() for t in rank] for rank in self.ranks],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Schedule:
        from ._validate import validate  # the validator imports this module

        try:
            sched = cls(
                name=str(data["name"]),
                num_stages=int(data["num_stages"]),
                edges=tuple((int(u), int(v)) for u, v in data["edges"]),
                num_microbatches=tuple(int(n) for n in data["num_microbatches"]),
                ranks=tuple(tuple(Task(int(s), int(m), str(k)) for s, m, k in rank) for rank in data["ranks"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ScheduleError(
                f"Schedule.from_dict: malformed schedule data ({type(err).__name__}: {err}). Expected keys "
                "name, num_stages, edges [[u, v], ...], num_microbatches [n_0, ...] and ranks "
                "[[[stage, microbatch, 'F'|'B'], ...], ...], as written by Schedule.to_dict()."
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


# ---------------------------------------------------------------------------------------------
# Registry


Builder = Callable[..., Schedule]
_REGISTRY: dict[str, Builder] = {}


def register_schedule(name: str) -> Callable[[Builder], Builder]:
    """Decorator: register `builder(**options) -> Schedule` under `name` for `schedule(name, ...)`."""

    def deco(builder: Builder) -> Builder:
        if name in _REGISTRY and _REGISTRY[name] is not builder:
            raise ScheduleError(f"register_schedule: {name!r} is already registered; pick another name.")
        _REGISTRY[name] = builder
        return builder

    return deco


def schedule_names() -> list[str]:
    return sorted(_REGISTRY)


def schedule(name: str, **options: Any) -> Schedule:
    """Build the registered schedule `name`, e.g. `schedule("1f1b", num_stages=4, num_microbatches=8)`,
    and validate it before returning."""
    from ._validate import validate

    if name not in _REGISTRY:
        raise ScheduleError(f"schedule: unknown schedule {name!r}; registered: {', '.join(schedule_names())}.")
    sched = _REGISTRY[name](**options)
    validate(sched)
    return sched


def check_positive_int(fn: str, arg: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ScheduleError(f"{fn}: {arg} must be a positive int, got {value!r}.")
    return int(value)


def _chain_args(fn: str, num_stages: Any, num_microbatches: Any) -> tuple[int, int]:
    p = check_positive_int(fn, "num_stages", num_stages)
    if not isinstance(num_microbatches, numbers.Integral):
        per_stage = list(num_microbatches)
        if len(per_stage) != p or len(set(per_stage)) != 1:
            raise ScheduleError(
                f"{fn}: chain schedules run one micro-batch count on every stage, got {per_stage} "
                f"for {p} stages. Pass one int, or use 'graph-1f1b' for per-stage micro-batch counts."
            )
        num_microbatches = per_stage[0]
    return p, check_positive_int(fn, "num_microbatches", num_microbatches)


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


@register_schedule("gpipe")
def gpipe(num_stages: int, num_microbatches: int | Sequence[int]) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards; each stage holds all m in flight."""
    p, m = _chain_args("gpipe", num_stages, num_microbatches)
    ranks = tuple(inflight_order(s, m, cap=m) for s in range(p))
    return Schedule("gpipe", p, chain_edges(p), (m,) * p, ranks)


@register_schedule("1f1b")
def one_f_one_b(num_stages: int, num_microbatches: int | Sequence[int]) -> Schedule:
    """Synchronous 1F1B (PipeDream-Flush): stage s warms up with p-s forwards, then alternates one
    backward and one forward, so it holds at most p-s micro-batches instead of GPipe's m."""
    p, m = _chain_args("1f1b", num_stages, num_microbatches)
    ranks = tuple(inflight_order(s, m, cap=p - s) for s in range(p))
    return Schedule("1f1b", p, chain_edges(p), (m,) * p, ranks)
