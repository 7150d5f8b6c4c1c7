"""The model zoo as the CLI sees it: a model from its flags, with every flag checked first.

The CLI is the one layer that imports `models`; the library never does.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

import models

from .args import MAX_LAYERS, UsageError


def model_from_args(args: Any) -> tuple[Any, dict[str, Any]]:
    """(models.Model, overrides) for the MODEL positional and the --config / --layers / --set flags."""
    if args.model not in models.names():
        raise UsageError("MODEL", f"unknown model {args.model!r}; choose one of {', '.join(models.names())}")
    if args.config not in models.configs(args.model):
        raise UsageError("--config", f"{args.model} has no config {args.config!r}; choose one of "
                                     f"{', '.join(models.configs(args.model))}")
    base = models.get(args.model, args.config).config
    overrides = {}
    for item in args.set or []:
        key, value = _override(base, args.config, item)
        overrides[key] = value
    if args.layers is not None:
        if "num_layers" not in _fields(base):
            raise UsageError("--layers", f"{args.model} has no num_layers; its fields: {', '.join(_fields(base))}")
        overrides["num_layers"] = args.layers
    layers, limit = overrides.get("num_layers"), getattr(args, "max_layers", MAX_LAYERS)
    if isinstance(layers, int) and layers > limit:
        flag = "--layers" if args.layers is not None else "--set"
        raise UsageError(flag, f"{layers} layers is above the limit of {limit}: tracing unrolls every layer (about "
                               f"0.1 s and 2 MB each), so this would take ~{layers // 600} min and "
                               f"~{layers * 2 // 1024} GB before planning starts; published models have <= 128 "
                               f"layers. Fix: fewer layers, or raise the limit with --max-layers {layers}")
    if not overrides:
        return models.get(args.model, args.config), overrides
    return _built(args, overrides, "--layers" if args.layers is not None and not args.set else "--set"), overrides


def _built(args: Any, overrides: dict[str, Any], flag: str) -> Any:
    """The model with overridden fields that each look fine but may not make a model together (num_heads
    not dividing d_model, an unknown dtype): built and its loss traced abstractly now (the parameters'
    shapes are cached for the command), so the flag is named in one line, not a model's traceback later."""
    import jax

    try:
        model = models.get(args.model, args.config, **overrides)
        jax.eval_shape(model.loss, model.abstract_params(), model.batch(abstract=True))
        return model
    except Exception as err:       # the config's own check or jax's shape error, whatever the model raises
        given = ", ".join(f"{k}={v}" for k, v in overrides.items())
        raise UsageError(flag, f"{args.model} --config {args.config} cannot be built with {given}: "
                               f"{type(err).__name__}: {' '.join(str(err).split())[:300]}. Fix: change the "
                               "override (autoshard list shows the configs)") from None


def _fields(config: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(config)]


def _override(config: Any, config_name: str, item: str) -> tuple[str, Any]:
    """'num_layers=4' -> ('num_layers', 4), typed and range-checked by the config field; UsageError naming
    --set otherwise."""
    key, sep, text = (s.strip() for s in item.partition("="))
    if not sep or not key:
        raise UsageError("--set", f"{item!r} is not KEY=VALUE; e.g. --set num_layers=4")
    if key not in _fields(config):
        raise UsageError("--set", f"{type(config).__name__} has no field {key!r}; fields: {', '.join(_fields(config))}")
    kinds = _kinds(typing.get_type_hints(type(config))[key])
    current = getattr(config, key)
    if text.lower() == "none" and type(None) in kinds:
        return key, None
    for kind in sorted((k for k in kinds if k is not type(None)), key=_parse_order):
        value = _convert(kind, text)
        if value is not None:
            _check_value(key, text, value, current, config_name)
            return key, value
    names = " or ".join(str(k) if typing.get_origin(k) else k.__name__ for k in kinds if k is not type(None))
    example = ",".join(map(str, current)) if isinstance(current, tuple) else repr(current)
    raise UsageError("--set", f"{key}={text}: {key} is {names} (now {current!r}); e.g. --set {key}={example}")


# a config value is a size, a count or a rate: every int >= 1 (paddings >= 0), every float finite and >= 0;
# a dimension past 2**31 is no model (and overflows XLA's 32-bit index arithmetic)
MAX_CONFIG_INT = 2**31 - 1


def _check_value(key: str, text: str, value: Any, current: Any, config_name: str) -> None:
    was = f"(config {config_name} has {current!r})"
    if isinstance(value, float):
        if not math.isfinite(value):
            raise UsageError("--set", f"{key}={text}: must be a finite number {was}")
        low = 1.0 if isinstance(current, int | float) and current >= 1 else 0.0
        if value < low:
            raise UsageError("--set", f"{key}={text}: must be >= {low:g} {was}")
        return
    ints = value if isinstance(value, tuple) else (value,) if type(value) is int else ()
    low = 0 if "padding" in key else 1
    each = "every entry " if isinstance(value, tuple) else ""
    for v in ints:
        if v < low:
            raise UsageError("--set", f"{key}={text}: {each}must be a whole number >= {low}, got {v} {was}")
        if v > MAX_CONFIG_INT:
            raise UsageError("--set", f"{key}={text}: {each}must be <= {MAX_CONFIG_INT} (2**31 - 1: no model has a "
                                      f"size that large), got {v} {was}")


def _parse_order(kind: Any) -> int:
    """bool before int before float before tuples before str: 'true' is a bool, '4' an int, not a str."""
    order = {bool: 0, int: 1, float: 2, str: 4}
    return order.get(kind, 3)


def _kinds(hint: Any) -> tuple[type, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _convert(kind: Any, text: str) -> Any:
    if kind is bool:
        return {"true": True, "false": False}.get(text.lower())
    if typing.get_origin(kind) is tuple:     # tuple[int, int] or tuple[int, ...]: '4,4' or '(4, 4)'
        args = typing.get_args(kind)
        parts = [p.strip() for p in text.strip("()[] ").split(",") if p.strip()]
        values = [_convert(args[0], p) for p in parts]
        fixed = Ellipsis not in args
        if not parts or None in values or (fixed and len(values) != len(args)):
            return None
        return tuple(values)
    if kind not in (int, float, str):
        return None
    try:
        return kind(text)
    except ValueError:
        return None


def model_names() -> list[tuple[str, list[str]]]:
    """(model, its config names) for `autoshard list`."""
    return [(name, models.configs(name)) for name in models.names()]


def base_train_step() -> Any:
    """The zoo's standard step (value_and_grad + optimizer): models with their own step cannot be
    pipelined by the CLI."""
    return models.Model.train_step
