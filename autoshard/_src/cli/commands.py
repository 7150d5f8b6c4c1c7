"""The abstract commands: plan, explain, schedule, group, list (nothing compiled, any mesh size)."""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any

import autoshard

from ..bridge.api import local_config, plan_traced
from ..core.hardware import get_hardware, presets
from ..core.quantities import fmt_bytes, fmt_count, fmt_flops, fmt_rate
from ..pipeline.registry import get_partitioner, partitioner_names
from ..pipeline.schedules.registry import schedule_names
from ..plan.config import Config
from ..tensor.experts import EXPERTS
from .args import UsageError
from .progress import Progress
from .report import explanation, summary
from .stages import gantt_lines
from .tables import mesh_text, table
from .zoo import model_from_args, model_names

DEFAULT_AUTO_DEVICES = 8


def model_line(args: argparse.Namespace, model: Any, overrides: dict) -> str:
    extra = "".join(f", {k}={v}" for k, v in overrides.items())
    return f"{args.model} ({args.config} config{extra}): {fmt_count(model.num_params())} parameters"


# flag -> the pipeline option it sets
_OPTION_FLAGS = {"--blocks": ("blocks", "k"), "--recompute": ("recompute", "recompute")}


def pipeline_options(args: argparse.Namespace) -> dict:
    """--blocks / --recompute as pipeline options; refused where --pipeline's partitioner(s) take no such
    option (a flag silently dropped would plan something else than asked)."""
    pipeline = getattr(args, "pipeline", None)
    names = partitioner_names() if pipeline == "auto" else [pipeline] if pipeline else []
    accepted = set().union(*(get_partitioner(n).options for n in names))
    out = {}
    for flag, (attr, key) in _OPTION_FLAGS.items():
        value = getattr(args, attr, None) or None
        if value is None:
            continue
        if not pipeline:
            raise UsageError(flag, "applies to pipeline plans only; add --pipeline rannc (or auto), or drop it")
        if key not in accepted:
            raise UsageError(flag, f"--pipeline {pipeline} takes no {key!r} option (its options: "
                                   f"{', '.join(sorted(accepted))}); use --pipeline rannc, or drop it")
        out[key] = value
    return out


def _check_flag_scope(args: argparse.Namespace) -> None:
    """Flags that only mean something with another flag are refused without it, never ignored."""
    if getattr(args, "schedule", None) and not getattr(args, "pipeline", None):
        raise UsageError("--schedule", "applies to pipeline plans only; add --pipeline rannc, graphpipe or auto")
    if getattr(args, "devices", None) is not None and args.mesh != "auto":
        raise UsageError("--devices", f"counts the devices for --mesh auto, but the mesh is fixed "
                                      f"({args.mesh or 'the --plan file'}); add --mesh auto, or drop --devices")


# what `plan` / `explain` plan with: a saved --plan is shown as it is, so these would be ignored
_PLANNING_FLAGS = ("--config", "--layers", "--set", "--mesh", "--hardware", "--memory-budget", "--devices",
                   "--pipeline", "--schedule", "--blocks", "--recompute", "--microbatches", "--profile")


def _refuse_planning_flags(args: argparse.Namespace) -> None:
    """--plan FILE shows the saved plan (its own mesh, hardware and model): planning flags, or a model
    other than the default, would be silently dropped."""
    typed = [f for f in _PLANNING_FLAGS if f in getattr(args, "given", set())]
    if typed or args.model != "gpt":
        what = ", ".join(typed + ([f"MODEL {args.model!r}"] if args.model != "gpt" else []))
        raise UsageError("--plan", f"shows the saved plan as it is (its own model, mesh and hardware), so {what} "
                                   "would be ignored; drop them, or drop --plan to plan anew")


