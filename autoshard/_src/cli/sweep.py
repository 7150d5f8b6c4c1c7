"""`autoshard sweep CONFIG`: plan every model x mesh cell of a TOML file and compare each plan with
the best expert plan under the same cost model; `--audit` also compiles the `compiled` cells on
simulated CPU devices and checks the predicted collective bytes against XLA's.

The file has the layout of bench/sweep.toml (which `python bench/sweep.py` runs with plots and
CSV): `hardware`, optional `multi_node_hardware` for meshes with a `node` axis, `[meshes.compiled]`
and `[meshes.abstract]` tables of named meshes, and `[[compiled]]` / `[[abstract]]` model entries
(name, config, overrides, quick).
"""

from __future__ import annotations

import argparse
import json
import math
import tomllib
from pathlib import Path
from typing import Any

import autoshard

from ..core.hardware import presets
from ..core.quantities import fmt_bytes, fmt_seconds
from .args import UsageError
from .commands import write_out
from .progress import Progress
from .running import setup_devices
from .tables import mesh_text, table
from .zoo import model_from_args

_TOP = {"hardware", "multi_node_hardware", "meshes", "compiled", "abstract"}
_ENTRY = {"name", "config", "overrides", "quick"}
SECTIONS = ("compiled", "abstract")


def read_config(path: str) -> dict[str, Any]:
    """The sweep file, checked: unknown keys, meshes and hardware are flag errors naming the key."""
    try:
        cfg = tomllib.loads(Path(path).read_text())
    except tomllib.TOMLDecodeError as err:
        raise UsageError("CONFIG", f"{path} is not TOML ({err})") from None
    unknown = sorted(set(cfg) - _TOP)
    if unknown:
        raise UsageError("CONFIG", f"{path}: unknown keys {unknown}; valid: {sorted(_TOP)}")
    for key in ("hardware", "multi_node_hardware"):
        if key in cfg and cfg[key] not in presets():
            raise UsageError("CONFIG", f"{path}: {key} = {cfg[key]!r} is not a preset; choose one of "
                                       f"{', '.join(presets())}")
    if "hardware" not in cfg:
        raise UsageError("CONFIG", f"{path}: no hardware = \"...\" (one of {', '.join(presets())})")
    meshes = cfg.get("meshes", {})
    for section in SECTIONS:
        for entry in cfg.get(section, []):
            bad = sorted(set(entry) - _ENTRY)
            if bad or "name" not in entry:
                raise UsageError("CONFIG", f"{path}: a [[{section}]] entry needs name (and config, overrides, quick); "
                                           f"unknown keys {bad}")
            for key, kind in (("name", str), ("config", str), ("overrides", dict), ("quick", bool)):
                if key in entry and not isinstance(entry[key], kind):
                    raise UsageError("CONFIG", f"{path}: [[{section}]] {entry.get('name', '?')!r}: {key} = "
                                               f"{entry[key]!r} must be a TOML {kind.__name__} "
                                               f"({'true or false' if kind is bool else 'value of that type'})")
        for name, mesh in meshes.get(section, {}).items():
            if not mesh or not all(isinstance(s, int) and s >= 1 for s in mesh.values()):
                raise UsageError("CONFIG", f"{path}: mesh {section}.{name} = {mesh!r}; give axis = size >= 1")
    return cfg


def cells(cfg: dict[str, Any], quick: bool) -> list[tuple[str, dict, str, dict, str]]:
    """(section, model entry, mesh name, mesh, hardware) for every cell to plan."""
    out = []
    for section in SECTIONS:
        for entry in cfg.get(section, []):
            if quick and not entry.get("quick"):
                continue
            for mesh_name, mesh in cfg.get("meshes", {}).get(section, {}).items():
                hw = cfg.get("multi_node_hardware", cfg["hardware"]) if "node" in mesh else cfg["hardware"]
                out.append((section, entry, mesh_name, mesh, hw))
    return out


