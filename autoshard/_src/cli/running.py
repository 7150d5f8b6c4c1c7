"""The commands that compile on simulated CPU devices: run (the main job) and audit.

Both keep XLA's C++ stderr (rematerialisation warnings and the like) out of their tables: it is
captured while jax works and summarised in one line after the report (with --debug it is left
to print as it comes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import warnings
from collections.abc import Iterator
from typing import Any

from ..core.errors import MeshError
from ..core.quantities import fmt_bytes, fmt_count, fmt_flops
from .args import UsageError
from .commands import load_plan, model_line, write_out
from .progress import NativeStderr, Progress
from .report import summary
from .tables import mesh_text, table
from .zoo import base_train_step, model_from_args

DEFAULT_RUN_MESH = {"data": 4, "model": 2}   # batch 4 over data, the FFN over model: names read right


def setup_devices(n: int) -> None:
    """n simulated CPU devices; must precede the first backend use (fine if it already has >= n)."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)
        jax.config.update("jax_platforms", "cpu")
    except RuntimeError:
        pass            # the backend already started: it must have enough devices
    if len(jax.devices()) < n:
        raise MeshError(f"the mesh needs {n} devices but this process already started jax with "
                        f"{len(jax.devices())}; run the command in a fresh process")


@contextlib.contextmanager
def jax_output(progress: Progress, debug: bool) -> Iterator[tuple[NativeStderr, list]]:
    """Capture C++ stderr (not with --debug) and Python warnings while jax compiles and runs, to report
    after the tables."""
    with warnings.catch_warnings(record=True) as records, NativeStderr(progress, enabled=not debug) as native:
        warnings.simplefilter("always")
        yield native, records


def captured_lines(native: NativeStderr, records: list, plan: Any) -> list[str]:
    """Python warnings (once each, minus those the plan report already printed), then XLA's stderr
    summarised in one line."""
    seen, lines = set(plan.warnings), []
    for w in records:
        text = str(w.message).removeprefix("autoshard: ")
        if text not in seen:
            seen.add(text)
            lines.append(f"warning: {text}")
    return lines + native.summary()


def run_mesh(args: argparse.Namespace) -> tuple[dict[str, int] | None, Any]:
    """(mesh to pass, plan file's Plan or None): --plan FILE brings its own mesh."""
    plan = load_plan(args.plan) if args.plan else None
    mesh = args.mesh if args.mesh is not None else (None if plan else dict(DEFAULT_RUN_MESH))
    if mesh == "auto":
        raise UsageError("--mesh", "run needs a concrete mesh (e.g. data=4,model=2); plan with --mesh auto, save "
                         "with --out and run that file with --plan FILE")
    shape = mesh if mesh is not None else dict(plan.mesh)
    setup_devices(math.prod(shape.values()))
    return mesh, plan


def train_step_for(args: argparse.Namespace, model: Any, pipelined: bool) -> Any:
    """The zoo's step; for pipeline plans, the same step with its loss under autoshard.value_and_grad."""
    if not pipelined:
        return model.train_step
    if type(model).train_step is not base_train_step():
        raise UsageError("--pipeline", f"{args.model} has its own train_step; pipeline runs need a model whose "
                                       "step is value_and_grad(loss) + its optimizer (e.g. gpt, bert, mlp)")
    import jax
    import optax

    import autoshard

    def train_step(params, opt_state, batch):     # model.train_step, its loss pipelined
        loss, grads = autoshard.value_and_grad(model.loss)(params, batch)
        with jax.named_scope("optimizer"):
            updates, opt_state = model.optimizer.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, opt_state, loss

    return train_step


