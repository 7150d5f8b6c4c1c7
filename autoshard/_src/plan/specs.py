"""Sharding specs as plain data (pure): per tensor dimension, the tuple of mesh axes splitting it."""

from __future__ import annotations

Spec = tuple[tuple[str, ...], ...]     # e.g. (("data",), (), ("model",)): dim 0 on data, dim 2 on model


def spec_str(spec: Spec) -> str:
    """`P(data, None, (x,y))`-style text of a spec."""
    parts = []
    for axes in spec:
        parts.append("None" if not axes else (axes[0] if len(axes) == 1 else "(" + ",".join(axes) + ")"))
    return "P(" + ", ".join(parts) + ")"


def as_spec(data) -> Spec:
    """A spec read back from JSON lists."""
    return tuple(tuple(str(a) for a in axes) for axes in data)
