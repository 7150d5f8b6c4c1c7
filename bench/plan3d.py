"""3-D plans at scale (issues 16, 31): GPT-3 175B on 64 / 512 / 1024 H100s, a 462B GPT on 6,144 H100s,
Alpa's GPT configurations, and every published Megatron-LM run of `../shared/published_runs.md`.

Every row is planned abstractly through the public API, `autoshard.plan(step, *args, mesh="auto",
devices=N, hardware=...)`, which searches stages x data x model x remat x micro-batches x schedule
and prices, with the same model and event simulator, the best tensor-only point, the best
pipeline-only point and the best point of the Megatron-LM grid (tp 1/2/4/8 inside a node, pp over
the layer count's divisors, dp the rest, uniform split, 1F1B, full recompute on/off, ZeRO-1 over
data, micro-batches over powers of two).

* `gpt3`: 96 layers, d 12288, 96 heads, seq 2048, vocab 50257, batch 1536, bfloat16 parameters
  and Adam state (optax's default: moments in the parameters' dtype), on `h100-sxm`.
* `alpa`: Alpa's GPT benchmark (OSDI 2022, Table 4): seq 1024, vocab 51200, global batch 1024,
  350M/24 layers/h1024 on 1 GPU ... 39B/48/8192 on 64, float16, on `v100-16gb-25gbps`.
* `gpt462`: 112 layers, d 18432, 144 heads, seq 2048, vocab 51200, batch 3072, bfloat16, on 6,144
  `h100-sxm` (a large row for the search's speed: target <= 30 s beyond the trace).
* `published`: each run of `bench/published_runs.py` (SC'21 Table 1, Korthikanti et al. 2022), the
  GPU-style GPT at its size on its A100 count: the search's choice (`mesh="auto"`) next to the published
  configuration, both priced by the same model (`published_runs.plan_kwargs`: its exact TP x PP x DP,
  M, schedule, recompute and sequence parallelism). The search's choice must be no slower.

`--only alpa,gpt3,gpt462,published` picks row groups; `--published "SC21 310.1B,KORT 530B full"` rows.

Model FLOPs utilisation uses Megatron-LM's count of model FLOPs per step (no recompute),
72 B s l h^2 (1 + s / (6 h) + V / (12 l h)), over devices x peak x step.

    python bench/plan3d.py [--quick] [--out bench/results/plan3d.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autoshard  # noqa: E402
import models  # noqa: E402

GPT3 = dict(num_layers=96, d_model=12288, num_heads=96, seq_len=2048, vocab_size=50257, batch_size=1536,
            dtype="bfloat16")
# (name, layers, hidden, heads, devices) from Alpa's GPT table; seq 1024, vocab 51200, batch 1024
ALPA = [("350M", 24, 1024, 16, 1), ("760M", 24, 1536, 16, 2), ("1.3B", 24, 2048, 32, 4),
        ("2.6B", 32, 2560, 32, 8), ("6.7B", 32, 4096, 32, 16), ("15B", 48, 5120, 40, 32),
        ("39B", 48, 8192, 64, 64)]


def model_flops(cfg: dict) -> float:
    B, s, L, h, V = cfg["batch_size"], cfg["seq_len"], cfg["num_layers"], cfg["d_model"], cfg["vocab_size"]
    return 72.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


def point(q: dict | None, flops: float, devices: int, peak: float) -> dict | None:
    if q is None:
        return None
    return {**q, "step_s": q["step_time"], "memory_gib": q["memory"] / 2**30,
            "mfu": flops / (devices * peak * q["step_time"])}


def row(name: str, cfg: dict, devices_list: list[int], hardware: str) -> list[dict]:
    m = models.get("gpt", "debug", **cfg)
    args = m.abstract_state()
    peak = autoshard.get_hardware(hardware).peak_flops(cfg["dtype"])
    plan_fn = autoshard.plan        # autoshard loads its jax bridge on first use (0.6 s): not planning time
    out = []
    for n in devices_list:
        t0 = time.perf_counter()
        plan = plan_fn(m.train_step, *args, mesh="auto", devices=n, hardware=hardware)
        total = time.perf_counter() - t0
        j, timing = plan.predicted["3d"], plan.predicted["timing"]
        trace_s = timing["trace_seconds"]
        flops = model_flops(cfg)
        r = {"model": name, "devices": n, "hardware": hardware, "trace_s": trace_s,
             "plan_s": total, "search_s": j["search_seconds"], "timing": dict(timing),
             "points": j["points"], "units": j["units"], "runtime": plan.runtime,
             "chosen": point(j["chosen"], flops, n, peak),
             "tensor_only": point(j["tensor_only"], flops, n, peak),
             "pipeline_only": point(j["pipeline_only"], flops, n, peak),
             "megatron_grid": point(j["megatron_grid"], flops, n, peak),
             "megatron_grid_reason": j["megatron_grid_reason"]}
        g = r["megatron_grid"]
        r["vs_grid"] = g["step_s"] / r["chosen"]["step_s"] if g else None
        print(f"{name:>6} on {n:>4} {hardware}: trace {trace_s:5.1f} s, trace+plan {total:5.1f} s (search "
              f"{r['search_s']:.2f} s), {r['chosen']['label']}: {r['chosen']['step_s']:.3f} s, "
              f"{r['chosen']['memory_gib']:.1f} GiB, MFU {r['chosen']['mfu']:.1%}"
              + (f"; grid {g['step_s']:.3f} s ({r['vs_grid']:.2f}x)" if g else "; grid: none"), flush=True)
        out.append(r)
        del plan
        gc.collect()
    return out


GPT462 = dict(num_layers=112, d_model=18432, num_heads=144, seq_len=2048, vocab_size=51200, batch_size=3072,
              dtype="bfloat16")


def published_row(run) -> dict:
    """A published run: the search's choice on its device count next to its configuration, one model."""
    from published_runs import build_model, measured_step, plan_kwargs

    m = build_model(run, "gpu")
    args = m.abstract_state()
    t0 = time.perf_counter()
    auto = autoshard.plan(m.train_step, *args, mesh="auto", devices=run.gpus, hardware="a100-sxm")
    auto_s = time.perf_counter() - t0
    pub = autoshard.plan(m.train_step, *args, **plan_kwargs(run)).predicted["3d"]["chosen"]
    chosen, timing = auto.predicted["3d"]["chosen"], auto.predicted["timing"]
    r = {"row": run.name, "gpus": run.gpus, "published": pub, "chosen": chosen,
         "chosen_step_s": auto.predicted["step_time"], "published_step_s": pub["step_time"],
         "measured_s": measured_step(run), "beyond_trace_s": timing["total_seconds"] - timing["trace_seconds"],
         "plan_s": auto_s, "points": auto.predicted["3d"]["points"],
         "candidates": auto.predicted["3d"].get("candidates")}
    r["no_slower"] = r["chosen_step_s"] <= r["published_step_s"] * (1 + 1e-9)
    print(f"{run.name:>17} on {run.gpus:>4}: search {r['chosen_step_s']:.3g} s ({chosen['label']}, M "
          f"{chosen['microbatches']}, remat {'/'.join(chosen['remat'])}) vs published {r['published_step_s']:.3g} s "
          f"({'ok' if r['no_slower'] else 'SLOWER'}); beyond the trace {r['beyond_trace_s']:.1f} s", flush=True)
    del auto
    gc.collect()
    return r


