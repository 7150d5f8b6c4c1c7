"""The partitioner registry: names -> `Partitioner` objects (pure: no jax import).

Built-ins are the objects their own folders define (`rannc.partitioner.RANNC`,
`graphpipe.partitioner.GRAPHPIPE`); `register_partitioner` adds one from anywhere. The name
"auto" is reserved: the plan layer runs every partitioner that applies and keeps the plan whose
schedule the event simulator finishes first.
"""

from __future__ import annotations

from ..core.errors import ConfigError
from .graphpipe.partitioner import GRAPHPIPE
from .partition import Partitioner
from .rannc.partitioner import RANNC

AUTO = "auto"
_BUILTIN: dict[str, Partitioner] = {p.name: p for p in (RANNC, GRAPHPIPE)}
_REGISTRY: dict[str, Partitioner] = dict(_BUILTIN)


def register_partitioner(partitioner: Partitioner) -> Partitioner:
    """Register `partitioner` under its `.name` (see `Partitioner`); returns it, so it can decorate."""
    if not isinstance(partitioner, Partitioner):
        raise ConfigError(f"register_partitioner: {partitioner!r} lacks name, schedules, options, unsupported() or "
                          "partition(); see autoshard's Partitioner protocol.")
    name = partitioner.name
    if name == AUTO or (name in _REGISTRY and _REGISTRY[name] is not partitioner):
        raise ConfigError(f"register_partitioner: {name!r} is {'reserved' if name == AUTO else 'already registered'}; "
                          "pick another name.")
    _REGISTRY[name] = partitioner
    return partitioner


def unregister_partitioner(name: str) -> None:
    """Remove a partitioner registered with `register_partitioner` (built-ins stay)."""
    if name in _BUILTIN:
        raise ConfigError(f"unregister_partitioner: {name!r} is a built-in partitioner and cannot be removed.")
    _REGISTRY.pop(name, None)


def partitioner_names() -> list[str]:
    """Registered partitioner names, in registration order (built-ins first)."""
    return list(_REGISTRY)


def get_partitioner(name: str) -> Partitioner:
    if name not in _REGISTRY:
        raise ConfigError(f"autoshard: pipeline={name!r} is unknown; valid: {[*_REGISTRY, AUTO]} (or None for tensor "
                          "sharding only).")
    return _REGISTRY[name]
