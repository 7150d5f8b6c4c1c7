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
    """A spec read back from JSON lists: per dimension a list of axis names (ValueError otherwise, so a
    string such as "data" is not read as the axes d, a, t, a)."""
    if not isinstance(data, (list, tuple)) or not all(
            isinstance(axes, (list, tuple)) and all(isinstance(a, str) and a for a in axes) for axes in data):
        raise ValueError(f"the spec {data!r} is not a list of per-dimension lists of mesh axis names "
                         "(e.g. [[\"data\"], []])")
    return tuple(tuple(axes) for axes in data)
