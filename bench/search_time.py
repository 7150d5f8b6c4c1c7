"""Planner search time at scale (issue 3). All inputs abstract: no parameter memory.

For GPT-3-shaped steps (d 12288, 96 heads, seq 2048, batch 16) at 12/24/48/96 layers, planned for
h100-sxm on 8 devices (mesh data=2 x model=4) and 64 devices (data=8 x model=8): the search seconds
(`plan.predicted["search_seconds"]`: the search proper, after trace and grouping), and around the
same `autoshard.plan` call the trace, group and total seconds (trace and group timed by wrapping
the planner's own calls, so nothing is traced twice). Each cell is planned 3 times; medians are
reported (the repetition loop is outermost, so a burst of load from other processes hits every
cell alike; the load average is recorded). Targets: search <= 1 s per cell and t(96)/t(12) <= 1.5
per mesh.

When no plan fits the default memory budget (90 % of an H100's HBM: GPT-3 at batch 16 without
rematerialisation needs far more), `autoshard.plan` raises `InfeasiblePlanError` and returns no
search seconds. Such a cell is recorded as infeasible (with the memory the leanest plan needs) and
then timed with an unbounded budget (`memory_budget=inf`): the search enumerates and costs the same
plans whatever the budget, only the final choice differs.

Acceptance rows (issue 31, point 4): a GPT-shaped LM with d_model 2048 (16 heads, seq 2048, vocabulary
51200, batch 16) at 12/24/48/96 layers on 64 devices (data=8 x model=8), h100-sxm: the seconds the planner
spends beyond the trace (`timing["total_seconds"] - timing["trace_seconds"]`: grouping + search + plan
building), medians of interleaved repetitions. Targets: <= 0.3 s at 96 layers and t(96)/t(12) <= 1.3.
`--quick` runs only these rows.

    python bench/search_time.py [--quick] [--out bench/results/search_time.json]
"""

from __future__ import annotations

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend use (the 64-device mesh is abstract)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from _common import git_state, machine  # noqa: E402

import autoshard  # noqa: E402
import models  # noqa: E402

MESHES = {"8 (2x4)": {"data": 2, "model": 4}, "64 (8x8)": {"data": 8, "model": 8}}
HARDWARE = "h100-sxm"
REPS = 3
TARGET_SEARCH_S = 1.0
TARGET_RATIO = 1.5


ACCEPT_MESH = {"data": 8, "model": 8}
ACCEPT_LM = {"d_model": 2048, "num_heads": 16, "seq_len": 2048, "vocab_size": 51200, "batch_size": 16}
ACCEPT_REPS = 5
TARGET_BEYOND_S = 0.3
TARGET_BEYOND_RATIO = 1.3


