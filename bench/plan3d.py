"""3-D plans at scale (issue 16): GPT-3 175B on 64 / 512 / 1024 H100s and Alpa's GPT configurations.

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
    out = []
    for n in devices_list:
        t0 = time.perf_counter()
        plan = autoshard.plan(m.train_step, *args, mesh="auto", devices=n, hardware=hardware)
        total = time.perf_counter() - t0
        j, timing = plan.predicted["3d"], plan.predicted["timing"]
        trace_s = timing["trace_seconds"]
        flops = model_flops(cfg)
        r = {"model": name, "devices": n, "hardware": hardware, "trace_s": trace_s,
             "plan_s": total, "search_s": j["search_seconds"], "timing": dict(timing),
             "points": j["points"], "units": j["units"], "runnable": j["runnable"],
             "chosen": point(j["chosen"], flops, n, peak),
             "tensor_only": point(j["tensor_only"], flops, n, peak),
             "pipeline_only": point(j["pipeline_only"], flops, n, peak),
             "megatron_grid": point(j["megatron_grid"], flops, n, peak),
             "megatron_grid_reason": j["megatron_grid_reason"],
             "runnable_alternative": point(j.get("runnable_alternative"), flops, n, peak)}
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


def _fmt(q: dict | None) -> str:
    if q is None:
        return "none fits"
    return f"{q['step_s']:.3f} s, {q['memory_gib']:.1f} GiB, MFU {q['mfu']:.1%} ({q['label']})"


def markdown(rows: list[dict]) -> str:
    lines = ["# 3-D plans (bench/plan3d.py)", "",
             "Predicted by autoshard's cost model and event simulator (not measured); trace+plan timed on this "
             "machine (2 CPU cores). A chosen plan whose stages have unequal submeshes is planned but not "
             "runnable yet; the best runnable (equal-submesh) plan is in its own column.", "",
             "| model | devices | trace s | trace+plan s | search s | chosen | runnable alternative | tensor-only | "
             "pipeline-only | Megatron grid | grid / chosen |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        alt = _fmt(r["runnable_alternative"]) if r.get("runnable_alternative") else "(chosen)"
        grid = _fmt(r["megatron_grid"]) if r["vs_grid"] else f"none ({r['megatron_grid_reason']})"
        ratio = f"{r['vs_grid']:.2f}" if r["vs_grid"] else "-"
        lines.append(f"| {r['model']} | {r['devices']} {r['hardware']} | {r['trace_s']:.1f} | {r['plan_s']:.1f} | "
                     f"{r['search_s']:.2f} | {_fmt(r['chosen'])} | {alt} | {_fmt(r['tensor_only'])} | "
                     f"{_fmt(r['pipeline_only'])} | {grid} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="GPT-3 on 64 devices and the three smallest Alpa rows")
    ap.add_argument("--out", default=str(ROOT / "bench/results/plan3d.json"))
    a = ap.parse_args(argv)
    rows: list[dict] = []
    for name, layers, hidden, heads, n in (ALPA[:3] if a.quick else ALPA):
        cfg = dict(num_layers=layers, d_model=hidden, num_heads=heads, seq_len=1024, vocab_size=51200,
                   batch_size=1024, dtype="float16")
        rows += row(f"GPT-{name}", cfg, [n], "v100-16gb-25gbps")
    rows += row("GPT-3 175B", GPT3, [64] if a.quick else [64, 512, 1024], "h100-sxm")
    out = Path(a.out)
    out.write_text(json.dumps(rows, indent=1, default=str))
    out.with_suffix(".md").write_text(markdown(rows))
    print(f"wrote {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
