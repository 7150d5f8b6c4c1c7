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

from .pipeline.registry import get_partitioner, partitioner_names
from .pipeline.schedules.registry import schedule_names
from .plan.config import PROFILES


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


def _parse_mesh(text: str) -> dict[str, int]:
    """"data=2,model=4" → {"data": 2, "model": 4}."""
    out = {}
    for part in text.split(","):
        name, sep, size = part.partition("=")
        if not sep or not size.strip().isdigit():
            raise SystemExit(f"autoshard: --mesh expects name=size[,name=size...], got {text!r}")
        out[name.strip()] = int(size)
    return out


def _model_from_args(args: argparse.Namespace):
    import models

    overrides = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"autoshard: --set expects key=value, got {item!r}")
        overrides[key] = _parse_value(value)
    if args.layers is not None:
        overrides["num_layers"] = args.layers
    try:
        return models.get(args.model, args.config, **overrides), overrides
    except ValueError as err:
        raise SystemExit(f"autoshard: {err}") from err


def _cmd_plan(args: argparse.Namespace) -> int:
    import autoshard

    model, _ = _model_from_args(args)
    mesh = _parse_mesh(args.mesh)
    t0 = time.perf_counter()
    extra = {}
    if args.pipeline:
        extra = {"pipeline": args.pipeline, "schedule": args.schedule, "profile": args.profile,
                 "pipeline_options": _pipeline_options(args)}
    plan = autoshard.plan(model.train_step, *model.abstract_state(), mesh=mesh, hardware=args.hardware,
                          memory_budget=args.memory_budget, **extra)
    print(f"model: {args.model} ({args.config}), {model.num_params() / 1e6:.1f}M parameters, planned "
          f"abstractly in {time.perf_counter() - t0:.2f} s (search {plan.predicted['search_seconds']:.3f} s)")
    print(plan.explain())
    if args.out:
        with open(args.out, "w") as f:
            f.write(plan.to_json())
        print(f"\nwrote {args.out}")
    return 0


def _pipeline_options(args: argparse.Namespace) -> dict:
    """The --blocks / --recompute flags, for the partitioners (registered by name) that take them."""
    names = partitioner_names() if args.pipeline == "auto" else [args.pipeline]
    accepted = set().union(*(get_partitioner(n).options for n in names))
    return {k: v for k, v in {"k": args.blocks, "recompute": args.recompute}.items() if k in accepted}