def acceptance(layer_counts: list[int]) -> dict:
    """Beyond-the-trace seconds of the d_model-2048 LM on 8 x 8 per layer count (repetitions outermost)."""
    cases = {}
    for n in layer_counts:
        m = models.get("gpt", "debug", num_layers=n, **ACCEPT_LM)
        cases[n] = (m, m.abstract_state())
    runs: dict[int, list[dict]] = {n: [] for n in layer_counts}
    plans = {}
    for _ in range(ACCEPT_REPS + 1):            # the first pass warms up (imports, jax caches): not counted
        for n, (m, args) in cases.items():
            p = autoshard.plan(m.train_step, *args, mesh=ACCEPT_MESH, hardware=HARDWARE)
            t = p.predicted["timing"]
            runs[n].append({"beyond_s": t["total_seconds"] - t["trace_seconds"], "trace_s": t["trace_seconds"],
                            "group_s": t["group_seconds"], "search_s": t["search_seconds"]})
            plans[n] = p
    rows = []
    for n in layer_counts:
        rs = runs[n][1:]
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        p = plans[n]
        rows.append({"layers": n, "median": med, "beyond_s_all": [r["beyond_s"] for r in rs],
                     "predicted_step_s": p.predicted["step_time"], "storage": p.storage,
                     "factors": [[desc, size, list(axes)] for _, desc, size, axes in p.factors]})
    first, last = rows[0], rows[-1]
    ratio = last["median"]["beyond_s"] / first["median"]["beyond_s"]
    print(f"\nAcceptance: LM d_model 2048 (16 heads, seq 2048, vocab 51200, batch 16), mesh data=8 x model=8, "
          f"{HARDWARE}; median of {ACCEPT_REPS} plans per row (interleaved, after a warm-up pass).")
    print("| layers | beyond trace s (median) | min | max | group s | search s | trace s | predicted step |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        md = r["median"]
        print(f"| {r['layers']} | {md['beyond_s']:.3f} | {min(r['beyond_s_all']):.3f} | {max(r['beyond_s_all']):.3f} | "
              f"{md['group_s']:.3f} | {md['search_s']:.3f} | {md['trace_s']:.2f} | "
              f"{r['predicted_step_s'] * 1e3:.1f} ms |")
    ok_t = last["median"]["beyond_s"] <= TARGET_BEYOND_S
    print(f"\nt({last['layers']}) = {last['median']['beyond_s']:.3f} s (target <= {TARGET_BEYOND_S:g}: "
          f"{'met' if ok_t else 'NOT met'}); t({last['layers']})/t({first['layers']}) = {ratio:.3f} "
          f"(target <= {TARGET_BEYOND_RATIO:g}: {'met' if ratio <= TARGET_BEYOND_RATIO else 'NOT met'})")
    return {"model": {"name": "gpt", "config": "debug", **ACCEPT_LM}, "mesh": ACCEPT_MESH, "reps": ACCEPT_REPS,
            "targets": {"beyond_s": TARGET_BEYOND_S, "ratio": TARGET_BEYOND_RATIO}, "ratio": ratio, "rows": rows}


def plan_once(m, args, mesh: dict, budget: float | None) -> tuple[dict, autoshard.Plan | None, str | None]:
    t0 = time.perf_counter()
    try:
        p = autoshard.plan(m.train_step, *args, mesh=mesh, hardware=HARDWARE, memory_budget=budget)
        err = None
    except autoshard.InfeasiblePlanError as e:
        p, err = None, str(e)
    total = time.perf_counter() - t0
    timing = p.predicted["timing"] if p is not None else {}   # the planner's own split of its wall time
    t = {"total_s": total, "trace_s": timing.get("trace_seconds", float("nan")),
         "group_s": timing.get("group_seconds", float("nan")),
         "search_s": timing.get("search_seconds") if p is not None else None}
    if p is not None:
        t["rest_s"] = total - t["trace_s"] - t["group_s"] - t["search_s"]   # plan building + bind
    return t, p, err


def new_cell(layers: int, mesh_name: str, mesh: dict, m, args) -> dict:
    """Pass 0: plan with the default budget; an infeasible cell is timed unbounded from then on."""
    t, p, err = plan_once(m, args, mesh, None)
    cell = {"layers": layers, "mesh": mesh_name, "mesh_axes": mesh, "devices": int(np.prod(list(mesh.values()))),
            "feasible_default_budget": err is None, "timed_budget": "default (90% HBM)", "budget": None,
            "runs": [t] if err is None else [], "plan": p}
    if err is not None:
        need = re.search(r"takes ([0-9.]+) GiB per device", err)
        cell["infeasible"] = {"message": err, "least_memory_gib": float(need.group(1)) if need else None,
                              "total_s": t["total_s"]}
        cell["timed_budget"], cell["budget"] = "unbounded (inf)", float("inf")
    return cell


def add_run(cell: dict, m, args) -> None:
    t, p, err = plan_once(m, args, cell["mesh_axes"], cell["budget"])
    assert err is None, err
    cell["runs"].append(t)
    cell["plan"] = p


def finish(cell: dict) -> dict:
    runs, p = cell["runs"], cell.pop("plan")
    cell.pop("budget")
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    cell.update({"median": med, "search_s_min": min(r["search_s"] for r in runs),
                 "search_s_max": max(r["search_s"] for r in runs),
                 "plans_evaluated": p.predicted["plans_evaluated"], "storage": p.storage,
                 "predicted_step_s": p.predicted["step_time"],
                 "predicted_memory_gib": p.predicted["memory"]["total"] / 2**30,
                 "factors": [[desc, size, list(axes)] for _, desc, size, axes in p.factors],
                 "explain_head": p.explain().splitlines()[:8], "warnings": list(p.warnings)})
    return cell


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the acceptance rows only (d_model 2048 LM on 8 x 8)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "search_time.json"))
    opts = ap.parse_args()
    git = git_state()  # before running: the checkout may change while a long run goes on
    load_start = os.getloadavg()
    layer_counts = [12, 24, 48, 96]
    t_start = time.perf_counter()
    accept = acceptance(layer_counts)
    if opts.quick:
        report = {"bench": "search_time", "date": time.strftime("%Y-%m-%d"), "machine": machine(git),
                  "hardware": HARDWARE, "acceptance": accept, "wall_s": time.perf_counter() - t_start,
                  "loadavg_1_5_15": {"start": load_start, "end": os.getloadavg()}}
        out = Path(opts.out).with_name(Path(opts.out).stem + "_quick.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        print(f"\nwall {time.perf_counter() - t_start:.0f} s; load average (1 min) {load_start[0]:.1f} at start, "
              f"{os.getloadavg()[0]:.1f} at end; wrote {out}")
        return
    cases = {}
    for n in layer_counts:
        m = models.get("gpt", "gpt3-175b", num_layers=n, batch_size=16)
        cases[n] = (m, m.abstract_state())
    # repetitions are the outer loop, so a burst of load from elsewhere hits every cell alike
    cells: dict[tuple, dict] = {}
    for rep in range(REPS + 1):
        for n, (m, args) in cases.items():
            for mesh_name, mesh in MESHES.items():
                c = cells.get((n, mesh_name))
                if c is None:
                    cells[(n, mesh_name)] = c = new_cell(n, mesh_name, mesh, m, args)
                elif len(c["runs"]) < REPS:
                    add_run(c, m, args)
        print(f"pass {rep + 1}/{REPS + 1} done ({time.perf_counter() - t_start:.0f} s, load "
              f"{os.getloadavg()[0]:.1f})", flush=True)
    cells_l = []
    for (n, _), c in cells.items():
        c = finish(c)
        c["params"] = sum(x.size for x in jax.tree.leaves(cases[n][1][0]))
        cells_l.append(c)
    cells = cells_l

    first, last = layer_counts[0], layer_counts[-1]
    ratios, ratios_min = {}, {}
    for mesh_name in MESHES:
        by = {c["layers"]: c for c in cells if c["mesh"] == mesh_name}
        ratios[mesh_name] = by[last]["median"]["search_s"] / by[first]["median"]["search_s"]
        ratios_min[mesh_name] = by[last]["search_s_min"] / by[first]["search_s_min"]

    print(f"\nGPT-3 shape (d 12288, seq 2048, batch 16), hardware {HARDWARE}; median of {REPS} plans per cell.")
    print(f"Targets: search <= {TARGET_SEARCH_S:g} s per cell; t({last})/t({first}) <= {TARGET_RATIO:g} per mesh"
          + ".\n")
    print("| devices (mesh) | layers | params | search s (median) | search s (max) | <= 1 s | trace s | group s "
          "| total s | plans evaluated | fits 90% HBM | chosen storage | predicted step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in cells:
        md = c["median"]
        fits = "yes" if c["feasible_default_budget"] else \
            f"no (needs {c['infeasible']['least_memory_gib']:.0f} GiB; timed unbounded)"
        print(f"| {c['mesh']} | {c['layers']} | {c['params'] / 1e9:.1f}B | {md['search_s']:.3f} | "
              f"{c['search_s_max']:.3f} | {'yes' if c['search_s_max'] <= TARGET_SEARCH_S else 'NO'} | "
              f"{md['trace_s']:.2f} | {md['group_s']:.3f} | {md['total_s']:.2f} | {c['plans_evaluated']} | "
              f"{fits} | {c['storage']} | {c['predicted_step_s'] * 1e3:.0f} ms |")
    print(f"\n| devices (mesh) | t({last})/t({first}) search (medians) | target <= {TARGET_RATIO:g} | "
          "same with the fastest of 3 (diagnostic) |")
    print("|---|---|---|---|")
    for mesh_name, r in ratios.items():
        print(f"| {mesh_name} | {r:.3f} | {'met' if r <= TARGET_RATIO else 'NOT met'} | {ratios_min[mesh_name]:.3f} |")
    print("\nChosen plans (first 8 lines of plan.explain()):")
    for c in cells:
        print(f"\n{c['layers']} layers on {c['mesh']}, budget {c['timed_budget']}:\n```")
        print("\n".join(c["explain_head"]))
        print("```")
    wall = time.perf_counter() - t_start
    report = {"bench": "search_time", "date": time.strftime("%Y-%m-%d"),
              "machine": machine(git),
              "model": {"name": "gpt", "config": "gpt3-175b", "batch_size": 16}, "hardware": HARDWARE,
              "reps": REPS, "targets": {"search_s": TARGET_SEARCH_S, "ratio": TARGET_RATIO},
              "ratios": {k: {"layers": [last, first], "search_ratio": v, "search_ratio_of_minima": ratios_min[k]}
                         for k, v in ratios.items()},
              "wall_s": wall, "loadavg_1_5_15": {"start": load_start, "end": os.getloadavg()},
              "cells": cells, "acceptance": accept}
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(report, indent=2))
    print(f"\nwall {wall:.0f} s; load average (1 min) {load_start[0]:.1f} at start, {os.getloadavg()[0]:.1f} at end; "
          f"wrote {opts.out}")


if __name__ == "__main__":
    main()
