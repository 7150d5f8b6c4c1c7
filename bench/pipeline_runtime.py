"""What the shard_map pipeline runtime compiles to, next to plain data parallelism, and the MPMD runtime.

Part 4 (`bench/_mpmd_part.py`, its own results `pipeline_runtime_mpmd.{json,md}`; `--mpmd-only` runs just
it) runs the same plan on the MPMD runtime and on the SPMD one (launches, transfers or collectives, memory
per device, wall time) and an unequal plan only MPMD runs.

Part 3 trains whole adamw steps under @autoshard: GPT with a RaNNC pipeline plan and the debug
CANDLE-Uno with a GraphPipe DAG plan, each next to the tensor sharding plan on the same devices.

Part 2 runs the zoo's GPT (8 layers, d_model 256, seq 128, vocab 4096, batch 32) through
`autoshard.pipelined` (the loss cut by flops, and by a RaNNC plan) on pipe=4 x data=2 and pipe=8,
next to data parallelism over 8, with the same per-device figures.

An MLP of `stages` x `layers_per_stage` Dense(width) + tanh layers (mean-squared-error head in the
last stage) on 8 simulated CPU devices. Variants, all compiled with `jit(...).lower(...).compile()`:
- `pipe=8` GPipe and 1F1B: one stage per device (pipeline.runtime, `num_microbatches` micro-batches);
- `pipe=4 x data=2` 1F1B: two data-parallel replicas inside each stage;
- data parallel: `jax.value_and_grad` of the whole model, parameters replicated, batch split 8 ways.
Reported per device: parameter (argument) bytes and temp bytes from `memory_analysis()`, flops from
`cost_analysis()`, collectives from the compiled HLO (kind, launches per step counting loop trips,
bytes per step), the program's tick count and activation slots, and whether loss and gradients
equal single-device `jax.value_and_grad` (max abs difference). Step time is the median of
interleaved runs; on 2 shared cores it measures total work, not parallel speed.

    python bench/pipeline_runtime.py [--width 512] [--batch 64] [--microbatches 16] [--rounds 5]
"""

from __future__ import annotations

import jax

jax.config.update("jax_num_cpu_devices", 8)  # before any backend use

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _common import ROOT, machine  # noqa: E402
from _mpmd_part import markdown, mpmd_part  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import autoshard  # noqa: E402
import models  # noqa: E402
from pipeline import pipeline_value_and_grad  # noqa: E402

STAGES, LAYERS_PER_STAGE = 8, 2


def make_problem(width: int, batch: int, stages: int):
    keys = jax.random.split(jax.random.key(0), stages * LAYERS_PER_STAGE + 2)
    params = [[{"w": jax.random.normal(keys[s * LAYERS_PER_STAGE + i], (width, width)) / np.sqrt(width),
                "b": jnp.zeros((width,))} for i in range(LAYERS_PER_STAGE)] for s in range(stages)]
    data = {"x": jax.random.normal(keys[-2], (batch, width)), "y": jax.random.normal(keys[-1], (batch, width))}

    def body(p, x):
        for layer in p:
            x = jnp.tanh(x @ layer["w"] + layer["b"])
        return x

    def first(p, b):
        return body(p, b["x"])

    def middle(p, b, x):
        return body(p, x)

    def last(p, b, x):
        return jnp.mean((body(p, x) - b["y"]) ** 2)

    fns = [first] + [middle] * (stages - 2) + [last]

    def full_loss(ps, b):
        x = b["x"]
        for p in ps:
            x = body(p, x)
        return jnp.mean((x - b["y"]) ** 2)

    return fns, params, data, full_loss


def mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def describe(compiled, mesh_obj) -> dict:
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    _, colls = autoshard.Audit.read_collectives(compiled.as_text(), mesh_obj)
    return {"argument_bytes": int(mem.argument_size_in_bytes), "temp_bytes": int(mem.temp_size_in_bytes),
            "output_bytes": int(mem.output_size_in_bytes), "flops": float(cost.get("flops", 0.0)),
            "collectives": {k: {"count": int(v["count"]), "bytes": int(v["bytes"])} for k, v in colls.items()}}