def cmd_run(args: argparse.Namespace, progress: Progress, out: Any) -> int:
    """The main job: plan, compile and train a few steps on the simulated mesh next to one device."""
    mesh, given = run_mesh(args)
    model, overrides = model_from_args(args)
    import jax
    import numpy as np

    import autoshard

    pipelined = bool(args.pipeline) or bool(given and given.is_pipeline)
    if args.microbatches is not None and not pipelined:
        raise UsageError("--microbatches", "applies to pipeline runs only; add --pipeline rannc (with a 'pipe' "
                                           "mesh axis, e.g. --mesh pipe=2,data=4), or drop it")
    kw: dict[str, Any] = {"hardware": args.hardware, "memory_budget": args.memory_budget}
    kw.update({"mesh": mesh} if mesh is not None else {})
    kw.update({"plan": args.plan} if args.plan else {})
    if args.pipeline:
        kw["pipeline"] = args.pipeline
    if args.microbatches is not None and not args.pipeline:
        raise UsageError("--microbatches", f"the --plan file fixes its micro-batch count ({given.microbatches}); "
                                           "drop --microbatches, or add --pipeline to plan again with it")
    kw.update({"num_microbatches": args.microbatches} if args.pipeline else {})
    step = autoshard.autoshard(train_step_for(args, model, pipelined), **kw)
    init = jax.jit(model.init)
    batch = model.batch()
    losses = []
    with jax_output(progress, args.debug) as (native, records):
        params = init(jax.random.key(0))
        with progress.phase("trace + plan + place"):
            placed = step.place(params, model.init_opt_state(params), batch)
        with progress.phase("compile + step 1"):
            params_s, opt_s, loss = step(*placed)
            losses.append(float(loss))
        if args.steps > 1:
            with progress.phase("step 2" if args.steps == 2 else f"steps 2-{args.steps}"):
                for _ in range(args.steps - 1):
                    params_s, opt_s, loss = step(params_s, opt_s, placed[2])   # placed: no recompile
                    losses.append(float(loss))
        with progress.phase("1-device reference"):
            ref_step, ref, ref_losses = jax.jit(model.train_step), init(jax.random.key(0)), []
            ref = (ref, model.init_opt_state(ref))
            for _ in range(args.steps):
                *ref, loss_r = ref_step(*ref, batch)
                ref_losses.append(float(loss_r))
    plan = step.plan
    out(f"{model_line(args, model, overrides)}; {jax.device_count()} simulated CPU devices, mesh "
        f"{mesh_text(plan.mesh)}")
    out("")
    for line in summary(plan, args.full):
        out(line)
    if step.pipelined is not None:
        out("")
        for line in cut_lines(step.pipelined):
            out(line)
    out("")
    rows = [("step", "loss (autoshard)", "loss (1 device)")]
    rows += [(str(i + 1), f"{a:.6f}", f"{b:.6f}") for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True))]
    for line in table(rows, align="rrr", indent=""):
        out(line)
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(params_s), jax.tree.leaves(ref[0]), strict=True))
    out(f"\nmax |parameter difference| after {args.steps} step{'s' if args.steps > 1 else ''}: {diff:.2e}"
        + ("" if diff < 1e-4 else " (above 1e-4: the sharded run diverged from one device)"))
    progress.after(captured_lines(native, records, plan))
    return 0 if diff < 1e-4 else 1


def cut_lines(pipelined: Any) -> list[str]:
    """How the runtime cut the loss into the plan's stages (eqns, flops, what each stage receives)."""
    prog = pipelined.program
    rows = [("stage", "eqns", "compute/micro-batch", "params", "receives", "modules")]
    for st in pipelined.stages:
        mods = ", ".join(st.modules[:4]) + (" ..." if len(st.modules) > 4 else "")
        rows.append((str(st.index), str(st.eqns), fmt_flops(st.flops), str(len(st.params)),
                     f"{st.receives} ({fmt_bytes(st.receive_bytes)})", mods or "-"))
    return [f"runtime cut of the loss: {len(pipelined.stages)} stages, {prog.num_microbatches} micro-batches, "
            f"schedule {prog.schedule.name}, mesh {mesh_text(dict(pipelined.mesh.shape).items())}",
            *table(rows, align="lrrrrl")]