def _cmd_schedule(args: argparse.Namespace) -> int:
    """Pipeline-plan a zoo model and print its schedule as a Gantt chart from the event simulator."""
    import autoshard
    import pipeline

    model, _ = _model_from_args(args)
    plan = autoshard.plan(model.train_step, *model.abstract_state(), mesh=_parse_mesh(args.mesh),
                          hardware=args.hardware, memory_budget=args.memory_budget, pipeline=args.pipeline,
                          schedule=args.schedule, pipeline_options=_pipeline_options(args))
    print(plan.explain())
    if plan.schedule == "graph-1f1b":   # a stage DAG with per-stage micro-batch counts
        sched = pipeline.schedule(plan.schedule, num_microbatches=[s.microbatches for s in plan.stages],
                                  edges=[(a, s.index) for s in plan.stages for a in s.after])
    else:
        sched = pipeline.schedule(plan.schedule, num_stages=len(plan.stages), num_microbatches=plan.microbatches)
    sim = pipeline.simulate(sched, forward=[s.predicted_forward for s in plan.stages],
                            backward=[s.predicted_backward for s in plan.stages])
    print()
    print(sim.gantt(max_width=args.width))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    """The main job: plan, compile and train a few steps on the simulated mesh; compare losses
    with single-device training."""
    mesh = _parse_mesh(args.mesh)
    n = 1
    for s in mesh.values():
        n *= s
    _setup_devices(n)
    import jax
    import numpy as np

    import autoshard

    model, _ = _model_from_args(args)
    train_step = model.train_step
    pipe_kw = {}
    if args.pipeline:
        if type(model).train_step is not _base_train_step():
            print(f"autoshard run: --pipeline needs a model whose train step is value_and_grad(loss) + its "
                  f"optimizer; {args.model} has its own train_step.", file=sys.stderr)
            return 2
        import optax

        def train_step(params, opt_state, batch):     # model.train_step, its loss pipelined
            loss, grads = autoshard.value_and_grad(model.loss)(params, batch)
            with jax.named_scope("optimizer"):
                updates, opt_state = model.optimizer.update(grads, opt_state, params)
                params = optax.apply_updates(params, updates)
            return params, opt_state, loss

        pipe_kw = {"pipeline": args.pipeline, "num_microbatches": args.microbatches}
    step = autoshard.autoshard(train_step, mesh=mesh, hardware=args.hardware,
                               memory_budget=args.memory_budget, **pipe_kw)
    params = model.init(jax.random.key(0))
    opt = model.init_opt_state(params)
    batch = model.batch()
    t0 = time.perf_counter()
    params_s, opt_s, loss = step(params, opt, batch)
    first = time.perf_counter() - t0
    print(f"model: {args.model} ({args.config}), {model.num_params() / 1e6:.2f}M parameters; "
          f"mesh {mesh} on {jax.device_count()} simulated CPU devices")
    print(f"first call (trace, plan, compile, place): {first:.2f} s\n")
    print(step.explain())
    print("\nstep  loss (autoshard)  loss (1 device)")
    ref_step = jax.jit(model.train_step)
    params_r, opt_r = model.init(jax.random.key(0)), None
    opt_r = model.init_opt_state(params_r)
    params_r, opt_r, loss_r = ref_step(params_r, opt_r, batch)
    losses = [(float(loss), float(loss_r))]
    for _ in range(args.steps - 1):
        params_s, opt_s, loss = step(params_s, opt_s, batch)
        params_r, opt_r, loss_r = ref_step(params_r, opt_r, batch)
        losses.append((float(loss), float(loss_r)))
    for i, (a, b) in enumerate(losses):
        print(f"{i:>4}  {a:>16.6f}  {b:>15.6f}")
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(params_s), jax.tree.leaves(params_r), strict=True))
    print(f"\nmax |parameter difference| after {args.steps} steps: {diff:.2e}")
    return 0 if diff < 1e-4 else 1


def _base_train_step():
    from models._base import Model

    return Model.train_step


def _cmd_audit(args: argparse.Namespace) -> int:
    """Plan (or take an expert plan), compile on the simulated mesh, compare with the prediction."""
    mesh = _parse_mesh(args.mesh)
    n = 1
    for s in mesh.values():
        n *= s
    _setup_devices(n)
    import autoshard

    model, _ = _model_from_args(args)
    step_args = model.abstract_state()
    if args.expert:
        plan = autoshard.expert_plan(args.expert, model.train_step, *step_args, mesh=mesh, hardware=args.hardware)
    else:
        plan = autoshard.plan(model.train_step, *step_args, mesh=mesh, hardware=args.hardware,
                              memory_budget=args.memory_budget)
    report = autoshard.audit(plan, model.train_step, *step_args)
    print(f"model: {args.model} ({args.config}), plan: {args.expert or 'auto'} ({plan.storage})")
    print(report.report())
    if args.out:
        with open(args.out, "w") as f:
            f.write(report.to_json())
        print(f"\nwrote {args.out}")
    return 0 if report.fidelity_ok else 1


