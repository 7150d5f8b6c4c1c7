"""The sweep (issue 4): are autoshard's plans good, and are its numbers true?

For every model x mesh cell of bench/sweep.toml: plan automatically (search seconds), price every
expert reference plan (data parallel, FSDP, Megatron, 2-D data x Megatron) with the same cost
model, and check that the automatic plan is never predicted slower than the best expert. On the
compiled cells (simulated CPU devices), audit the automatic plan -- and, without --quick, every
applicable expert plan -- against the program XLA compiles: collective bytes per kind and mesh
axes (target: within 10 %) and per-device argument + temp memory (target: within 15 %), or the gap
named per module.

    python bench/sweep.py [--quick] [--sequence-parallel on] [--config bench/sweep.toml] [--out ...]

`--sequence-parallel on` plans every cell with the residual stream's sequence split wherever the model
has tensor-parallel regions and audits those plans (written to bench/results/sweep_sp_on.*).

Writes <out>.json (everything), <out>.csv (one row per cell), <out>.md (summary) and, when
matplotlib is installed (`pip install -e .[bench]`), <out>.png.
"""

from __future__ import annotations

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend use (larger meshes are planned abstractly)

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
import tomllib  # noqa: E402
from pathlib import Path  # noqa: E402

from _common import machine  # noqa: E402

import autoshard  # noqa: E402
import models  # noqa: E402

BYTES_TOL, MEMORY_TOL = 0.10, 0.15


def _gib(x: float | None) -> float | None:
    return None if x is None else x / 2**30


def plan_cell(m, args, mesh: dict, hardware: str, search: dict | None = None
              ) -> tuple[dict, autoshard.Plan | None]:
    t0 = time.perf_counter()
    try:
        plan = autoshard.plan(m.train_step, *args, mesh=mesh, hardware=hardware, search=search)
    except autoshard.InfeasiblePlanError as e:
        return {"feasible": False, "error": str(e), "total_s": time.perf_counter() - t0}, None
    p = plan.predicted
    experts = {}
    for name, e in p.get("experts", {}).items():     # a plan that fits only with remat (3-D search) has none
        experts[name] = ({"reason": e["reason"]} if "reason" in e else
                         {"step_ms": e["step_time"] * 1e3, "memory_gib": _gib(e["memory"]), "feasible": e["feasible"]})
    feasible_experts = {k: e["step_ms"] for k, e in experts.items() if e.get("feasible")}
    best = min(feasible_experts, key=feasible_experts.get) if feasible_experts else None
    step_ms = p["step_time"] * 1e3
    ex = plan.explain()
    row = {
        "feasible": True, "total_s": time.perf_counter() - t0, "search_s": p["search_seconds"],
        "storage": plan.storage, "step_ms": step_ms, "memory_gib": _gib(p["memory"]["total"]),
        "factors": {desc: list(axes) for _, desc, _, axes in plan.factors if axes},
        "experts": experts, "best_expert": best,
        "best_expert_step_ms": feasible_experts.get(best) if best else None,
        "auto_le_best_expert": best is None or step_ms <= feasible_experts[best] * (1 + 1e-9),
        "auto_better_than_best": best is not None and step_ms < feasible_experts[best] * (1 - 1e-9),
        "why": ex[ex.index("vs expert plans"):].split("\nwarning")[0].splitlines()[1:] if "vs expert" in ex else [],
    }
    return row, plan