def cmd_audit(args: argparse.Namespace, progress: Progress, out: Any) -> int:
    """Compile a plan on simulated devices and compare collectives and memory with its prediction."""
    mesh, given = run_mesh(args)
    model, _ = model_from_args(args)
    import autoshard

    state = model.abstract_state()
    with jax_output(progress, args.debug) as (native, records):
        with progress.phase("trace + plan"):
            if given is not None:
                plan = autoshard.bind(given, *state)
            elif args.expert:
                plan = autoshard.expert_plan(args.expert, model.train_step, *state, mesh=mesh, hardware=args.hardware)
            else:
                plan = autoshard.plan(model.train_step, *state, mesh=mesh, hardware=args.hardware,
                                      memory_budget=args.memory_budget)
        with progress.phase("compile + audit"):
            audit = autoshard.audit(plan, model.train_step, *state)
    which = args.expert or (f"plan file {args.plan}" if args.plan else "autoshard")
    out(f"{args.model} ({args.config} config), {fmt_count(model.num_params())} parameters: {which} plan, "
        f"storage {plan.storage}")
    for line in audit_lines(audit):
        out(line)
    write_out(args.out, json.dumps(audit.to_dict(), indent=1, sort_keys=True), out)
    progress.after(captured_lines(native, records, plan))
    return 0 if audit.fidelity_ok else 1


def audit_lines(a: Any) -> list[str]:
    lines = [f"audit on {a.platform}, mesh {mesh_text(a.mesh)}: the compiled program vs the plan", ""]
    rows = [("collective", "predicted", "compiled", "launches")]
    for k in sorted(set(a.predicted_collectives) | set(a.audited_collectives)):
        got = a.audited_collectives.get(k, {"bytes": 0.0, "count": 0.0})
        rows.append((k, fmt_bytes(a.predicted_collectives.get(k, 0.0)), fmt_bytes(got["bytes"]), f"{got['count']:g}"))
    lines += ["collectives (bytes per device per step):", *table(rows, align="lrrr"), ""]
    mods = list(a.by_module().items())
    if mods:
        lines.append("collective bytes by source module" + (f" (top 8 of {len(mods)})" if len(mods) > 8 else "") + ":")
        lines += table([("module", "bytes"), *((m, fmt_bytes(b)) for m, b in mods[:8])], align="lr")[2:]
        lines.append("")
    rows = [("memory per device", "predicted", "compiled")]
    for name in ("argument", "temp", "argument+temp"):
        rows.append((name, fmt_bytes(a.predicted_memory.get(name, 0.0)), fmt_bytes(a.memory.get(name, 0))))
    lines += table(rows, align="lrr")
    lines.append(f"compiled program: {fmt_flops(a.cost.get('flops', 0.0))}, "
                 f"{fmt_bytes(a.cost.get('bytes accessed', 0.0))} accessed per device")
    if a.gaps:
        lines += ["", "gaps beyond tolerance:"]
        lines += [_gap_line(g, " [backend-specific]" if g.backend_specific else "") for g in a.gaps]
    if a.minor_gaps:
        lines += ["", "minor gaps (small against the step's collective bytes; not counted by fidelity):"]
        lines += [_gap_line(g, f" [{a.share(g):.1%} of the step]") for g in a.minor_gaps]
    return lines + [f"note: {n}" for n in a.notes]


def _gap_line(g: Any, tag: str) -> str:
    src = ", ".join(f"{m} {fmt_bytes(b)}" for m, b in g.modules[:5])
    size = fmt_bytes if g.what.startswith(("memory", "collective")) else str
    return (f"  {g.what}: predicted {size(g.predicted)}, compiled {size(g.audited)} ({g.relative:.0%}){tag}; {g.note}"
            + (f"; from {src}" if src else ""))
