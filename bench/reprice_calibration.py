"""Re-price the cases measured on a GPU (`bench/gpu_calibrate.py`'s results) with the current model.

`gpu_calibrate.py` times fused elementwise chains, attention and the per-GPU transformer layer of
every published run on a real GPU, beside the kernel model's prediction at the time. The model
changes after; the GPU is rarely lent. This script rebuilds each recorded case abstractly (shapes
only: nothing runs), prices it with today's model (`gpu_calibrate.model_price`: every traced op on
the hardware's kernel model, after fusion; cuDNN attention rows as XLA's program with
`attention="flash"`, since cuDNN's call does not trace without a GPU) and prints measured /
predicted then and now, so every model change is checked against the same measurements.

The "step" section rebuilds each whole train step (a zoo model on one device) from its shapes
(`models.get(...).abstract_state()`: nothing is allocated), plans it on the one-device mesh with the
results' hardware preset and prints the measured / predicted step time and the predicted / compiled
argument+temp memory (`Plan.memory_on("gpu")`, the numbers `autoshard.audit` compares with XLA's
`memory_analysis()`), then and now. `--skip step` leaves a slow section out.

    python bench/reprice_calibration.py [--results bench/results/gpu_calibrate_h100.json] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_calibrate as gc  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import autoshard  # noqa: E402
from autoshard._src.core.errors import InfeasiblePlanError  # noqa: E402
from autoshard._src.core.hardware import get_hardware  # noqa: E402

_FUSED = {"softmax": gc._softmax, "layernorm": gc._layernorm, "gelu_tanh": gc._gelu,
          "bias_residual": gc._bias_residual}


def _sds(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def fused_case(row: dict):
    f, dt, shape = _FUSED[row["op"]], row["dtype"], row["shape"]
    if row["op"] == "softmax":
        args = (_sds(shape, dt),)
    elif row["op"] == "layernorm":
        args = (_sds(shape, dt), _sds(shape[-1:], "float32"), _sds(shape[-1:], "float32"))
    elif row["op"] == "gelu_tanh":
        args = (_sds(shape, dt), _sds(shape[-1:], dt))
    else:
        args = (_sds(shape, dt), _sds(shape[-1:], dt), _sds(shape, dt))
    fn = f if row["mode"] == "fwd" else jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(),
                                                 argnums=tuple(range(len(args))))
    return fn, args


def attention_case(row: dict):
    # cuDNN's call does not trace without a GPU: its rows are XLA's program priced as FlashAttention
    impl = None if row["impl"] in ("None", "cudnn") else row["impl"]
    q = _sds((row["B"], row["S"], row["H"], row["D"]), "bfloat16")

    def fwd(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)

    def fwd_bwd(q, k, v):
        return jax.grad(lambda q, k, v: fwd(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)

    return (fwd if row["mode"] == "fwd" else fwd_bwd), (q, q, q)


def layer_case(row: dict):
    impl = None if row["impl"] in ("None", "cudnn") else row["impl"]
    h, tp, heads = row["h"], row["tp"], row["heads"]
    shapes = {"wqkv": (h, 3 * h // tp), "bqkv": (3 * h // tp,), "wo": (h // tp, h), "bo": (h,),
              "w1": (h, 4 * h // tp), "b1": (4 * h // tp,), "w2": (4 * h // tp, h), "b2": (h,),
              "ln1_g": (h,), "ln1_b": (h,), "ln2_g": (h,), "ln2_b": (h,)}
    params = {k: _sds(s, "float32") for k, s in shapes.items()}
    x = _sds((row["B"], row["S"], h), "bfloat16")
    loss = (lambda p, x: gc.gpt_layer_loss(p, x, impl, heads // tp))
    fn = jax.value_and_grad(jax.checkpoint(loss) if row["remat"] else loss)
    return fn, (params, x)


CASES = {"fused": fused_case, "attention": attention_case, "layer": layer_case}


def label(section: str, row: dict) -> str:
    if section == "fused":
        return f"{row['op']} {row['mode']} {row['dtype']}"
    if section == "attention":
        return f"B{row['B']} S{row['S']} H{row['H']} D{row['D']} {row['impl']} {row['mode']}"
    return f"{row['run']} tp{row['tp']} B{row['B']} {row['impl']}{' remat' if row['remat'] else ''}"


def step_case(row: dict, hw) -> dict:
    """The planner's step time and argument+temp memory for a recorded whole-step row, from shapes
    only (rows written before `overrides` was recorded used none)."""
    import models
    m = models.get(row["model"], row["config"], **row.get("overrides", {}))
    args = m.abstract_state()
    note = ""
    try:
        plan = autoshard.plan(m.train_step, *args, mesh={"data": 1}, hardware=hw)
    except InfeasiblePlanError:     # the prediction no longer fits the device: price it regardless
        plan = autoshard.plan(m.train_step, *args, mesh={"data": 1}, hardware=hw, memory_budget=1e15)
        note = "over the memory budget"
    return {"time": plan.predicted["step_time"], "memory": plan.memory_on("gpu")["argument+temp"], "note": note}


def step_label(row: dict) -> str:
    o = row.get("overrides") or {}
    extra = " ".join(f"{k}={o[k]}" for k in ("d_model", "num_layers", "batch_size") if k in o)
    return f"{row['model']} {row['config']}" + (f" {extra}" if extra else "")


def reprice_steps(results: dict, hw) -> list[dict]:
    out = []
    for row in results["sections"].get("step", []):
        if "measured" not in row or "predicted" not in row:
            continue
        r = {"section": "step", "case": step_label(row), "measured": row["measured"],
             "then": row["measured"] / row["predicted"]}
        compiled = row.get("compiled_memory", {}).get("argument+temp")
        then_mem = row.get("predicted_memory", {}).get("argument+temp")
        try:
            now = step_case(row, hw)
        except Exception as exc:
            out.append(dict(r, error=f"{type(exc).__name__}: {str(exc)[:120]}"))
            continue
        r.update(now=row["measured"] / now["time"], predicted_ms=now["time"] * 1e3, note=now["note"])
        if compiled:
            r.update(compiled_mib=compiled / 2**20, mem_then=then_mem / compiled - 1 if then_mem else None,
                     mem_now=now["memory"] / compiled - 1, predicted_mib=now["memory"] / 2**20)
        out.append(r)
    return out


def reprice(results: dict, hw, skip: tuple[str, ...] = ()) -> list[dict]:
    out = []
    for section, build in CASES.items():
        if section in skip:
            continue
        for row in results["sections"].get(section, []):
            if "measured" not in row or "predicted" not in row:
                continue
            try:
                fn, args = build(row)
                attention = "flash" if row.get("impl") == "cudnn" else "as_traced"
                now = gc.model_price(fn, args, hw, attention)["predicted"]
            except Exception as exc:       # e.g. cuDNN attention does not trace without a GPU
                out.append({"section": section, "case": label(section, row), "error": f"{type(exc).__name__}"})
                continue
            out.append({"section": section, "case": label(section, row), "measured": row["measured"],
                        "then": row["measured"] / row["predicted"], "now": row["measured"] / now})
    if "step" not in skip:
        out += reprice_steps(results, hw)
    return out


def markdown(rows: list[dict], results: dict) -> str:
    meta = results["meta"]
    lines = [f"# measured / predicted on {meta['device_kind']}: the model then and now", "",
             "`python bench/reprice_calibration.py`; 1.0 = exact, < 1: the model is too slow.", "",
             "| section | cases | then: min / median / max | now: min / median / max | now within [0.85, 1.15] |",
             "|---|---|---|---|---|"]
    for section in (*CASES, "step"):
        ok = [r for r in rows if r["section"] == section and "now" in r]
        if not ok:
            continue
        then, now = [r["then"] for r in ok], [r["now"] for r in ok]
        share = sum(0.85 <= x <= 1.15 for x in now) / len(now)
        lines.append(f"| {section} | {len(ok)} | {min(then):.2f} / {statistics.median(then):.2f} / {max(then):.2f} "
                     f"| {min(now):.2f} / {statistics.median(now):.2f} / {max(now):.2f} | {share:.0%} |")
    cases = [r for r in rows if r["section"] != "step"]
    if cases:
        lines += ["", "| case | measured ms | then | now |", "|---|---|---|---|"]
    for r in cases:
        if "now" in r:
            lines.append(f"| {r['section']}: {r['case']} | {r['measured'] * 1e3:.3g} | {r['then']:.2f} "
                         f"| {r['now']:.2f} |")
        else:
            lines.append(f"| {r['section']}: {r['case']} | - | - | not priced here ({r['error']}) |")
    steps = [r for r in rows if r["section"] == "step"]
    if steps:
        lines += ["", "## whole train steps (one device): time measured / predicted, memory predicted / compiled - 1",
                  "", "argument+temp: XLA's `memory_analysis()` of the compiled step; predicted: "
                  "`Plan.memory_on('gpu')` (what `autoshard.audit` compares).", "",
                  "| step | measured ms | predicted ms now | time then | time now | compiled MiB | predicted MiB now "
                  "| memory then | memory now | note |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in steps:
            if "now" not in r:
                lines.append(f"| {r['case']} | {r['measured'] * 1e3:.3g} | - | {r['then']:.2f} | - | - | - | - | - "
                             f"| {r['error']} |")
                continue
            mem = (f"{r['compiled_mib']:.0f} | {r['predicted_mib']:.0f} | "
                   + (f"{r['mem_then']:+.1%}" if r.get("mem_then") is not None else "-")
                   + f" | {r['mem_now']:+.1%}") if "compiled_mib" in r else "- | - | - | -"
            lines.append(f"| {r['case']} | {r['measured'] * 1e3:.3g} | {r['predicted_ms']:.3g} | {r['then']:.2f} "
                         f"| {r['now']:.2f} | {mem} | {r['note']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "bench/results/gpu_calibrate_h100.json"))
    ap.add_argument("--out", default=None, help="write the markdown here too")
    ap.add_argument("--skip", default="", help="comma-separated sections to leave out (fused, attention, layer, "
                    "step)")
    args = ap.parse_args(argv)
    results = json.loads(Path(args.results).read_text())
    hw = get_hardware(results["meta"]["preset"])
    skip = tuple(x for x in args.skip.split(",") if x)
    text = markdown(reprice(results, hw, skip), results)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
