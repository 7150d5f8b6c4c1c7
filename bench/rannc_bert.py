"""RaNNC §IV at the paper's scale (issue 6): enlarged BERTs on 32 V100s, ResNet152x8 on 8, §IV-C.

Everything is planned abstractly (traced with ShapeDtypeStructs, nothing allocated), on the
`v100-sxm` preset (32 GB, 8 per node, NVLink 50 GB/s, 100 Gb/s InfiniBand; memory budget 90 %):

* `bert`: hidden 1024 / 1536 / 2048 x 24, 48, 96, 144, 192, 256 layers (RaNNC §IV-B, Fig. 4),
  seq 512, batch 256, 4 nodes x 8 = 32 devices, FP32 with Adam(W). Checkpointing as RaNNC: none
  for a single stage (plain data parallelism), recompute when the model is split into >= 2 stages;
  so RaNNC is planned twice (stage count 1 without recompute, 2..32 with) and the faster plan wins.
  RaNNC = atomic + k = 32 blocks + Algorithm 2 with the default `search="all"` (every node and
  stage count); `published` is the paper's stop at the first stage count with a solution
  (`search="stage"`), for reference.
  Baseline: the best uniform split (GPipe-Hybrid: equal layers and replicas per stage, with
  checkpointing) over 2, 4, 8, 16, 32 stages and micro-batch counts 1, 2, 4, ...
* `equal_stages`: where a layer count does not divide over a power-of-two stage count, RaNNC
  restricted to that stage count vs the uniform split at it (the balance claim of the issue).
* `resnet`: ResNet152x8 (~3.7B parameters, 224x224, batch 128) on 8 devices (one node), FP32;
  besides the repeated-layer uniform split, `uniform_blocks`: equal runs of RaNNC's 32 blocks, a
  stand-in for the paper's hand-balanced GPipe-Model stages.
* `no_blocks`: §IV-C, Algorithm 2 over atomic components instead of blocks, on BERT hidden 1024
  cut to 2 and 4 layers (seq 512, batch 256) on 8 devices.

Search seconds = atomic + costs + blocks + Algorithm 2 (the trace is timed separately). Each graph
is traced once and dropped before the next (the 256-layer BERTs are ~140k ops, ~0.7 GB).

    python bench/rannc_bert.py [--quick] [--roofline] [--out bench/results/rannc_bert.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoshard import InfeasiblePlanError, get_hardware  # noqa: E402
from bench._common import git_state, machine  # noqa: E402
from pipeline.rannc import PipelineCosts, atomic_partition, best_uniform, partition_blocks, plan_stages  # noqa: E402

HW = "v100-sxm"
HIDDEN = (1024, 1536, 2048)
LAYERS = (24, 48, 96, 144, 192, 256)


def timed(fn, *a, **k):
    t0 = time.perf_counter()
    out = fn(*a, **k)
    return out, time.perf_counter() - t0


def balance(plan) -> float:
    t = [s.predicted_forward + s.predicted_backward for s in plan.stages]
    return max(t) / (sum(t) / len(t))


def summary(plan, recompute: bool | None = None) -> dict | None:
    if plan is None:
        return None
    t = [s.predicted_forward + s.predicted_backward for s in plan.stages]
    out = {"method": plan.method, "stages": len(plan.stages), "replicas": [s.replicas for s in plan.stages],
           "pipelines": plan.pipelines, "microbatches": plan.microbatches,
           "microbatch_size": [s.microbatch_size for s in plan.stages], "blocks": [s.blocks for s in plan.stages],
           "throughput": plan.batch_size / plan.step_time, "step_time_s": plan.step_time,
           "max_stage_s": max(t), "mean_stage_s": sum(t) / len(t), "max_over_mean": balance(plan),
           "max_memory_gb": max(plan.memory) / 1e9, "budget_gb": plan.memory_budget / 1e9,
           "search_s": plan.search_seconds, "dp_calls": plan.dp_calls}
    if recompute is not None:
        out["recompute"] = recompute
    return out


def trace(name: str, config: str, **overrides):
    import autoshard
    import models

    m = models.get(name, config, **overrides)
    graph, t_trace = timed(autoshard.trace, m.train_step, *m.abstract_state())
    grouping, t_group = timed(autoshard.group, graph)
    params = sum(math.prod(graph.values[v].shape) for v in graph.inputs if graph.values[v].role == "parameter")
    return graph, grouping, {"ops": len(graph.ops), "params": params, "trace_s": t_trace, "group_s": t_group}


def rannc(graph, devices: int, batch: int, *, search: str = "all", stage_counts=None, prepared=None):
    """RaNNC with its checkpointing rule: one stage without recompute, more stages with it; the
    faster plan (`search="stage"`: the single stage whenever it fits, as Algorithm 2 returns the
    first stage count with a solution). Returns (plan or None, recompute, seconds by phase)."""
    sec = {}
    if prepared is None:
        atomic, sec["atomic"] = timed(atomic_partition, graph)
        costs, sec["costs"] = timed(PipelineCosts, atomic, HW)
        blocks, sec["blocks"] = timed(partition_blocks, atomic, 32, costs=costs)
    else:
        atomic, costs, blocks = prepared
    counts = list(stage_counts) if stage_counts is not None else list(range(1, devices + 1))
    t0 = time.perf_counter()
    cands = []
    for rc, sc in ((False, [s for s in counts if s == 1]), (True, [s for s in counts if s > 1])):
        if not sc:
            continue
        try:
            cands.append((plan_stages(graph, devices, HW, batch_size=batch, recompute=rc, costs=costs,
                                      blocks=blocks, stage_counts=sc, search=search), rc))
        except InfeasiblePlanError:
            continue
        if search == "stage":
            break
    sec["stages"] = time.perf_counter() - t0
    sec["total"] = sum(sec.values())
    if not cands:
        return None, None, sec, (atomic, costs, blocks)
    plan, rc = min(cands, key=lambda pr: pr[0].step_time)
    return plan, rc, sec, (atomic, costs, blocks)


def model_cell(name, config, devices, batch, layers=None, equal_stages=True, **overrides):
    graph, grouping, cell = trace(name, config, **overrides)
    print(f"{config}: traced {cell['ops']} ops in {cell['trace_s']:.1f} s", flush=True)
    plan, rc, sec, prepared = rannc(graph, devices, batch)
    atomic, costs, blocks = prepared
    work = blocks.work
    cell.update(components=len(atomic), block_max_over_mean=max(work) / (sum(work) / len(work)),
                search_s=sec, rannc=summary(plan, rc))
    pub, pub_rc, pub_sec, _ = rannc(graph, devices, batch, search="stage", prepared=prepared)
    cell["published"] = summary(pub, pub_rc) | {"search_s": pub_sec["stages"]} if pub else None
    uni, t_uni = timed(best_uniform, costs, devices, grouping=grouping, batch_size=batch, recompute=True)
    cell["uniform"] = summary(uni, True)
    if uni is not None:
        cell["uniform"]["search_s"] = t_uni
        if layers:
            cell["uniform"]["layers_per_stage"] = layers / len(uni.stages)
    if not layers:
        # the repeated-layer split only cuts inside ResNet's longest stage (its 35 identical
        # bottlenecks); GPipe-Model's stages were balanced by hand: equal runs of RaNNC's blocks
        ub, t_ub = timed(best_uniform, costs, devices, blocks=blocks, batch_size=batch, recompute=True)
        cell["uniform_blocks"] = summary(ub, True) | {"search_s": t_ub} if ub else None
    if layers and equal_stages:
        rows = []
        for S in (2, 4, 8, 16, 32):
            if layers % S == 0 or layers < S:
                continue
            r, _, _, _ = rannc(graph, devices, batch, search="all", stage_counts=[S], prepared=prepared)
            u = best_uniform(costs, devices, grouping=grouping, batch_size=batch, recompute=True, stage_counts=[S])
            rows.append({"stages": S, "layers_per_stage": layers / S,
                         "rannc": summary(r, True), "uniform": summary(u, True)})
        cell["equal_stages"] = rows
    del graph, grouping, prepared, atomic, costs, blocks
    gc.collect()
    return cell


def no_block_cell(layers: int, devices: int = 8, batch: int = 256) -> dict:
    graph, _, cell = trace("bert", "bert-h1024-l24", num_layers=layers)
    atomic = atomic_partition(graph)
    costs = PipelineCosts(atomic, HW)
    cell["components"] = len(atomic)
    for key, use_blocks in (("blocks", True), ("no_blocks", False)):
        t0 = time.perf_counter()
        plan = plan_stages(graph, devices, HW, batch_size=batch, recompute=True, costs=costs, use_blocks=use_blocks,
                           stage_counts=range(2, devices + 1))
        cell[key] = summary(plan, True) | {"search_s": time.perf_counter() - t0}
        print(f"bert-h1024-l{layers} {key}: {cell[key]['search_s']:.1f} s, "
              f"{cell[key]['throughput']:.2f} samples/s", flush=True)
    return cell


def fmt_plan(p: dict | None) -> str:
    if p is None:
        return "infeasible"
    reps = sorted(set(p["replicas"]))
    rep = str(reps[0]) if len(reps) == 1 else f"{min(reps)}-{max(reps)}"
    return f"{p['stages']} x {rep}, MB {p['microbatches']}"


def table(cells: dict) -> str:
    out = ["| model | params | trace s | RaNNC stages x replicas | samples/s | max/mean | max stage s | "
           "search s | published: stages, samples/s, max/mean | uniform stages x replicas | samples/s | "
           "max/mean | layers/stage |",
           "|---|---:|---:|---|---:|---:|---:|---:|---|---|---:|---:|---:|"]
    for name, c in cells.items():
        r, p, u = c["rannc"], c.get("published"), c["uniform"]
        rs = (f"{fmt_plan(r)}{'' if r['recompute'] else ' (no recompute)'} | {r['throughput']:.2f} | "
              f"{r['max_over_mean']:.3f} | {r['max_stage_s']:.3g} | {c['search_s']['total']:.2f}"
              if r else "infeasible | - | - | - | " + f"{c['search_s']['total']:.2f}")
        ps = f"{p['stages']}, {p['throughput']:.2f}, {p['max_over_mean']:.3f}" if p else "infeasible"
        lps = f"{u['layers_per_stage']:.3g}" if u and "layers_per_stage" in u else "-"
        us = (f"{fmt_plan(u)} | {u['throughput']:.2f} | {u['max_over_mean']:.3f} | {lps}"
              if u else "infeasible | - | - | -")
        out.append(f"| {name} | {c['params'] / 1e9:.2f}B | {c['trace_s']:.1f} | {rs} | {ps} | {us} |")
    return "\n".join(out)


def equal_table(cells: dict) -> str:
    out = ["| model | stages | layers/stage | RaNNC max/mean | uniform max/mean | RaNNC samples/s | "
           "uniform samples/s |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for name, c in cells.items():
        for row in c.get("equal_stages", []):
            r, u = row["rannc"], row["uniform"]
            out.append(f"| {name} | {row['stages']} | {row['layers_per_stage']:.3g} | "
                       f"{r['max_over_mean'] if r else float('nan'):.3f} | "
                       f"{u['max_over_mean'] if u else float('nan'):.3f} | "
                       f"{r['throughput'] if r else float('nan'):.2f} | {u['throughput'] if u else float('nan'):.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="2 BERTs, ResNet152x8, a 1-layer no-block run")
    ap.add_argument("--out", default=None, help="default bench/results/rannc_bert[_roofline].json")
    ap.add_argument("--roofline", action="store_true",
                    help="the pure roofline instead of the preset's V100 kernel model (tile/wave quantisation, "
                         "launches, achievable bandwidth; autoshard's core/kernels.py)")
    args = ap.parse_args()
    global HW
    if args.roofline:
        HW = get_hardware({"base": "v100-sxm", "kernels": None})
    args.out = args.out or str(ROOT / f"bench/results/rannc_bert{'_roofline' if args.roofline else ''}.json")
    git = git_state()
    t_start = time.perf_counter()
    grid = [(1024, 24), (2048, 96)] if args.quick else [(h, n) for h in HIDDEN for n in LAYERS]
    bert = {}
    for h, n in grid:
        name = f"bert-h{h}-l{n}"
        bert[name] = cell = model_cell("bert", name, 32, 256, layers=n)
        r, u = cell["rannc"], cell["uniform"]
        print(f"  {name}: RaNNC {fmt_plan(r)} {r['throughput'] if r else 0:.2f}/s "
              f"{r['max_over_mean'] if r else 0:.3f} search {cell['search_s']['total']:.2f} s | uniform "
              f"{fmt_plan(u)} {u['throughput'] if u else 0:.2f}/s", flush=True)
    resnet = {"resnet152x8": model_cell("resnet", "resnet152x8", 8, 128, equal_stages=False)}
    no_blocks = {f"bert-h1024-l{n}": no_block_cell(n) for n in ((1,) if args.quick else (2, 4))}
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine(git), "quick": args.quick,
           "settings": {"hardware": "v100-sxm" + (" (roofline)" if args.roofline else " (v100 kernel model)"),
                        "bert": {"devices": 32, "nodes": 4, "batch": 256, "seq": 512,
                                                 "dtype": "float32", "optimizer": "adamw", "k": 32},
                        "resnet": {"devices": 8, "batch": 128, "image": 224, "dtype": "float32"},
                        "checkpointing": "none for 1 stage, recompute for >= 2 (RaNNC §IV-A); uniform: recompute",
                        "search": "all (default); published = stage"},
           "bert": bert, "resnet": resnet, "no_blocks": no_blocks, "wall_s": time.perf_counter() - t_start}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print()
    print(table(bert | resnet))
    ub = resnet["resnet152x8"].get("uniform_blocks")
    if ub:
        print(f"\nresnet152x8, uniform over RaNNC's 32 blocks (hand-balanced GPipe-Model stand-in): {fmt_plan(ub)}, "
              f"{ub['throughput']:.2f} samples/s, max/mean {ub['max_over_mean']:.3f}")
    print()
    print(equal_table(bert))
    print()
    print("| §IV-C model (8 devices) | units | blocks: search s | samples/s | no blocks: search s | samples/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, c in no_blocks.items():
        b, nb = c["blocks"], c["no_blocks"]
        print(f"| {name} | {c['components']} | {b['search_s']:.2f} | {b['throughput']:.2f} | "
              f"{nb['search_s']:.1f} | {nb['throughput']:.2f} |")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
