"""The `autoshard` command line (also `python -m autoshard`).

Runs on the embedded default: a simulated 8-device CPU mesh. The model zoo (`models`) is a
separate package the CLI imports lazily; the library itself never imports it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def _parse_value(text: str) -> Any:
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def _setup_devices(n: int) -> Any:
    import jax

    # must precede the first backend use; harmless when the backend already has n devices
    jax.config.update("jax_num_cpu_devices", n)
    jax.config.update("jax_platforms", "cpu")
    from jax.sharding import AxisType

    return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))


def _cmd_group(args: argparse.Namespace) -> int:
    import autoshard
    import models

    overrides = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            print(f"autoshard group: --set expects key=value, got {item!r}", file=sys.stderr)
            return 2
        overrides[key] = _parse_value(value)
    if args.layers is not None:
        overrides["num_layers"] = args.layers
    try:
        model = models.get(args.model, args.config, **overrides)
    except ValueError as err:
        print(f"autoshard group: {err}", file=sys.stderr)
        return 2
    mesh = _setup_devices(args.devices)
    t0 = time.perf_counter()
    step_args = model.abstract_state()
    graph = autoshard.trace(model.train_step, *step_args, name=f"{args.model}:{args.config}")
    t1 = time.perf_counter()
    grouping = autoshard.group(graph, min_duplicate=args.min_duplicate)
    t2 = time.perf_counter()
    if args.json:
        out = {"model": args.model, "config": args.config, "overrides": overrides,
               "mesh": dict(mesh.shape), "params": model.num_params(),
               "trace_seconds": t1 - t0, "group_seconds": t2 - t1, **grouping.summary()}
        print(json.dumps(out, indent=2))
        return 0
    print(f"model: {args.model} ({args.config}{', ' if overrides else ''}"
          f"{', '.join(f'{k}={v}' for k, v in overrides.items())}), "
          f"{model.num_params() / 1e6:.1f}M parameters, traced abstractly")
    print(f"mesh: {dict(mesh.shape)} on {mesh.devices.size} simulated CPU devices")
    print(graph.summary())
    print(f"trace {t1 - t0:.2f} s, group {t2 - t1:.3f} s\n")
    print(grouping.table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="autoshard",
        description="Automatic parallelism for JAX train steps. With no command: trace and group "
                    "GPT-2 small on a simulated 8-device CPU mesh and print the block table.")
    sub = p.add_subparsers(dest="command")
    g = sub.add_parser("group", help="trace a zoo model's train step and print its unique blocks")
    g.add_argument("model", nargs="?", default="gpt", help="model name (see models.names())")
    g.add_argument("--config", default="gpt2-small", help="config name (default gpt2-small)")
    g.add_argument("--layers", type=int, default=None, help="override num_layers")
    g.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field")
    g.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    g.add_argument("--min-duplicate", type=int, default=2, help="TAP's minDuplicate")
    g.add_argument("--json", action="store_true", help="print JSON instead of the table")
    g.set_defaults(func=_cmd_group)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # no command (or only options): the default job, `group`
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["group", *argv]
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
