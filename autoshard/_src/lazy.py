"""Lazy attributes for the public faces (pure: no jax import).

`autoshard` and `pipeline` export jax-facing names (the decorator, trace, the runtime) next to pure
ones. Loading the jax bridge only when such a name is first used keeps `import autoshard` and
`import pipeline` free of jax, so the pure layers load (and are tested) with jax absent.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(face: str, names: Mapping[str, str], eager: list[str]) -> tuple[Callable, Callable]:
    """(`__getattr__`, `__dir__`) for module `face`: `names` maps an exported name to the module
    (absolute) that defines it; the first access imports that module and caches the attribute."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {face!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name]), name)
        setattr(importlib.import_module(face), name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*eager, *names})

    return __getattr__, __dir__
