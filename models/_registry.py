"""Name -> (Model subclass, named configs) table, filled by the `register` decorator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ._base import Model, replace_config

M = TypeVar("M", bound=type[Model])

_REGISTRY: dict[str, tuple[type[Model], dict[str, Any]]] = {}


def register(name: str, configs: dict[str, Any]) -> Callable[[M], M]:
    """Class decorator registering a Model subclass under `name` with its named configs."""

    def deco(cls: M) -> M:
        if name in _REGISTRY:
            raise ValueError(f"model {name!r} registered twice")
        _REGISTRY[name] = (cls, dict(configs))
        return cls

    return deco


def names() -> list[str]:
    return sorted(_REGISTRY)


def _lookup(name: str) -> tuple[type[Model], dict[str, Any]]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; valid models: {names()}")
    return _REGISTRY[name]


def configs(name: str) -> list[str]:
    """Config names of model `name`, in declaration order (smallest/debug first)."""
    return list(_lookup(name)[1])


def get(name: str, config: str = "debug", **overrides: Any) -> Model:
    """Instantiate model `name` with named `config`, optionally overriding config fields."""
    cls, table = _lookup(name)
    if config not in table:
        raise ValueError(f"unknown config {config!r} for model {name!r}; valid configs: {list(table)}")
    return cls(name, config, replace_config(table[config], overrides))