def plan_config(args: argparse.Namespace) -> Config:
    """The Config the flags describe (mesh 'auto' takes --devices)."""
    _check_flag_scope(args)
    options = pipeline_options(args)
    kw: dict[str, Any] = {"mesh": args.mesh, "hardware": args.hardware, "memory_budget": args.memory_budget}
    if args.mesh == "auto":
        kw["devices"] = getattr(args, "devices", None) or DEFAULT_AUTO_DEVICES
    profile = getattr(args, "profile", "model")
    if getattr(args, "pipeline", None):
        kw.update(pipeline=args.pipeline, schedule=args.schedule or "1f1b", profile=profile, pipeline_options=options)
    elif profile != "model":
        raise UsageError("--profile", "measured op costs are for pipeline plans; add --pipeline rannc, graphpipe "
                                      "or auto")
    return local_config(Config.make(None, **kw))


def trace_and_plan(args: argparse.Namespace, model: Any, progress: Progress) -> Any:
    """Plan the zoo model's train step abstractly, one progress line per phase."""
    config = plan_config(args)
    state = model.abstract_state()
    measured = config.profile == "measured"
    with progress.phase("trace"):
        graph = autoshard.trace(model.train_step, *state, keep_eqns=measured)
    searching = "measure op times + search" if measured else "search"
    with progress.phase(searching):
        plan = plan_traced(model.train_step, state, graph, config, three_d=True)
    return autoshard.bind(plan, *state)


def load_plan(path: str) -> Any:
    return autoshard.Plan.from_json(Path(path).read_bytes())     # from_json names a binary file a PlanError


def write_out(path: str | None, text: str, out: Any) -> None:
    """--out FILE (checked writable at parsing); a failure now (disk full, removed meanwhile) is one line."""
    if not path:
        return
    try:
        Path(path).write_text(text)
    except OSError as err:
        raise UsageError("--out", f"could not write {path!r}: {err.strerror or err}; the results are printed "
                                  "above; write elsewhere") from None
    out(f"\nwrote {path}")


def cmd_plan(args: argparse.Namespace, progress: Progress, out: Any) -> int:
    """`plan` prints what was chosen; `explain` (same flags) prints why."""
    why = args.command == "explain"
    if args.plan:
        _refuse_planning_flags(args)
        plan = load_plan(args.plan)
        out(f"plan file {args.plan} (step {plan.provenance.get('step', '?')})")
    else:
        model, overrides = model_from_args(args)
        plan = trace_and_plan(args, model, progress)
        out(model_line(args, model, overrides))
    out("")
    for line in (explanation(plan, args.full) if why else summary(plan, args.full)):
        out(line)
    write_out(getattr(args, "out", None), plan.to_json(), out)
    return 0


