"""The `autoshard` command line (also `python -m autoshard`): flags, dispatch and one-line errors.

Runs on the embedded default, a simulated 8-device CPU mesh. Every error is one line on stderr
with a non-zero exit (2 for a bad flag, 1 for a plan or run that fails); `--debug` anywhere on
the line shows the traceback instead. Command modules load on dispatch, so `--help` and flag
errors answer before jax is imported.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import math
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from ..core.errors import AutoshardError, InfeasiblePlanError
from ..core.hardware import presets
from ..core.quantities import fmt_bytes
from ..pipeline.registry import partitioner_names
from ..pipeline.schedules.registry import schedule_names
from ..plan.config import PROFILES
from ..tensor.experts import EXPERTS
from .args import MAX_LAYERS, Parser, UsageError, input_path, memory_budget, output_path, positive_int
from .args import hardware as hardware_flag
from .args import mesh as mesh_flag
from .progress import Progress

EPILOG = "Add --debug anywhere for full tracebacks. `autoshard list` shows models, hardware, schedules."
# command -> (module, function): imported on use
COMMANDS = {"run": ("running", "cmd_run"), "audit": ("running", "cmd_audit"), "plan": ("commands", "cmd_plan"),
            "explain": ("commands", "cmd_plan"), "schedule": ("commands", "cmd_schedule"),
            "group": ("commands", "cmd_group"), "list": ("commands", "cmd_list"), "sweep": ("sweep", "cmd_sweep")}


def _model_flags(p: argparse.ArgumentParser, config: str) -> None:
    p.add_argument("model", nargs="?", default="gpt", help="zoo model (default gpt; see autoshard list)")
    p.add_argument("--config", default=config, help=f"model config (default {config})")
    p.add_argument("--layers", type=positive_int, default=None, help="override num_layers (>= 1)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a config field, e.g. d_model=64")
    p.add_argument("--max-layers", type=positive_int, default=MAX_LAYERS, metavar="N",
                   help=f"refuse models deeper than N layers (default {MAX_LAYERS}: tracing unrolls every layer)")


def _planning_flags(p: argparse.ArgumentParser, mesh: str | None, hardware: str, auto: bool = False) -> None:
    shown = mesh or "data=4,model=2, or the --plan file's"
    p.add_argument("--mesh", type=mesh_flag, default=None if mesh is None else mesh_flag(mesh),
                   help=f"axis=size,... (default {shown})" + ("; 'auto': the planner chooses the shape of --devices"
                                                               if auto else ""))
    p.add_argument("--hardware", type=hardware_flag, default=hardware, metavar="PRESET",
                   help=f"cost-model hardware, one of: {', '.join(presets())} (default {hardware})")
    p.add_argument("--memory-budget", type=memory_budget, default=None, metavar="SIZE",
                   help="bytes per device with a unit, e.g. 16GiB (default: the hardware's memory)")


def _pipeline_flags(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument("--pipeline", default=default, choices=[*partitioner_names(), "auto"],
                   help="pipeline stages instead of tensor sharding (a 'pipe' mesh axis fixes the stage count)")
    p.add_argument("--schedule", default=None, choices=schedule_names(), help="pipeline schedule (default 1f1b)")
    p.add_argument("--blocks", type=positive_int, default=None, help="RaNNC block count k")
    p.add_argument("--recompute", action="store_true", help="recompute stage forwards in backward")


def _add(sub: Any, name: str, help_text: str, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_text, description=help_text, parents=[common], epilog=EPILOG)
    p.set_defaults(command=name)
    return p


def build_parser() -> argparse.ArgumentParser:
    common = Parser(add_help=False)
    common.add_argument("--debug", action="store_true", help="print full tracebacks (and all captured stderr)")
    p = Parser(prog="autoshard", parents=[common], epilog=EPILOG,
               description="Automatic parallelism for JAX train steps. With no command: plan the debug GPT on a "
                           "simulated 8-device CPU mesh (data=4 x model=2), train 3 steps and compare with one device.")
    sub = p.add_subparsers(title="commands", metavar="COMMAND")
    r = _add(sub, "run", "plan, compile and train a few steps on simulated devices next to one device (default)",
             common)
    _model_flags(r, "debug")
    _planning_flags(r, None, "cpu-sim")
    r.add_argument("--plan", type=input_path, metavar="FILE", help="run a saved plan (autoshard plan ... --out)")
    r.add_argument("--steps", type=positive_int, default=3, help="training steps (default 3)")
    r.add_argument("--pipeline", default=None, choices=[*partitioner_names(), "auto"],
                   help="run a pipeline plan (rannc/auto: give the mesh a 'pipe' axis)")
    r.add_argument("--microbatches", type=positive_int, default=None, help="pipeline micro-batches")
    r.add_argument("--full", action="store_true", help="one row per parameter")
    for name, text in (("plan", "plan a zoo model abstractly (any mesh size) and summarise the plan by block type"),
                       ("explain", "plan (or load --plan FILE) and say why: every logical dim, and the expert "
                                   "plans priced term by term")):
        pl = _add(sub, name, text, common)
        _model_flags(pl, "gpt2-small")
        _planning_flags(pl, "data=2,model=4", "h100-sxm", auto=True)
        pl.add_argument("--devices", type=positive_int, default=None,
                        help="device count for --mesh auto (default 8)")
        _pipeline_flags(pl, None)
        pl.add_argument("--profile", default="model", choices=list(PROFILES),
                        help="pipeline op costs: the hardware roofline, or measured on this machine")
        pl.add_argument("--plan", type=input_path, metavar="FILE", help="show a saved plan instead of planning")
        pl.add_argument("--out", type=output_path, metavar="FILE", help="write the plan as JSON")
        pl.add_argument("--full", action="store_true", help="one row per parameter")
    sc = _add(sub, "schedule", "pipeline-plan a zoo model and draw its schedule (Gantt chart)", common)
    _model_flags(sc, "debug")
    _planning_flags(sc, "pipe=4,data=2", "cpu-sim")
    _pipeline_flags(sc, "rannc")
    sc.add_argument("--width", type=positive_int, default=120, help="chart columns (default 120)")
    au = _add(sub, "audit", "compile a plan on simulated devices; collectives and memory vs the prediction", common)
    _model_flags(au, "debug")
    _planning_flags(au, None, "cpu-sim")
    au.add_argument("--expert", default=None, choices=EXPERTS, help="audit an expert plan instead")
    au.add_argument("--plan", type=input_path, metavar="FILE", help="audit a saved plan")
    au.add_argument("--out", type=output_path, metavar="FILE", help="write the audit as JSON")
    g = _add(sub, "group", "trace a zoo model's train step and print its unique block types", common)
    _model_flags(g, "gpt2-small")
    g.add_argument("--min-duplicate", type=positive_int, default=2, help="TAP's minDuplicate (default 2)")
    g.add_argument("--json", action="store_true", help="print JSON instead of the table")
    _add(sub, "list", "models and configs, hardware presets, schedules, partitioners, expert plans", common)
    sw = _add(sub, "sweep", "plan every model x mesh cell of a TOML file against the expert plans", common)
    sw.add_argument("config", metavar="CONFIG", type=input_path, help="sweep TOML (layout of bench/sweep.toml)")
    sw.add_argument("--quick", action="store_true", help="only entries marked quick = true")
    sw.add_argument("--audit", action="store_true", help="also compile the [[compiled]] cells and audit them")
    sw.add_argument("--out", type=output_path, metavar="FILE", help="write the rows as JSON")
    return p


def _with_command(argv: list[str]) -> list[str]:
    """No command (or only options): the main job, `run`."""
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        return ["run", *argv]
    return argv


def main(argv: list[str] | None = None) -> int:
    argv = _with_command(list(sys.argv[1:] if argv is None else argv))
    debug = "--debug" in argv
    args = build_parser().parse_args(argv)
    args.debug = debug
    args.given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}    # flags typed, not defaulted
    prog = f"autoshard {args.command}"
    progress = Progress()
    module, func = COMMANDS[args.command]
    try:
        with exit_on_interrupt(prog):
            command = getattr(importlib.import_module(f"{__package__}.{module}"), func)
            return command(args, progress, functools.partial(print, flush=True))   # in order with stderr
    except UsageError as err:
        if debug:
            raise
        print(f"{prog}: error: {err} (see {prog} --help)", file=sys.stderr)
        return 2
    except AutoshardError as err:
        if debug:
            raise
        print(f"{prog}: error: {_infeasible(err) or _one_line(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:      # a bug or a jax failure: still one line, the traceback on request
        if debug:
            raise
        print(f"{prog}: {type(err).__name__}: {_one_line(err)} (--debug shows the traceback)", file=sys.stderr)
        return 1


@contextlib.contextmanager
def exit_on_interrupt(prog: str) -> Iterator[None]:
    """Ctrl-C ends the command at once: one line on stderr, exit 130. A KeyboardInterrupt raised inside
    jax (an XLA callback, a compile, interpreter shutdown with XLA threads alive) can crash the process,
    and a Python handler waits for XLA to return; so the signal's C handler writes to a pipe that a
    thread watches, which exits the process (stdout is flushed line by line already). Only in the main
    thread (where signals are delivered); the previous handlers come back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    line = f"{prog}: interrupted\n".encode()
    stderr = os.dup(2)           # the terminal's stderr: fd 2 is captured while jax works (NativeStderr)

    def leave(*_: object) -> None:
        os.write(stderr, line)
        os._exit(130)

    def watch() -> None:
        while data := os.read(read, 64):
            if signal.SIGINT in data:
                leave()
        os.close(read)

    previous = signal.signal(signal.SIGINT, leave)
    old_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    threading.Thread(target=watch, name="autoshard-sigint", daemon=True).start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(old_fd)
        signal.signal(signal.SIGINT, previous)
        os.close(write)          # the watcher reads end-of-file, closes its end and returns
        os.close(stderr)


def _infeasible(err: AutoshardError) -> str | None:
    """The planner's memory error in flag terms, sizes auto-scaled."""
    if not isinstance(err, InfeasiblePlanError) or not all(
            isinstance(x, int | float) and math.isfinite(x) for x in (err.budget, err.min_memory)):
        return None
    return (f"no plan fits {fmt_bytes(err.budget)} per device: the plan needing least memory takes "
            f"{fmt_bytes(err.min_memory)}. Fix: raise --memory-budget, add devices to --mesh, or plan in 3-D "
            "(--mesh auto --devices N, or a 'pipe' mesh axis with --pipeline auto). --debug shows the planner's "
            "details")


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__