def audit_row(plan: autoshard.Plan, m, args) -> dict:
    t0 = time.perf_counter()
    a = autoshard.audit(plan, m.train_step, *args)
    pred_b = sum(a.predicted_collectives.values())
    aud_b = sum(v["bytes"] for v in a.audited_collectives.values())
    keys = sorted(set(a.predicted_collectives) | set(a.audited_collectives))
    per_key = {k: {"predicted": a.predicted_collectives.get(k, 0.0),
                   "compiled": a.audited_collectives.get(k, {"bytes": 0.0})["bytes"]} for k in keys}
    coll_ok = all(abs(v["compiled"] - v["predicted"]) <= BYTES_TOL * max(v["compiled"], v["predicted"])
                  for v in per_key.values())
    pm, cm = a.predicted_memory["argument+temp"], a.memory["argument+temp"]
    mem_gap = abs(cm - pm) / max(cm, pm, 1.0)
    return {
        "audit_s": time.perf_counter() - t0,
        "collective_bytes": {"predicted": pred_b, "compiled": aud_b}, "by_key": per_key,
        "collectives_within_10pct": coll_ok,
        "memory": {"predicted_argument": a.predicted_memory["argument"], "compiled_argument": a.memory["argument"],
                   "predicted_argument_temp": pm, "compiled_argument_temp": cm, "gap": mem_gap},
        "memory_within_15pct": mem_gap <= MEMORY_TOL,
        "gaps": [{"what": g.what, "predicted": g.predicted, "compiled": g.audited, "relative": g.relative,
                  "backend_specific": g.backend_specific, "note": g.note,
                  "modules": [list(x) for x in g.modules[:4]]} for g in a.gaps],
        "top_modules": list(a.by_module().items())[:5],
        "flops": a.cost.get("flops"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="entries marked quick; audit auto plans only")
    ap.add_argument("--config", default=str(Path(__file__).parent / "sweep.toml"))
    ap.add_argument("--out", default=None, help="default bench/results/sweep[_roofline]")
    ap.add_argument("--roofline", action="store_true",
                    help="price on the pure roofline instead of the presets' GPU kernel model (tile/wave "
                         "quantisation, launches, achievable bandwidth; core/kernels.py)")
    ap.add_argument("--sequence-parallel", choices=("auto", "on"), default="auto",
                    help="'on': every plan splits the residual stream's sequence where the model has tensor-"
                         "parallel regions (search={'sequence_parallel': 'on'}); auto plans audited only "
                         "(the expert plans do not change)")
    opts = ap.parse_args()
    sp_on = opts.sequence_parallel == "on"
    search = {"sequence_parallel": "on"} if sp_on else None
    opts.out = opts.out or str(Path(__file__).parent / "results" / (
        f"sweep{'_roofline' if opts.roofline else ''}{'_sp_on' if sp_on else ''}"))
    cfg = tomllib.loads(Path(opts.config).read_text())
    info = machine()
    t_start = time.perf_counter()
    rows = []
    for section in ("compiled", "abstract"):
        for entry in cfg[section]:
            if opts.quick and not entry.get("quick"):
                continue
            m = models.get(entry["name"], entry["config"], **entry.get("overrides", {}))
            args = m.abstract_state()
            for mesh_name, mesh in cfg["meshes"][section].items():
                hw = cfg["multi_node_hardware"] if "node" in mesh else cfg["hardware"]
                if opts.roofline:
                    hw = {"base": hw, "kernels": None}
                row = {"model": entry["name"], "config": entry["config"], "overrides": entry.get("overrides", {}),
                       "params": m.num_params(), "mesh": mesh_name, "mesh_axes": mesh, "kind": section,
                       "hardware": hw}
                cell, plan = plan_cell(m, args, mesh, hw, search)
                row.update(cell)
                if section == "compiled" and plan is not None:
                    row["audit"] = audit_row(plan, m, args)
                    if not (opts.quick or sp_on):
                        row["expert_audits"] = {}
                        for name, e in row["experts"].items():
                            if "reason" in e:
                                continue
                            ep = autoshard.expert_plan(name, m.train_step, *args, mesh=mesh, hardware=hw)
                            row["expert_audits"][name] = audit_row(ep, m, args)
                rows.append(row)
                a = row.get("audit")
                print(f"{entry['name']:>8} {entry['config']:<12} {mesh_name:<10} "
                      + (f"auto {row['step_ms']:10.3f} ms best expert "
                         f"{row['best_expert'] or '-'} {row['best_expert_step_ms'] or float('nan'):10.3f} ms "
                         f"search {row['search_s']:.2f} s" if row["feasible"] else "infeasible")
                      + (f" | coll {a['collective_bytes']['predicted']:,.0f}/{a['collective_bytes']['compiled']:,.0f} B"
                         f" mem gap {a['memory']['gap']:.0%}" if a else ""), flush=True)
    wall = time.perf_counter() - t_start
    out = Path(opts.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {"bench": "sweep", "date": time.strftime("%Y-%m-%d"), "machine": info, "quick": opts.quick,
              "sequence_parallel": opts.sequence_parallel,
              "config": cfg, "wall_s": wall, "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=float))
    write_csv(rows, out.with_suffix(".csv"))
    md = summary_markdown(rows, wall, opts.quick, " (sequence parallelism forced on)" if sp_on else "")
    out.with_suffix(".md").write_text(md)
    print("\n" + md)
    plot(rows, out.with_suffix(".png"))


EXPERT_NAMES = autoshard.EXPERTS


def write_csv(rows: list[dict], path: Path) -> None:
    fields = ["model", "config", "mesh", "kind", "hardware", "params", "feasible", "search_s", "storage",
              "step_ms", "memory_gib", *[f"{e}_ms" for e in EXPERT_NAMES], "best_expert", "auto_le_best_expert",
              "pred_coll_bytes", "compiled_coll_bytes", "coll_within_10pct", "pred_mem_bytes",
              "compiled_mem_bytes", "mem_gap", "mem_within_15pct"]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            d = {k: r.get(k) for k in fields}
            for e in EXPERT_NAMES:
                x = r.get("experts", {}).get(e, {})
                d[f"{e}_ms"] = x.get("step_ms") if x.get("feasible") else None
            a = r.get("audit")
            if a:
                d.update(pred_coll_bytes=a["collective_bytes"]["predicted"],
                         compiled_coll_bytes=a["collective_bytes"]["compiled"],
                         coll_within_10pct=a["collectives_within_10pct"],
                         pred_mem_bytes=a["memory"]["predicted_argument_temp"],
                         compiled_mem_bytes=a["memory"]["compiled_argument_temp"],
                         mem_gap=round(a["memory"]["gap"], 4), mem_within_15pct=a["memory_within_15pct"])
            w.writerow(d)


def _fmt(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def summary_markdown(rows: list[dict], wall: float, quick: bool, label: str = "") -> str:
    lines = [f"## autoshard sweep{' (--quick)' if quick else ''}{label}: {len(rows)} cells in {wall:.0f} s", "",
             "Predicted step time (ms) of the automatic plan and of each expert plan (same cost model); "
             "'-' = not applicable or over the memory budget. Compiled cells: collective bytes predicted / "
             "compiled, argument+temp memory gap. Hardware: "
             + ", ".join(sorted({str(r["hardware"]) for r in rows})) + ".", "",
             "| model | mesh | search s | auto | " + " | ".join(EXPERT_NAMES)
             + " | auto <= best | coll. bytes pred/compiled | mem gap |",
             "|---|---|---|---|" + "---|" * len(EXPERT_NAMES) + "---|---|---|"]
    for r in rows:
        name = f"{r['model']} {r['config']}" + ("*" if r["overrides"] else "")
        if not r["feasible"]:
            lines.append(f"| {name} | {r['mesh']} | - | infeasible | " + " | ".join("-" for _ in EXPERT_NAMES)
                         + " | - | - | - |")
            continue
        ex = [(_fmt(r["experts"][e].get("step_ms")) if r["experts"].get(e, {}).get("feasible") else "-")
              for e in EXPERT_NAMES]
        a = r.get("audit")
        coll = (f"{a['collective_bytes']['predicted']:,.0f} / {a['collective_bytes']['compiled']:,.0f}"
                + ("" if a["collectives_within_10pct"] else " (gap)")) if a else "abstract"
        mem = f"{a['memory']['gap']:.0%}" if a else "-"
        lines.append(f"| {name} | {r['mesh']} | {r['search_s']:.2f} | {_fmt(r['step_ms'])} | " + " | ".join(ex)
                     + f" | {'yes' if r['auto_le_best_expert'] else 'NO'} | {coll} | {mem} |")
    feas = [r for r in rows if r["feasible"]]
    ok = sum(r["auto_le_best_expert"] for r in feas)
    better = sum(r["auto_better_than_best"] for r in feas)
    audited = [r["audit"] for r in feas if r.get("audit")]
    expert_audits = [a for r in feas for a in r.get("expert_audits", {}).values()]
    lines += ["", f"- auto <= best expert on {ok}/{len(feas)} feasible cells; strictly better on {better} "
                  "(explain() names the cost component it saves).",
              f"- compiled auto plans: collective bytes within 10 % on "
              f"{sum(a['collectives_within_10pct'] for a in audited)}/{len(audited)}, argument+temp memory "
              f"within 15 % on {sum(a['memory_within_15pct'] for a in audited)}/{len(audited)}."]
    if expert_audits:
        lines.append(f"- compiled expert plans: collective bytes within 10 % on "
                     f"{sum(a['collectives_within_10pct'] for a in expert_audits)}/{len(expert_audits)}, memory "
                     f"within 15 % on {sum(a['memory_within_15pct'] for a in expert_audits)}/{len(expert_audits)}.")
    gaps = [(r, g) for r in feas for g in (r.get("audit") or {}).get("gaps", [])]
    gaps += [(dict(r, mesh=f"{r['mesh']} [{name}]"), g) for r in feas
             for name, a in r.get("expert_audits", {}).items() for g in a["gaps"]]
    if gaps:
        lines += ["", "Gaps beyond tolerance (automatic plans, then expert plans in brackets), by module:"]
        for r, g in gaps:
            mods = ", ".join(f"{m} {b:,.0f} B" for m, b in g["modules"]) or "-"
            tag = " [backend-specific]" if g["backend_specific"] else ""
            lines.append(f"- {r['model']} {r['mesh']}: {g['what']} predicted {g['predicted']:,.0f}, compiled "
                         f"{g['compiled']:,.0f} ({g['relative']:.0%}){tag}; {g['note']}; modules: {mods}")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install -e .[bench])")
        return
    feas = [r for r in rows if r["feasible"]]
    labels = [f"{r['model']}\n{r['mesh']}" for r in feas]
    series = {"auto": [r["step_ms"] for r in feas]}
    for e in EXPERT_NAMES:
        series[e] = [r["experts"].get(e, {}).get("step_ms") if r["experts"].get(e, {}).get("feasible") else float("nan")
                     for r in feas]
    fig, ax = plt.subplots(figsize=(max(8, 0.6 * len(feas)), 4.5))
    width = 0.8 / len(series)
    for k, (name, ys) in enumerate(series.items()):
        ax.bar([i + k * width for i in range(len(feas))], ys, width, label=name)
    ax.set_yscale("log")
    ax.set_ylabel("predicted step time (ms, log)")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(feas))], labels, fontsize=6, rotation=90)
    ax.legend(fontsize=7)
    ax.set_title("autoshard plan vs expert plans (same cost model)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