def cmd_schedule(args: argparse.Namespace, progress: Progress, out: Any) -> int:
    """Pipeline-plan a zoo model and draw its schedule from the event simulator."""
    import pipeline

    model, overrides = model_from_args(args)
    plan = trace_and_plan(args, model, progress)
    out(model_line(args, model, overrides))
    out("")
    for line in summary(plan):
        out(line)
    if plan.schedule == "graph-1f1b":   # a stage DAG with per-stage micro-batch counts
        sched = pipeline.schedule(plan.schedule, num_microbatches=[s.microbatches for s in plan.stages],
                                  edges=[(a, s.index) for s in plan.stages for a in s.after])
    elif plan.schedule == "interleaved-1f1b":   # num_stages counts pipe ranks, each holding v stages
        pipe = dict(plan.mesh)["pipe"]
        sched = pipeline.schedule(plan.schedule, num_stages=pipe, num_microbatches=plan.microbatches,
                                  virtual_stages=len(plan.stages) // pipe)
    else:
        sched = pipeline.schedule(plan.schedule, num_stages=len(plan.stages), num_microbatches=plan.microbatches)
    sim = pipeline.simulate(sched, forward=[s.predicted_forward for s in plan.stages],
                            backward=[s.predicted_backward for s in plan.stages])
    out("")
    for line in gantt_lines(sim, args.width):
        out(line)
    return 0


def cmd_group(args: argparse.Namespace, progress: Progress, out: Any) -> int:
    """Trace a zoo model's step and print its unique block types (TAP's PruneGraph)."""
    model, overrides = model_from_args(args)
    state = model.abstract_state()
    with progress.phase("trace"):
        graph = autoshard.trace(model.train_step, *state, name=f"{args.model}:{args.config}")
    with progress.phase("group"):
        grouping = autoshard.group(graph, min_duplicate=args.min_duplicate)
    grouped = grouping.summary()
    if args.json:
        out(json.dumps({"model": args.model, "config": args.config, "overrides": overrides,
                        "params": model.num_params(), **grouped}, indent=2))
        return 0
    phases = ", ".join(f"{k} {v}" for k, v in graph.ops_by_phase().items() if v)
    out(model_line(args, model, overrides) + ", traced abstractly")
    out(f"{len(graph.ops)} ops ({phases}), {len(graph.inputs)} inputs ({fmt_bytes(graph.input_bytes())}), "
        f"{fmt_flops(graph.total_flops)} per step")
    out("")
    rows = [("block type", "depth", "instances", "forward ops", "backward ops", "optimizer ops", "params",
             "compute/instance")]
    for b in grouped["block_types"]:
        ops = b["ops_per_instance"]
        rows.append((b["name"], str(b["depth"]), str(b["instances"]), str(ops["forward"]), str(ops["backward"]),
                     str(ops["optimizer"]), str(b["params_per_instance"]), fmt_flops(b["gflops_per_instance"] * 1e9)))
    for line in table(rows, align="lrrrrrrr", indent=""):
        out(line)
    out(f"(and {grouped['remainder_ops']} ops outside every block: embeddings, loss, the rest of the optimizer)")
    out("")
    out(f"repeated groups by depth (min_duplicate={args.min_duplicate}):")
    for lv in grouped["levels"]:
        out(f"  depth {lv['depth']}: {lv['name']} x{lv['count']} ({lv['forward_ops']} forward ops)"
            + (" selected" if lv["selected"] else ""))
    return 0


def cmd_list(args: argparse.Namespace, progress: Progress, out: Any) -> int:
    """Everything a flag can name: models and configs, hardware, schedules, partitioners, experts."""
    out("models (MODEL --config CONFIG; the first config is the debug size):")
    rows = [("model", "configs")]
    for name, configs in model_names():
        for k, chunk in enumerate(textwrap.wrap(", ".join(configs), 90)):
            rows.append((name if k == 0 else "", chunk))
    for line in table(rows):
        out(line)
    out("")
    out("hardware presets (--hardware):")
    rows = [("preset", "memory", "peak bf16", "memory bw", "devices/node", "intra-node bw", "inter-node bw")]
    for name in presets():
        hw = get_hardware(name)
        flops = hw.flops.get("bfloat16", hw.flops["float32"])
        rows.append((name, fmt_bytes(hw.memory_bytes), f"{fmt_flops(flops)}/s", fmt_rate(hw.memory_bandwidth),
                     str(hw.devices_per_node), fmt_rate(hw.intra_node_bandwidth), fmt_rate(hw.inter_node_bandwidth)))
    for line in table(rows, align="lrrrrrr"):
        out(line)
    out("")
    out(f"schedules (--schedule): {', '.join(schedule_names())}")
    out("pipeline partitioners (--pipeline):")
    for name in partitioner_names():
        p = get_partitioner(name)
        out(f"  {name:<10} schedules {', '.join(p.schedules)}; options {', '.join(sorted(p.options))}")
    out("  auto       every partitioner that applies; keeps the shorter simulated step")
    out(f"expert plans (audit --expert, and the explain comparison): {', '.join(EXPERTS)}")
    out(f"mesh: --mesh name=size[,name=size...] (e.g. data=4,model=2; 'pipe' fixes the pipeline stages) "
        f"or --mesh auto --devices N; default simulated {mesh_text([('data', 4), ('model', 2)])}")
    return 0
