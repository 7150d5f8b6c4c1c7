"""The model zoo as the CLI sees it: a model from its flags, with every flag checked first.

The CLI is the one layer that imports `models`; the library never does.
"""

from __future__ import annotations

import dataclasses
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
    return models.get(args.model, args.config, **overrides), overrides


def _fields(config: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(config)]


def _override(config: Any, config_name: str, item: str) -> tuple[str, Any]:
    """'num_layers=4' -> ('num_layers', 4), typed by the config field; UsageError naming --set otherwise."""
    key, sep, text = (s.strip() for s in item.partition("="))
    if not sep or not key:
        raise UsageError("--set", f"{item!r} is not KEY=VALUE; e.g. --set num_layers=4")
    if key not in _fields(config):
        raise UsageError("--set", f"{type(config).__name__} has no field {key!r}; fields: {', '.join(_fields(config))}")
    kinds = _kinds(typing.get_type_hints(type(config))[key])
    current = getattr(config, key)
    if text.lower() == "none" and type(None) in kinds:
        return key, None
    for kind in (bool, int, float, str):
        if kind not in kinds:
            continue
        value = _convert(kind, text)
        if value is not None:
            if kind in (int, float) and isinstance(current, int | float) and current >= 1 and value < 1:
                raise UsageError("--set", f"{key}={text}: must be >= 1 (config {config_name} has {current})")
            return key, value
    names = " or ".join(k.__name__ for k in kinds if k is not type(None))
    raise UsageError("--set", f"{key}={text}: {key} is {names} (now {current!r}); e.g. --set {key}={current!r}")


def _kinds(hint: Any) -> tuple[type, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def _convert(kind: type, text: str) -> Any:
    if kind is bool:
        return {"true": True, "false": False}.get(text.lower())
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
