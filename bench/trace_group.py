"""Trace + group cost at scale (issue: foundation). All inputs abstract: no parameter memory.

For GPT-3-shaped steps (d 12288, 96 heads, seq 2048) at 12/24/48/96 layers, the same in flax.nnx
and with nn.scan, and BERT-large: expanded equation count, trace seconds, group seconds (median of
5), unique block types and their instance counts. Prints a markdown table and writes JSON.

    python bench/trace_group.py [--quick] [--out bench/results/trace_group.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import jax

import autoshard
import models


def measure(model_name: str, config: str, **overrides) -> dict:
    m = models.get(model_name, config, **overrides)
    t0 = time.perf_counter()
    args = m.abstract_state()
    t1 = time.perf_counter()
    graph = autoshard.trace(m.train_step, *args)
    t2 = time.perf_counter()
    group_times = []
    for _ in range(5):
        s = time.perf_counter()
        grouping = autoshard.group(graph)
        group_times.append(time.perf_counter() - s)
    return {
        "model": model_name, "config": config, "overrides": overrides,
        "params": sum(x.size for x in jax.tree.leaves(args[0])),
        "ops": len(graph.ops), "ops_by_phase": graph.ops_by_phase(),
        "abstract_init_s": t1 - t0, "trace_s": t2 - t1,
        "group_s_median": statistics.median(group_times), "group_s_max": max(group_times),
        "block_types": [(bt.name, bt.count) for bt in grouping.block_types],
        "remainder_ops": len(grouping.remainder),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="12 and 24 layers only")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "trace_group.json"))
    opts = ap.parse_args()
    layers = [12, 24] if opts.quick else [12, 24, 48, 96]
    cases = [("gpt", "gpt3-175b", {"num_layers": n}) for n in layers]
    cases += [("gpt_nnx", "gpt3-175b", {"num_layers": layers[-1]}),
              ("gpt", "gpt3-175b", {"num_layers": layers[-1], "scan_layers": True}),
              ("bert", "bert-large", {})]
    rows = []
    for name, config, over in cases:
        r = measure(name, config, **over)
        rows.append(r)
        print(f"done {name} {config} {over}: {r['ops']} ops, trace {r['trace_s']:.2f} s, "
              f"group {r['group_s_median']:.3f} s", flush=True)

    print("\n| model | config | params | ops | trace s | group s (median) | block types |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        over = ",".join(f"{k}={v}" for k, v in r["overrides"].items())
        types = "; ".join(f"{n} x{c}" for n, c in r["block_types"])
        print(f"| {r['model']} | {r['config']}{' ' + over if over else ''} | "
              f"{r['params'] / 1e9:.2f}B | {r['ops']} | {r['trace_s']:.2f} | "
              f"{r['group_s_median']:.3f} | {types} |")
    report = {"bench": "trace_group", "date": time.strftime("%Y-%m-%d"),
              "machine": {"python": platform.python_version(), "jax": jax.__version__,
                          "cpus": __import__("os").cpu_count()},
              "rows": rows}
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(report, indent=2))
    print(f"\nwrote {opts.out}")


if __name__ == "__main__":
    main()
