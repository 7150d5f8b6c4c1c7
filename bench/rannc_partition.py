"""RaNNC partitioner at scale (issue 6): atomic, block and stage partitioning seconds, plan quality.

Cells:

* `chain`: the synthetic transformer-ish step of tests/core/_synthetic.py with 4000 blocks
  (52k atomic components), k = 32 blocks, 32 V100s, memory budget 1/16 of the static bytes;
* `random`: a random 60k-op forward DAG with 2 % long skip edges and shared parameter transposes
  (tests/pipeline/_rannc_graphs.py), k = 32 blocks;
* `gpt-20b`: the traced 96-layer GPT (d_model 4096, seq 2048, ~20B parameters; abstract, nothing
  allocated) at batch 512 with recompute on 32 and 64 V100 32 GB: RaNNC as published (first stage
  count with a solution), RaNNC searching every stage count, and the best uniform split
  (equal layers and replicas per stage, GPipe-Hybrid style) costed with the same model;
* `bert-debug`: RaNNC over k = 8 blocks vs the §IV-C variant over all atomic components.

    python bench/rannc_partition.py [--quick] [--out bench/results/rannc_partition.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoshard import InfeasiblePlanError  # noqa: E402
from pipeline.rannc import PipelineCosts, atomic_partition, best_uniform, partition_blocks, plan_stages  # noqa: E402
from tests.core._synthetic import model  # noqa: E402
from tests.pipeline.rannc._rannc_graphs import random_step  # noqa: E402


def timed(fn, *a, **k):
    t0 = time.perf_counter()
    out = fn(*a, **k)
    return out, time.perf_counter() - t0


def plan_summary(plan):
    if plan is None:
        return None
    return {"method": plan.method, "stages": len(plan.stages), "microbatches": plan.microbatches,
            "replicas": [s.replicas for s in plan.stages], "step_time_s": plan.step_time,
            "objective_s": plan.objective, "max_memory_gb": max(plan.memory) / 1e9,
            "search_s": plan.search_seconds, "dp_calls": plan.dp_calls}


def partition_cell(graph, k=32):
    atomic, t_atomic = timed(atomic_partition, graph)
    costs, t_costs = timed(PipelineCosts, atomic, "v100-sxm")
    blocks, t_blocks = timed(partition_blocks, atomic, k, costs=costs)
    work = [w for w in blocks.work]
    cell = {"ops": len(graph.ops), "components": len(atomic), "edges": len(atomic.edges),
            "cloned_ops": len(atomic.clones), "blocks": len(blocks),
            "block_work_max_over_mean": max(work) / (sum(work) / len(work)),
            "seconds": {"atomic": t_atomic, "costs": t_costs, "blocks": t_blocks},
            "block_stats": {k_: v for k_, v in blocks.stats.items() if k_ != "seconds"},
            "block_seconds": blocks.stats["seconds"]}
    return atomic, costs, blocks, cell


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller graphs, no traced GPT")
    ap.add_argument("--out", default=str(ROOT / "bench/results/rannc_partition.json"))
    args = ap.parse_args()
    cells = {}

    layers = 400 if args.quick else 4000
    graph, t_build = timed(model, [f"M/block_{i}" for i in range(layers)])
    atomic, costs, blocks, cell = partition_cell(graph)
    total = costs.totals(range(len(atomic)))
    budget = (2 * total["params"] + total["state"]) / 16
    plan, t_plan = timed(plan_stages, graph, 32, "v100-sxm", costs=costs, blocks=blocks, memory_budget=budget)
    cell.update(build_s=t_build, plan=plan_summary(plan), seconds={**cell["seconds"], "stages": t_plan})
    cells["chain"] = cell
    print("chain", json.dumps(cell["seconds"]), cell["components"], flush=True)

    n = 6000 if args.quick else 60000
    graph, t_build = timed(random_step, 0, n, n_params=200, p_const=0.1, p_skip=0.02, width=4)
    *_, cell = partition_cell(graph)
    cell["build_s"] = t_build
    cells["random"] = cell
    print("random", json.dumps(cell["seconds"]), cell["components"], flush=True)

    if not args.quick:
        import autoshard
        import models

        m = models.get("gpt", "gpt3-175b", d_model=4096, num_heads=32)
        graph, t_trace = timed(autoshard.trace, m.train_step, *m.abstract_state())
        atomic, costs, blocks, cell = partition_cell(graph)
        cell["trace_s"] = t_trace
        grouping = autoshard.group(graph)
        for devices in (32, 64):
            kw = dict(costs=costs, blocks=blocks, batch_size=512, recompute=True)
            row = {}
            for name, extra in (("rannc", {}), ("rannc_published", {"search": "stage"})):
                try:
                    row[name] = plan_summary(plan_stages(graph, devices, "v100-sxm", **kw, **extra))
                except InfeasiblePlanError as err:
                    row[name] = {"infeasible": str(err)}
            row["uniform"] = plan_summary(best_uniform(costs, devices, grouping=grouping, batch_size=512,
                                                       recompute=True))
            cell[f"{devices}_devices"] = row
            print("gpt-20b", devices, json.dumps(row), flush=True)
        cells["gpt-20b"] = cell

        m = models.get("bert", "debug")
        graph = autoshard.trace(m.train_step, *m.abstract_state())
        atomic, costs, blocks, cell = partition_cell(graph, k=8)
        total = costs.totals(range(len(atomic)))
        budget = (2 * total["params"] + total["state"] + total["act_const"]) / 2
        for name, use_blocks in (("blocks", True), ("no_blocks", False)):
            cell[name] = plan_summary(plan_stages(graph, 8, "v100-sxm", costs=costs, blocks=blocks,
                                                  memory_budget=budget, use_blocks=use_blocks))
        cells["bert-debug"] = cell
        print("bert-debug", json.dumps({k: cell[k] for k in ("blocks", "no_blocks")}), flush=True)

    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "git": rev.stdout.strip(),
           "machine": {"python": platform.python_version(), "platform": platform.platform(),
                       "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
           "quick": args.quick, "cells": cells}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
