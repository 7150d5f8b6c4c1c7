"""Sequence parallelism (issue 19): does Megatron-SP hold less for Megatron's bytes, and does the search
pick it when Megatron does not fit?

For a GPT on simulated CPU devices (tensor parallelism over "model", with and without a data axis):
Megatron and Megatron-SP expert plans, and the automatic plan under a memory budget 5 % above
Megatron-SP's predicted memory. Each is compiled and audited: predicted vs compiled per-device
argument+temp memory and collective bytes by kind (XLA:CPU compiles a reduce-scatter as an all-reduce
and a slice, so reduce-scatter bytes are compared under all-reduce).

    python bench/sequence_parallel.py [--out bench/results/sequence_parallel]
"""

from __future__ import annotations

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend use

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from _common import machine  # noqa: E402

import autoshard  # noqa: E402
import models  # noqa: E402

SIZES = dict(d_model=256, num_heads=8, seq_len=128, batch_size=8, vocab_size=1024, num_layers=4)
MESHES = {"model=4": {"model": 4}, "data=2 x model=4": {"data": 2, "model": 4}}


def _row(name: str, plan: autoshard.Plan, step, args) -> dict:
    report = autoshard.audit(plan, step, *args)
    predicted = report.predicted_collectives      # as XLA:CPU compiles them (the audit's lowering)
    compiled = {k: v["bytes"] for k, v in report.audited_collectives.items()}
    seq = [f for f in plan.factors if "sequence parallel" in f[1] and f[3]]
    return {"plan": name, "sequence_split": bool(seq), "step_ms": plan.predicted["step_time"] * 1e3,
            "predicted_memory": plan.predicted["memory"]["total"], "compiled_memory": report.memory["argument+temp"],
            "reduce_scatters": sum(c["bytes"] for c in plan.predicted["collectives"] if c["kind"] == "reduce-scatter"),
            "predicted_collectives": predicted, "compiled_collectives": compiled,
            "collective_gaps": [g.what for g in report.gaps if g.what.startswith("collective")]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "sequence_parallel"))
    opts = ap.parse_args()
    t0 = time.perf_counter()
    m = models.get("gpt", "debug", **SIZES)
    args = m.abstract_state()
    rows = []
    for mesh_name, mesh in MESHES.items():
        experts = {}
        for name in ("megatron", "data-megatron", "megatron-sp"):
            try:
                plan = autoshard.expert_plan(name, m.train_step, *args, mesh=mesh, hardware="cpu-sim")
            except autoshard.PlanError:
                continue
            experts[name] = plan
            rows.append({"mesh": mesh_name, **_row(name, plan, m.train_step, args)})
        budget = 1.05 * experts["megatron-sp"].predicted["memory"]["total"]
        plan = autoshard.plan(m.train_step, *args, mesh=mesh, hardware="cpu-sim", memory_budget=budget)
        rows.append({"mesh": mesh_name, "budget": budget, **_row("auto (tight budget)", plan, m.train_step, args)})
        print(f"{mesh_name}: done", flush=True)
    out = {"bench": "sequence_parallel", "sizes": SIZES, "machine": machine(), "rows": rows,
           "wall_s": time.perf_counter() - t0}
    Path(opts.out + ".json").write_text(json.dumps(out, indent=1))
    md = [f"## Sequence parallelism: GPT {SIZES} on simulated CPU devices", "",
          "| mesh | plan | sequence split | predicted step ms | memory predicted | memory compiled | "
          "collectives predicted (CPU kinds) | compiled | gaps |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pc = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(r["predicted_collectives"].items()))
        cc = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(r["compiled_collectives"].items()))
        md.append(f"| {r['mesh']} | {r['plan']} | {'yes' if r['sequence_split'] else 'no'} | {r['step_ms']:.3f} | "
                  f"{r['predicted_memory']:,.0f} | {r['compiled_memory']:,.0f} | {pc} | {cc} | "
                  f"{', '.join(r['collective_gaps']) or 'none'} |")
    Path(opts.out + ".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