def plan_cell(model: Any, mesh: dict, hardware: str, audit: bool) -> dict[str, Any]:
    state = model.abstract_state()
    try:
        plan = autoshard.plan(model.train_step, *state, mesh=mesh, hardware=hardware)
    except autoshard.InfeasiblePlanError as err:
        return {"feasible": False, "min_memory": err.min_memory, "error": str(err)}
    p = plan.predicted
    priced = {n: e for n, e in p.get("experts", {}).items() if "reason" not in e and e["feasible"]}
    best = min(priced, key=lambda n: priced[n]["step_time"]) if priced else None
    row = {"feasible": True, "step_time": p["step_time"], "memory": p["memory"]["total"], "storage": plan.storage,
           "search_seconds": p["search_seconds"], "best_expert": best,
           "best_expert_step_time": priced[best]["step_time"] if best else None}
    if audit:
        a = autoshard.audit(plan, model.train_step, *state)
        row["collective_bytes"] = {"predicted": sum(a.predicted_collectives.values()),
                                   "compiled": sum(v["bytes"] for v in a.audited_collectives.values())}
        row["fidelity_ok"] = a.fidelity_ok
    return row


def cmd_sweep(args: argparse.Namespace, progress: Progress, out: Any) -> int:
    cfg = read_config(args.config)
    todo = cells(cfg, args.quick)
    if not todo:
        raise UsageError("CONFIG", f"{args.config} has no cells{' marked quick' if args.quick else ''}; add "
                                   "[meshes.compiled] or [meshes.abstract] and model entries")
    if args.audit:
        setup_devices(max((math.prod(m.values()) for s, _, _, m, _ in todo if s == "compiled"), default=1))
    rows = []
    for i, (section, entry, mesh_name, mesh, hw) in enumerate(todo):
        flags = argparse.Namespace(model=entry["name"], config=entry.get("config", "debug"), layers=None,
                                   set=[f"{k}={v}" for k, v in entry.get("overrides", {}).items()])
        model, _ = model_from_args(flags)
        with progress.phase(f"[{i + 1}/{len(todo)}] {entry['name']} {mesh_name}"):
            row = plan_cell(model, mesh, hw, args.audit and section == "compiled")
        rows.append({"model": entry["name"], "config": flags.config, "mesh": mesh_name, "mesh_axes": mesh,
                     "hardware": hw, "section": section, **row})
    for line in sweep_table(rows):
        out(line)
    write_out(args.out, json.dumps(rows, indent=1, default=float), out)
    # exit 1 when a plan is predicted slower than an expert, or an audit misses beyond tolerance
    slower = [r for r in rows if r.get("best_expert_step_time")
              and r["step_time"] > r["best_expert_step_time"] * 1.0005]
    return 1 if slower or any(r.get("fidelity_ok") is False for r in rows) else 0


def sweep_table(rows: list[dict]) -> list[str]:
    head = ("model", "config", "mesh", "hardware", "step", "memory/device", "best expert", "speed-up", "search")
    audited = any("collective_bytes" in r for r in rows)
    out = [head + (("collectives predicted / compiled",) if audited else ())]
    for r in rows:
        cells_ = [r["model"], r["config"], f"{r['mesh']} ({mesh_text(r['mesh_axes'].items())})", r["hardware"]]
        if not r["feasible"]:
            cells_ += ["infeasible", f"min {fmt_bytes(r['min_memory'])}", "-", "-", "-"]
        else:
            best = r["best_expert"]
            cells_ += [fmt_seconds(r["step_time"]), fmt_bytes(r["memory"]),
                       f"{best} {fmt_seconds(r['best_expert_step_time'])}" if best else "none applies",
                       f"{r['best_expert_step_time'] / r['step_time']:.2f}x" if best else "-",
                       fmt_seconds(r["search_seconds"])]
        if audited:
            cb = r.get("collective_bytes")
            cells_.append(f"{fmt_bytes(cb['predicted'])} / {fmt_bytes(cb['compiled'])}" if cb else "-")
        out.append(tuple(cells_))
    return table(out, align="llllrrlrr" + "r" * audited)