def published_markdown(rows: list[dict]) -> str:
    lines = ["", "## Published Megatron-LM runs: the search's choice vs the published configuration", "",
             "Both priced by the same model (GPU-style GPT, a100-sxm); measured = the papers' step.", "",
             "| run | GPUs | search's choice | predicted s | published config | predicted s | measured s | "
             "no slower | beyond trace s | points / candidates |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, p = r["chosen"], r["published"]
        lines.append(f"| {r['row']} | {r['gpus']} | {c['label']}, M {c['microbatches']}, {c['schedule']}, remat "
                     f"{'/'.join(c['remat'])} | {r['chosen_step_s']:.3g} | {p['label']}, M {p['microbatches']}, "
                     f"remat {'/'.join(p['remat'])} | {r['published_step_s']:.3g} | {r['measured_s']:.3g} | "
                     f"{'yes' if r['no_slower'] else '**no**'} | {r['beyond_trace_s']:.1f} | "
                     f"{r['points']} / {r['candidates']} |")
    return "\n".join(lines) + "\n"


def _fmt(q: dict | None) -> str:
    if q is None:
        return "none fits"
    return f"{q['step_s']:.3f} s, {q['memory_gib']:.1f} GiB, MFU {q['mfu']:.1%} ({q['label']})"


def markdown(rows: list[dict]) -> str:
    lines = ["# 3-D plans (bench/plan3d.py)", "",
             "Predicted by autoshard's cost model and event simulator (not measured); trace+plan timed on this "
             "machine (2 CPU cores). Every chosen plan runs: `runtime` spmd (one program over a pipe x data x model "
             "mesh) or mpmd (stages on unequal submeshes, each its own program).", "",
             "| model | devices | trace s | trace+plan s | search s | chosen | runtime | tensor-only | "
             "pipeline-only | Megatron grid | grid / chosen |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        grid = _fmt(r["megatron_grid"]) if r["vs_grid"] else f"none ({r['megatron_grid_reason']})"
        ratio = f"{r['vs_grid']:.2f}" if r["vs_grid"] else "-"
        lines.append(f"| {r['model']} | {r['devices']} {r['hardware']} | {r['trace_s']:.1f} | {r['plan_s']:.1f} | "
                     f"{r['search_s']:.2f} | {_fmt(r['chosen'])} | {r['runtime']} | {_fmt(r['tensor_only'])} | "
                     f"{_fmt(r['pipeline_only'])} | {grid} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="GPT-3 on 64 devices and the three smallest Alpa rows")
    ap.add_argument("--out", default=str(ROOT / "bench/results/plan3d.json"))
    ap.add_argument("--only", default="alpa,gpt3,gpt462,published", help="row groups to run")
    ap.add_argument("--published", help="comma-separated published run names (default: all)")
    ap.add_argument("--alpa", help="comma-separated Alpa rows to run, e.g. '39B' (default: all)")
    ap.add_argument("--gpt3-devices", help="comma-separated GPT-3 device counts, e.g. '1024' (default: all)")
    a = ap.parse_args(argv)
    only = set(a.only.split(","))
    rows: list[dict] = []
    if "alpa" in only:
        picked = ALPA[:3] if a.quick else ALPA
        if a.alpa:
            picked = [r for r in ALPA if r[0] in a.alpa.split(",")]
        for name, layers, hidden, heads, n in picked:
            cfg = dict(num_layers=layers, d_model=hidden, num_heads=heads, seq_len=1024, vocab_size=51200,
                       batch_size=1024, dtype="float16")
            rows += row(f"GPT-{name}", cfg, [n], "v100-16gb-25gbps")
    if "gpt3" in only:
        counts = [64] if a.quick else [64, 512, 1024]
        if a.gpt3_devices:
            counts = [int(n) for n in a.gpt3_devices.split(",")]
        rows += row("GPT-3 175B", GPT3, counts, "h100-sxm")
    if "gpt462" in only and not a.quick:
        rows += row("GPT 462B", GPT462, [6144], "h100-sxm")
    published = []
    if "published" in only and not a.quick:
        sys.path.insert(0, str(ROOT / "bench"))
        from published_runs import select

        published = [published_row(run) for run in select(a.published, False)]
    out = Path(a.out)
    out.write_text(json.dumps({"rows": rows, "published": published}, indent=1, default=str))
    out.with_suffix(".md").write_text(markdown(rows) + (published_markdown(published) if published else ""))
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
