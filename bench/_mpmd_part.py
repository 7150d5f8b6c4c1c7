"""Part 4 of bench/pipeline_runtime.py: the MPMD runtime next to the SPMD one on the same equal-submesh plan,
and an unequal plan only MPMD runs.

Same GPT as part 2, pipe=4 x data=2 (SPMD) vs four stages on (data 2, model 1) submeshes (MPMD), 1F1B,
one micro-batch count. Per step and per device:
- SPMD: the compiled program's collectives (kind, launches counting loop trips, bytes) and temp bytes
  (`memory_analysis()`); one program launch.
- MPMD: program launches (a forward and a backward per stage and micro-batch), cross-mesh transfers
  (count and bytes, counted at the runtime's `device_put`s: micro-batches, activations, their gradients),
  and per device the peak of (its stage's temp bytes of the larger of its forward / backward program plus
  the residuals its in-flight micro-batches hold), from `memory_analysis()` of the stage programs and the
  residual pytrees `jax.vjp` returns.
- wall seconds per step (gradients only, no optimizer), medians of interleaved rounds; on 2 shared CPU
  cores this is total work plus dispatch, not parallel speed.
Then the 3-D search's unequal plan for a small GPT on 8 H100s (stages of 2, 2 and 4 devices) runs MPMD:
its loss and gradients against one device and its wall time.
"""

from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp

import autoshard
import models
from autoshard._src.bridge.runtimes import mpmd as mpmd_module
from autoshard._src.bridge.runtimes.from_plan import mpmd_from_plan
from autoshard._src.bridge.runtimes.mpmd import mpmd_pipelined


def _nbytes_per_device(tree) -> int:
    return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


class _CountMoves:
    """Counts the MPMD runtime's cross-mesh transfers (its `_move`) while active."""

    def __init__(self):
        self.count, self.bytes, self._orig = 0, 0, mpmd_module._move

    def __enter__(self):
        def move(tree, mesh, axes=("data",)):
            leaves = jax.tree.leaves(tree)
            self.count += len(leaves)
            self.bytes += sum(x.nbytes for x in leaves)
            return self._orig(tree, mesh, axes)
        mpmd_module._move = move
        return self

    def __exit__(self, *exc):
        mpmd_module._move = self._orig


def _mpmd_memory(run, placed, batch) -> dict:
    """Per stage: temp bytes of its forward and backward programs, residual bytes per micro-batch held,
    in-flight micro-batches (1F1B: S - s), and the peak per device of temp + held residuals."""
    mbs, _ = run._microbatches(batch)
    S = run.num_stages
    xs: list = [[] for _ in range(S)]
    rows = []
    first, _ = run._bwd
    for s in range(S):
        ins = xs[s]
        y, held = run._fwd[s](placed[s], mbs[s][0], *ins)
        fwd = next(iter(run._fwd[s]._made.values()))[0].lower(placed[s], mbs[s][0], *ins).compile()
        vjp = held.vjp(placed[s])
        ct = None if s == run.sink else jnp.ones_like(y) if not isinstance(y, tuple) else jax.tree.map(jnp.ones_like, y)
        bwd = first.lower(vjp, ct, y).compile()
        for v in run.schedule.successors(s):
            xs[v].append(mpmd_module._move(y, run.meshes[v], run.batch_axes[v]))
        inflight = _most_in_flight(run.schedule, s)
        resid = _nbytes_per_device(held.kept)
        temp = max(fwd.memory_analysis().temp_size_in_bytes, bwd.memory_analysis().temp_size_in_bytes)
        rows.append({"stage": s, "temp_bytes": int(temp), "residual_bytes": resid, "inflight": inflight,
                     "peak_bytes": int(temp + inflight * resid + _nbytes_per_device(placed[s]))})
    return {"stages": rows, "peak_bytes": max(r["peak_bytes"] for r in rows)}


def _most_in_flight(sched, s: int) -> int:
    """The most micro-batches stage s holds between a forward and its backward, in its rank's task order."""
    held = most = 0
    for t in sched.ranks[sched.rank_of[s]]:
        if t.stage == s:
            held += 1 if t.kind == "F" else -1
            most = max(most, held)
    return most