def _add_model_args(p: argparse.ArgumentParser, config: str) -> None:
    p.add_argument("model", nargs="?", default="gpt", help="model name (see models.names())")
    p.add_argument("--config", default=config, help=f"config name (default {config})")
    p.add_argument("--layers", type=int, default=None, help="override num_layers")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="autoshard",
        description="Automatic parallelism for JAX train steps. With no command: plan the debug GPT "
                    "on a simulated 8-device CPU mesh, train 3 steps and compare with one device.")
    sub = p.add_subparsers(dest="command")
    r = sub.add_parser("run", help="plan, compile and train a few steps on simulated devices (default)")
    _add_model_args(r, "debug")
    r.add_argument("--mesh", default="data=2,model=4", help="name=size,... (default data=2,model=4)")
    r.add_argument("--hardware", default="cpu-sim", help="hardware preset for the cost model")
    r.add_argument("--memory-budget", type=float, default=None, help="bytes per device")
    r.add_argument("--steps", type=int, default=3)
    r.add_argument("--pipeline", default=None, choices=[*partitioner_names(), "auto"],
                   help="run a pipeline plan (rannc/auto: give the mesh a 'pipe' axis) instead of tensor sharding")
    r.add_argument("--microbatches", type=int, default=None, help="pipeline micro-batches (default: the plan's)")
    r.set_defaults(func=_cmd_run)
    for name, text in (("plan", "plan a zoo model abstractly (any mesh size) and explain it"),
                       ("explain", "same as plan")):
        pl = sub.add_parser(name, help=text)
        _add_model_args(pl, "gpt2-small")
        pl.add_argument("--mesh", default="data=2,model=4", help="name=size,... (default data=2,model=4)")
        pl.add_argument("--hardware", default="h100-sxm")
        pl.add_argument("--memory-budget", type=float, default=None, help="bytes per device")
        pl.add_argument("--out", default=None, help="write the plan as JSON")
        pl.add_argument("--pipeline", default=None, choices=[*partitioner_names(), "auto"],
                        help="pipeline stages instead of tensor sharding")
        pl.add_argument("--schedule", default="1f1b", choices=schedule_names(), help="pipeline schedule")
        pl.add_argument("--profile", default="model", choices=list(PROFILES),
                        help="op costs: hardware roofline, or timed on this machine")
        pl.add_argument("--blocks", type=int, default=32, help="RaNNC block count k (default 32)")
        pl.add_argument("--recompute", action="store_true", help="recompute stage forwards in backward")
        pl.set_defaults(func=_cmd_plan)
    sc = sub.add_parser("schedule", help="pipeline-plan a zoo model and print its schedule (Gantt chart)")
    _add_model_args(sc, "debug")
    sc.add_argument("--mesh", default="pipe=4,data=2", help="name=size,... (a 'pipe' axis fixes the stage count)")
    sc.add_argument("--hardware", default="cpu-sim")
    sc.add_argument("--memory-budget", type=float, default=None, help="bytes per device")
    sc.add_argument("--pipeline", default="rannc", choices=[*partitioner_names(), "auto"])
    sc.add_argument("--schedule", default="1f1b", choices=schedule_names())
    sc.add_argument("--blocks", type=int, default=32, help="RaNNC block count k (default 32)")
    sc.add_argument("--recompute", action="store_true")
    sc.add_argument("--width", type=int, default=120, help="Gantt chart columns")
    sc.set_defaults(func=_cmd_schedule)
    au = sub.add_parser("audit", help="compile a plan on simulated devices; collectives and memory vs prediction")
    _add_model_args(au, "debug")
    au.add_argument("--mesh", default="data=2,model=4", help="name=size,... (its product = simulated devices)")
    au.add_argument("--hardware", default="cpu-sim")
    au.add_argument("--memory-budget", type=float, default=None, help="bytes per device")
    au.add_argument("--expert", default=None, help="audit an expert plan instead: data-parallel, fsdp, "
                                                   "megatron or data-megatron")
    au.add_argument("--out", default=None, help="write the audit as JSON")
    au.set_defaults(func=_cmd_audit)
    g = sub.add_parser("group", help="trace a zoo model's train step and print its unique blocks")
    _add_model_args(g, "gpt2-small")
    g.add_argument("--devices", type=int, default=8, help="simulated CPU devices (default 8)")
    g.add_argument("--min-duplicate", type=int, default=2, help="TAP's minDuplicate")
    g.add_argument("--json", action="store_true", help="print JSON instead of the table")
    g.set_defaults(func=_cmd_group)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # no command (or only options): the main job, `run`
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["run", *argv]
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
