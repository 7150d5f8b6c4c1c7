"""The schedule registry: names -> builders `builder(**options) -> Schedule`.

Built-ins come from the modules that define them (`chain`, `graph_1f1b`, `interleaved`: SCHEDULES);
`register_schedule` adds more from anywhere, and `schedule(name, ...)` builds and validates one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...core.errors import ScheduleError
from . import chain, graph_1f1b, interleaved
from .schedule import Schedule, validate

Builder = Callable[..., Schedule]
_BUILT_IN = {**chain.SCHEDULES, **graph_1f1b.SCHEDULES, **interleaved.SCHEDULES}
_REGISTRY: dict[str, Builder] = dict(_BUILT_IN)


def register_schedule(name: str) -> Callable[[Builder], Builder]:
    """Decorator: register `builder(**options) -> Schedule` under `name` for `schedule(name, ...)`."""

    def deco(builder: Builder) -> Builder:
        if name in _REGISTRY and _REGISTRY[name] is not builder:
            raise ScheduleError(f"register_schedule: {name!r} is already registered; pick another name.")
        _REGISTRY[name] = builder
        return builder

    return deco


def unregister_schedule(name: str) -> None:
    """Remove a schedule registered with `register_schedule` (built-ins stay)."""
    if name in _BUILT_IN:
        raise ScheduleError(f"unregister_schedule: {name!r} is a built-in schedule and cannot be removed.")
    _REGISTRY.pop(name, None)


def schedule_names() -> list[str]:
    return sorted(_REGISTRY)


def schedule(name: str, **options: Any) -> Schedule:
    """Build the registered schedule `name`, e.g. `schedule("1f1b", num_stages=4, num_microbatches=8)`,
    and validate it before returning."""
    if name not in _REGISTRY:
        raise ScheduleError(f"schedule: unknown schedule {name!r}; registered: {', '.join(schedule_names())}.")
    sched = _REGISTRY[name](**options)
    validate(sched)
    return sched