def _median_seconds(fns: dict, rounds: int) -> dict:
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def mpmd_part(gpt: dict, M: int, rounds: int, describe, mesh) -> dict:
    m = models.get("gpt", "debug", **gpt)
    params, batch = m.init(jax.random.key(0)), m.batch()
    want_loss, _ = jax.jit(jax.value_and_grad(m.loss))(params, batch)
    spmd = autoshard.pipelined(m.loss, params, batch, mesh={"pipe": 4, "data": 2}, num_microbatches=M)
    stacked = spmd.stack(params)
    compiled = spmd.program.lower(stacked, batch).compile()
    run = mpmd_pipelined(m.loss, params, batch, submeshes=[(2, 1)] * 4, num_microbatches=M, schedule="1f1b")
    placed = run.place(params)
    with _CountMoves() as moves:
        loss_m, _ = run(placed, batch)
        jax.block_until_ready(loss_m)
    loss_s, _ = spmd(stacked, batch)
    spmd_desc = describe(compiled, spmd.mesh)
    secs = _median_seconds({"spmd": lambda: spmd(stacked, batch), "mpmd": lambda: run(placed, batch)}, rounds)
    equal = {"variant": "equal submeshes (4 stages x data 2), 1F1B", "microbatches": M,
             "spmd": {**spmd_desc, "launches": 1, "loss_diff": abs(float(loss_s) - float(want_loss)),
                      "step_s_median": secs["spmd"]},
             "mpmd": {"launches": 2 * run.num_stages * M, "transfers": moves.count, "transfer_bytes": moves.bytes,
                      **_mpmd_memory(run, placed, batch), "loss_diff": abs(float(loss_m) - float(want_loss)),
                      "step_s_median": secs["mpmd"]}}
    small = dict(vocab_size=16384, num_layers=3, d_model=256, seq_len=64)
    m2 = models.get("gpt", "debug", batch_size=8, **small)
    plan = autoshard.plan(m2.train_step, *m2.abstract_state(), mesh="auto", devices=8, hardware="h100-sxm")
    p2, b2 = m2.init(jax.random.key(0)), m2.batch()
    run2 = mpmd_from_plan(m2.loss, p2, b2, plan)
    placed2 = run2.place(p2)
    loss2, _ = run2(placed2, b2)
    want2, _ = jax.jit(jax.value_and_grad(m2.loss))(p2, b2)
    secs2 = _median_seconds({"mpmd": lambda: run2(placed2, b2)}, rounds)
    unequal = {"variant": plan.predicted["3d"]["chosen"]["label"], "runtime": plan.runtime,
               "submeshes": [list(map(int, s)) for s in plan.predicted["3d"]["chosen"]["submeshes"]],
               "devices_per_stage": [math.prod(mesh_.shape.values()) for mesh_ in run2.meshes],
               "loss_diff": abs(float(loss2) - float(want2)), "step_s_median": secs2["mpmd"]}
    return {"equal": equal, "unequal": unequal}


def markdown(part: dict, gpt: dict) -> list[str]:
    e, u = part["equal"], part["unequal"]
    s, p = e["spmd"], e["mpmd"]
    coll = ", ".join(f"{k} x{v['count']}" for k, v in s["collectives"].items()) or "none"
    cbytes = sum(v["bytes"] for v in s["collectives"].values()) / 2**20
    lines = ["", f"## MPMD vs SPMD runtime, same plan ({gpt}, {e['variant']}, {e['microbatches']} micro-batches)", "",
             "Gradients only (no optimizer); per step. SPMD: one compiled program; MPMD: a forward and a backward "
             "program per stage and micro-batch, cross-mesh `device_put`s between them.", "",
             "| runtime | program launches | collectives / transfers | MiB moved | temp (+ held residuals) MiB per "
             "device | loss diff | step s (median) |", "|---|---|---|---|---|---|---|",
             f"| SPMD | {s['launches']} | {coll} | {cbytes:.2f} | {s['temp_bytes'] / 2**20:.2f} | "
             f"{s['loss_diff']:.1e} | {s['step_s_median']:.3f} |",
             f"| MPMD | {p['launches']} | {p['transfers']} transfers | {p['transfer_bytes'] / 2**20:.2f} | "
             f"{p['peak_bytes'] / 2**20:.2f} (stage peak incl. params) | {p['loss_diff']:.1e} | "
             f"{p['step_s_median']:.3f} |", "",
             "MPMD per stage: " + "; ".join(f"stage {r['stage']}: temp {r['temp_bytes'] / 2**20:.2f} MiB, residuals "
                                           f"{r['residual_bytes'] / 2**20:.2f} MiB x {r['inflight']} in flight"
                                           for r in p["stages"]), "",
             f"Unequal plan (3-D search, 8 H100s, a 3-layer GPT): {u['variant']}; runtime {u['runtime']}, devices per "
             f"stage {u['devices_per_stage']}; loss diff vs one device {u['loss_diff']:.1e}; step "
             f"{u['step_s_median']:.3f} s (median)."]
    return lines