def max_diff(a, b) -> float:
    return max(float(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32) - jnp.asarray(y, jnp.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


GPT = {"num_layers": 8, "d_model": 256, "num_heads": 8, "seq_len": 128, "vocab_size": 4096, "batch_size": 32}


def gpt_part(M: int) -> tuple[list[dict], int]:
    m = models.get("gpt", "debug", **GPT)
    params, batch = m.init(jax.random.key(0)), m.batch()
    want_loss, want_grads = jax.jit(jax.value_and_grad(m.loss))(params, batch)
    rows = []
    opt = m.optimizer.init(params)
    for name, shape, use_plan in [("pipe=4 x data=2, flops cut", {"pipe": 4, "data": 2}, False),
                                  ("pipe=4 x data=2, RaNNC plan cut", {"pipe": 4, "data": 2}, True),
                                  ("pipe=8, flops cut", {"pipe": 8}, False)]:
        plan = autoshard.plan(m.train_step, params, opt, batch, mesh=shape, hardware="v100-sxm",
                              pipeline="rannc") if use_plan else None
        run = autoshard.pipelined(m.loss, params, batch, mesh=shape, num_microbatches=M // 2, plan=plan)
        state = run.stack(params)
        loss, grads = run(state, batch)
        rows.append({"variant": name, "stage_eqns": "/".join(str(st.eqns) for st in run.stages),
                     "loss_diff": abs(float(loss) - float(want_loss)),
                     "grad_max_diff": max_diff(run.unstack(grads), want_grads),
                     **describe(run.program.lower(state, batch).compile(), run.mesh)})
    m8 = mesh((8,), ("data",))
    repl, split = NamedSharding(m8, P()), NamedSharding(m8, P("data"))
    dp = jax.jit(jax.value_and_grad(m.loss), in_shardings=(repl, split), out_shardings=(repl, repl))
    p_dp, b_dp = jax.device_put(params, repl), jax.device_put(batch, split)
    loss, grads = dp(p_dp, b_dp)
    rows.append({"variant": "data=8 (replicated params)", "stage_eqns": "",
                 "loss_diff": abs(float(loss) - float(want_loss)), "grad_max_diff": max_diff(grads, want_grads),
                 **describe(dp.lower(p_dp, b_dp).compile(), m8)})
    return rows, sum(x.nbytes for x in jax.tree.leaves(params))


def decorator_part() -> list[dict]:
    """Whole adamw train steps under @autoshard: a pipeline plan (the step's autoshard.value_and_grad
    runs as stages) next to the tensor sharding plan on the same 8 devices and a 1-device jit."""
    import optax

    rows = []
    for model, cfg, variants in [
        ("gpt", GPT, [("pipeline rannc, pipe=4 x data=2", {"pipe": 4, "data": 2}, "rannc"),
                      ("tensor plan, data=8", {"data": 8}, None)]),
        ("candle_uno", {}, [("pipeline graphpipe (DAG), data=8", {"data": 8}, "graphpipe"),
                            ("tensor plan, data=8", {"data": 8}, None)]),
    ]:
        m = models.get(model, "debug", **cfg)
        params, batch = m.init(jax.random.key(0)), m.batch()

        def step(params, opt_state, batch, m=m):
            loss, grads = autoshard.value_and_grad(m.loss)(params, batch)
            updates, opt_state = m.optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        ref = jax.jit(step)
        want = (params, m.optimizer.init(params))
        want_losses = []
        for _ in range(2):
            *want, loss = ref(*want, batch)
            want_losses.append(float(loss))
        for name, mesh_dict, pipeline in variants:
            kw = {"pipeline": pipeline} if pipeline else {}
            fast = autoshard.autoshard(step, mesh=mesh_dict, hardware="v100-sxm", **kw)
            state = (params, m.optimizer.init(params))
            losses = []
            for _ in range(2):
                *state, loss = fast(*state, batch)
                losses.append(float(loss))
            compiled = fast.lower(*state, batch).compile()
            run_mesh = fast.pipelined.mesh if fast.pipelined is not None else fast._mesh
            rows.append({"model": model, "variant": name,
                         "stages": len(fast.plan.stages) if fast.plan.stages else None,
                         "loss_diff": max(abs(a - b) for a, b in zip(losses, want_losses, strict=True)),
                         "param_max_diff": max_diff(state[0], want[0]), **describe(compiled, run_mesh)})
    return rows


def mpmd_report(opts) -> None:
    part = mpmd_part(GPT, opts.microbatches // 2, opts.rounds, describe, mesh)
    out = Path(opts.out).with_name("pipeline_runtime_mpmd.json")
    out.write_text(json.dumps({"machine": machine(), "gpt": GPT, **part}, indent=1))
    head = "# MPMD vs SPMD pipeline runtime (bench/pipeline_runtime.py part 4)"
    text = "\n".join([head, *markdown(part, GPT)]) + "\n"
    out.with_suffix(".md").write_text(text)
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench/results/pipeline_runtime.json"))
    ap.add_argument("--mpmd-only", action="store_true", help="part 4 only (MPMD vs SPMD)")
    opts = ap.parse_args()
    M = opts.microbatches
    mpmd_report(opts)
    if opts.mpmd_only:
        return
    fns8, params8, data, full8 = make_problem(opts.width, opts.batch, STAGES)
    want_loss, want_grads = jax.jit(jax.value_and_grad(full8))(params8, data)
    # 4-stage variant: the same 16 layers, 4 per stage
    params4 = [params8[2 * s] + params8[2 * s + 1] for s in range(4)]
    fns4 = [fns8[0], fns8[1], fns8[1], fns8[-1]]
    want4 = [want_grads[2 * s] + want_grads[2 * s + 1] for s in range(4)]

    rows, runners = [], {}
    for name, shape, names, sched, fns, params, want in [
        ("pipe=8 gpipe", (8,), ("pipe",), "gpipe", fns8, params8, want_grads),
        ("pipe=8 1f1b", (8,), ("pipe",), "1f1b", fns8, params8, want_grads),
        ("pipe=4 x data=2 1f1b", (4, 2), ("pipe", "data"), "1f1b", fns4, params4, want4),
    ]:
        m = mesh(shape, names)
        prog = pipeline_value_and_grad(fns, m, num_microbatches=M, schedule=sched)
        stacked = prog.stack(params)
        loss, grads = prog(stacked, data)
        compiled = prog.lower(stacked, data).compile()
        row = {"variant": name, "ticks": prog.ticks, "slots": list(prog.slots),
               "loss_diff": abs(float(loss) - float(want_loss)), "grad_max_diff": max_diff(prog.unstack(grads), want),
               **describe(compiled, m)}
        rows.append(row)
        runners[name] = (lambda prog=prog, stacked=stacked: prog(stacked, data)[0].block_until_ready())

    m = mesh((8,), ("data",))
    repl, split = NamedSharding(m, P()), NamedSharding(m, P("data"))
    dp = jax.jit(jax.value_and_grad(full8), in_shardings=(repl, split), out_shardings=(repl, repl))
    p_dp, d_dp = jax.device_put(params8, repl), jax.device_put(data, split)
    loss, grads = dp(p_dp, d_dp)
    rows.append({"variant": "data=8 (replicated params)", "ticks": None, "slots": None,
                 "loss_diff": abs(float(loss) - float(want_loss)), "grad_max_diff": max_diff(grads, want_grads),
                 **describe(dp.lower(p_dp, d_dp).compile(), m)})
    runners["data=8 (replicated params)"] = lambda: dp(p_dp, d_dp)[0].block_until_ready()

    times = {k: [] for k in runners}
    for _ in range(opts.rounds):
        for k, run in runners.items():
            t0 = time.perf_counter()
            run()
            times[k].append(time.perf_counter() - t0)
    for row in rows:
        row["step_s_median"] = statistics.median(times[row["variant"]])

    gpt_rows, gpt_param_bytes = gpt_part(M)
    step_rows = decorator_part()
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(params8))
    result = {"machine": machine(), "width": opts.width, "batch": opts.batch, "microbatches": M,
              "layers": STAGES * LAYERS_PER_STAGE, "model_param_bytes": param_bytes, "rows": rows,
              "gpt": {"config": GPT, "param_bytes": gpt_param_bytes, "rows": gpt_rows}, "train_steps": step_rows}
    Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
    Path(opts.out).write_text(json.dumps(result, indent=1))
    lines = [f"# Pipeline runtime vs data parallel ({STAGES * LAYERS_PER_STAGE} x Dense({opts.width}) + tanh, "
             f"batch {opts.batch}, {M} micro-batches, 8 simulated CPU devices)", "",
             f"Model parameters: {param_bytes / 2**20:.1f} MiB. Bytes are per device.", "",
             "| variant | param (argument) MiB | temp MiB | ticks | slots in/grad | collectives per step | "
             "collective MiB per step | loss diff | grad max diff | step s (median) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        coll = ", ".join(f"{k} x{v['count']}" for k, v in r["collectives"].items()) or "none"
        cbytes = sum(v["bytes"] for v in r["collectives"].values()) / 2**20
        lines.append(f"| {r['variant']} | {r['argument_bytes'] / 2**20:.2f} | {r['temp_bytes'] / 2**20:.2f} | "
                     f"{r['ticks'] if r['ticks'] is not None else '-'} | "
                     f"{'/'.join(map(str, r['slots'])) if r['slots'] else '-'} | {coll} | {cbytes:.2f} | "
                     f"{r['loss_diff']:.1e} | {r['grad_max_diff']:.1e} | {r['step_s_median']:.3f} |")
    lines += ["", f"## GPT through autoshard.pipelined ({GPT}, {M // 2} micro-batches)", "",
              f"Model parameters: {gpt_param_bytes / 2**20:.1f} MiB. Bytes are per device; collectives per step.", "",
              "| variant | stages: eqns | argument MiB | temp MiB | collectives | collective MiB | loss diff | "
              "grad max diff |", "|---|---|---|---|---|---|---|---|"]
    for r in gpt_rows:
        coll = ", ".join(f"{k} x{v['count']}" for k, v in r["collectives"].items()) or "none"
        cbytes = sum(v["bytes"] for v in r["collectives"].values()) / 2**20
        lines.append(f"| {r['variant']} | {r['stage_eqns'] or '-'} | {r['argument_bytes'] / 2**20:.2f} | "
                     f"{r['temp_bytes'] / 2**20:.2f} | {coll} | {cbytes:.2f} | {r['loss_diff']:.1e} | "
                     f"{r['grad_max_diff']:.1e} |")
    lines += ["", "## Whole adamw steps under @autoshard (2 steps; GPT as above, debug CANDLE-Uno)", "",
              "Per device: arguments (parameters + optimizer state + batch), outputs, temporaries; "
              "collectives per step.", "",
              "| model | variant | stages | argument MiB | output MiB | temp MiB | collective MiB | "
              "collective launches | loss diff vs 1 device | param max diff |", "|---" * 10 + "|"]
    for r in step_rows:
        cbytes = sum(v["bytes"] for v in r["collectives"].values()) / 2**20
        launches = sum(v["count"] for v in r["collectives"].values())
        lines.append(f"| {r['model']} | {r['variant']} | {r['stages'] or '-'} | {r['argument_bytes'] / 2**20:.2f} | "
                     f"{r['output_bytes'] / 2**20:.2f} | {r['temp_bytes'] / 2**20:.2f} | {cbytes:.2f} | {launches} | "
                     f"{r['loss_diff']:.1e} | {r['param_max_diff']:.1e} |")
    text = "\n".join(lines) + "\n"
    Path(opts.out).with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
