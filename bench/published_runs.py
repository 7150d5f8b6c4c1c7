"""Published, measured Megatron-LM runs priced at exactly their configuration (issue 30).

Every run of `../shared/published_runs.md` -- Narayanan et al., SC'21 (arXiv 2104.04473) Table 1, and
Korthikanti et al. 2022 (arXiv 2205.05198), 4 models x {full recompute, sequence parallel + selective
recompute} -- is planned through the public API with its shape fixed:

    autoshard.plan(step, *abstract_args, mesh={"pipe": PP, "data": DP, "model": TP}, hardware="a100-sxm",
                   pipeline="auto", schedule="1f1b" | "interleaved-1f1b", num_microbatches=M,
                   pipeline_options={"expert": "megatron", "remat": "full" | "selective", "virtual_stages": v},
                   search={"storage_modes": ("replicated",), "sequence_parallel": "off" | "on"},
                   memory_budget=<no limit>)

i.e. Megatron-LM's tensor plan (heads / FFN / vocabulary on `model`, batch on `data`), PP uniform
stages, M = GBS / (DP x MBS) micro-batches, 1F1B, full recompute, no ZeRO (Megatron of 2021 had no
distributed optimizer), fp16 compute (`dtype="float16"`; the GPU-style GPT keeps float32 master
parameters, the zoo GPT is float16 throughout), seq 2048, vocab 51200, batch GBS, traced abstractly.
The memory budget is lifted so the configuration is priced whatever the memory model says; the
predicted memory per device is reported beside the 80 GB of the A100s.

Every row is priced exactly as published (issue 31): interleaved 1F1B with its v virtual stages per
rank (`schedule="interleaved-1f1b"`, `virtual_stages=v`), and KORT's second setting as sequence
parallelism (`search={"sequence_parallel": "on"}`: Megatron-SP's plan) with selective recompute
(`remat="selective"`: the attention scores and softmax recomputed, everything else saved); the
full-recompute rows with sequence parallelism off.

Measured step: SC'21 gives TFLOP/s per GPU counted by its Eq. (3) (recomputed forward included),
F = 96 B s L h^2 (1 + s/(6h) + V/(16 L h)) with B = GBS, so step = F / (TFLOP/s x GPUs); KORT gives the
step seconds, and its TFLOP/s use its model FLOPs F = 72 B s L h^2 (1 + s/(6h) + V/(12 L h)).

The breakdown (compute, tensor-parallel comm, p2p sends, pipeline bubble, exposed gradient sync,
optimizer) is not in the Plan: it is recomputed from the 3-D search's own per-kind evaluators for the
planned stages (internal `autoshard._src.joint`), checked against the plan's per-stage forward +
backward, and the bubble is the remainder of the simulated step.

Dropout: Megatron-LM trained with attention and hidden dropout 0.1; our models have none, so
neither is priced. Hidden dropout runs in Megatron's fused bias-dropout-add kernel over [B, s, h]
(O(B s h) bytes per layer, well under 1 % of a layer's matmul time). Attention dropout in Megatron of
2021 is a separate kernel over the [B, a, s, s] probabilities: about 15 bytes per element per step
(fp16 read + write and a 1-byte mask, backward the same, forward twice under full recompute). Its
share of a layer falls with h^2 / (a s): the `attn dropout` column estimates it at the A100's HBM
bandwidth as a share of the measured step: 8 % for SC'21 1.7B, 6 % for 3.6B, 2-4 % from 7.5B to KORT 22B,
under 1.1 % from 310B on. So leaving dropout out understates the small rows' measured step by up to ~8 %.

    python bench/published_runs.py [--rows "SC21 1.7B,KORT 22B full"] [--model gpu|zoo|both] [--quick]
                                   [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autoshard  # noqa: E402
import models  # noqa: E402
from bench._common import git_state  # noqa: E402

HARDWARE = "a100-sxm"
SEQ, VOCAB = 2048, 51200
NO_LIMIT = 1e18                       # bytes: price the published shape whatever the memory model says
A100_MEMORY = 80e9
MODELS = {"gpu": "gpt-gpu", "zoo": "gpt"}


@dataclasses.dataclass(frozen=True)
class Run:
    """One published run. `tflops`: measured TFLOP/s per GPU (SC21, Eq. 3); `step`: measured seconds (KORT);
    `setting`: KORT's "full" (full recompute) or "sp+sel" (sequence parallel + selective recompute)."""

    source: str
    model: str
    layers: int
    hidden: int
    heads: int
    tp: int
    pp: int
    gpus: int
    gbs: int
    mbs: int
    v: int
    tflops: float | None = None
    step: float | None = None
    setting: str = "full"

    @property
    def name(self) -> str:
        return f"{self.source} {self.model}" + (f" {self.setting}" if self.source == "KORT" else "")

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def microbatches(self) -> int:
        return self.gbs // (self.dp * self.mbs)

    @property
    def unsupported(self) -> list[str]:
        """What of the published configuration the planner cannot express (nothing since issue 31)."""
        return []


def _sc21(model, layers, hidden, heads, tp, pp, gpus, gbs, mbs, v, tflops) -> Run:
    return Run("SC21", model, layers, hidden, heads, tp, pp, gpus, gbs, mbs, v, tflops=tflops)


def _kort(model, layers, hidden, heads, tp, pp, gpus, gbs, mbs, v, full, sp) -> list[Run]:
    return [Run("KORT", model, layers, hidden, heads, tp, pp, gpus, gbs, mbs, v, step=s, setting=k)
            for k, s in (("full", full), ("sp+sel", sp))]


# ../shared/published_runs.md (SC21 Table 1; Korthikanti et al. 2022, data-parallel size 1)
RUNS = [
    _sc21("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137),
    _sc21("3.6B", 30, 3072, 32, 2, 1, 64, 512, 16, 1, 138),
    _sc21("7.5B", 36, 4096, 32, 4, 1, 128, 512, 16, 1, 142),
    _sc21("18.4B", 40, 6144, 48, 8, 1, 256, 1024, 8, 1, 135),
    _sc21("39.1B", 48, 8192, 64, 8, 2, 512, 1536, 4, 1, 138),
    _sc21("76.1B", 60, 10240, 80, 8, 4, 1024, 1792, 2, 3, 140),
    _sc21("145.6B", 80, 12288, 96, 8, 8, 1536, 2304, 2, 2, 148),
    _sc21("310.1B", 96, 16384, 128, 8, 16, 1920, 2160, 1, 2, 155),
    _sc21("529.6B", 105, 20480, 128, 8, 35, 2520, 2520, 1, 3, 163),
    _sc21("1008B", 128, 25600, 160, 8, 64, 3072, 3072, 1, 1, 163),
    *_kort("22B", 48, 6144, 64, 8, 1, 8, 4, 4, 1, 1.42, 1.10),
    *_kort("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 3, 18.13, 13.75),
    *_kort("530B", 105, 20480, 128, 8, 35, 280, 280, 1, 3, 49.05, 37.83),
    *_kort("1T", 128, 25600, 160, 8, 64, 512, 512, 1, 1, 94.42, 71.49),
]
QUICK = ("SC21 1.7B", "SC21 3.6B", "SC21 7.5B")


def flops(run: Run) -> float:
    """FLOPs per step as the source counts them: SC21 Eq. (3) (recompute included), KORT model FLOPs."""
    B, s, L, h, V = run.gbs, SEQ, run.layers, run.hidden, VOCAB
    if run.source == "SC21":
        return 96.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return 72.0 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))


def measured_step(run: Run) -> float:
    return run.step if run.step is not None else flops(run) / (run.tflops * 1e12 * run.gpus)


def attention_dropout_seconds(run: Run, bandwidth: float) -> float:
    """Unpriced attention dropout per device per step: ~15 bytes per [B, a, s, s] element (see the
    module docstring) over the stage's layers and the step's micro-batches, at HBM bandwidth."""
    elements = run.microbatches * (run.layers / run.pp) * run.mbs * (run.heads / run.tp) * SEQ * SEQ
    return 15.0 * elements / bandwidth


def plan_kwargs(run: Run) -> dict:
    """The run's published configuration as plan arguments: its mesh, M, schedule (interleaved with v
    virtual stages when v > 1), Megatron's tensor plan, full recompute without sequence parallelism or
    (KORT's second setting) sequence parallelism with selective recompute, no ZeRO, no memory limit."""
    sp_sel = run.setting == "sp+sel"
    options = {"expert": "megatron", "remat": "selective" if sp_sel else "full"}
    if run.v > 1:
        options["virtual_stages"] = run.v
    return dict(mesh={"pipe": run.pp, "data": run.dp, "model": run.tp}, hardware=HARDWARE, pipeline="auto",
                schedule="interleaved-1f1b" if run.v > 1 else "1f1b", num_microbatches=run.microbatches,
                pipeline_options=options,
                search={"storage_modes": ("replicated",), "sequence_parallel": "on" if sp_sel else "off"},
                memory_budget=NO_LIMIT)


def build_model(run: Run, which: str) -> models.Model:
    return models.get(MODELS[which], "debug", num_layers=run.layers, d_model=run.hidden, num_heads=run.heads,
                      seq_len=SEQ, vocab_size=VOCAB, batch_size=run.gbs, dtype="float16")


# --- the predicted step's terms (internal: the 3-D search's per-kind evaluators) ---------------------

def _kind_costs(srch, space, row, storage: str) -> list[dict[str, float]]:
    """Per unit kind, at the traced batch per device: the cost parts the 3-D tables sum into fwd / bwd /
    const / sync / step (joint/tables.py), kept apart. `space`: the submesh's plain or sequence-parallel space."""
    from autoshard._src.joint.tables import _evaluators

    out = []
    for kind in srch.units.kinds:
        evs = _evaluators(space, srch.hw, srch.cost(space.mesh), srch.options, kind)
        r = {n: {k: float(v[0]) for k, v in evs[n].evaluate(row[None], storage).items() if v.ndim == 1}
             for n in ("fwd", "fwd_dots", "fwd_attn", "bwd", "const", "step", "held")}
        comm = lambda d: d["fwd_comm"] + d["bwd_comm"]  # noqa: E731
        out.append({"fwd_compute": r["fwd"]["compute"], "fwd_dots": r["fwd_dots"]["compute"],
                    "fwd_comm": comm(r["fwd"]), "attn_compute": r["fwd_attn"]["compute"],
                    "attn_comm": r["fwd_attn"]["fwd_comm"],
                    "bwd_compute": r["bwd"]["compute"], "bwd_comm": comm(r["bwd"]),
                    "const_compute": r["const"]["compute"], "const_comm": comm(r["const"]),
                    "const_sync": r["const"]["grad_sync"], "sync": r["bwd"]["grad_sync"],
                    "gather": r["held"]["storage_comm"] if storage == "zero3" else 0.0,
                    "step": r["step"]["compute"] + r["step"]["opt_comm"] + comm(r["step"])
                    + (0.0 if storage == "zero3" else r["held"]["storage_comm"])})
    return out


def _stage_terms(srch, kinds: list[dict], start: int, stop: int, M: int, sends, remat: str) -> dict[str, float]:
    """One stage's seconds per micro-batch (compute, tp comm, p2p, per-micro-batch sync) and per step
    (exposed gradient sync, optimizer) under `remat` ("full": the forward again in the backward,
    "selective": the attention scores / softmax again), as joint/stage_choice.py composes them."""
    U, (send_f, send_b) = len(srch.units), sends
    tot = {k: sum(kinds[srch.units.kind_of[u]][k] for u in range(start, stop)) for k in kinds[0]}
    phi = 1.0 / M
    again = ((tot["fwd_compute"], tot["fwd_comm"]) if remat == "full" else
             (tot["attn_compute"], tot["attn_comm"]) if remat == "selective" else (0.0, 0.0))
    compute = phi * (tot["fwd_compute"] + again[0] + tot["bwd_compute"]) + tot["const_compute"]
    tp = phi * (tot["fwd_comm"] + again[1] + tot["bwd_comm"]) + tot["const_comm"]
    p2p = (float(send_f[stop]) if stop < U else 0.0) + (float(send_b[start]) if start > 0 else 0.0)
    bwd = phi * (tot["bwd_compute"] + tot["bwd_comm"])
    exposed = max(0.0, tot["sync"] - srch.options.overlap * bwd)
    return {"compute": compute, "tp_comm": tp, "p2p": p2p, "mb_sync": tot["const_sync"],
            "gather": tot["gather"], "exposed_sync": exposed, "optimizer": tot["step"],
            "per_microbatch": compute + tp + p2p + tot["const_sync"] + tot["gather"],
            "fwd_matmul_share": tot["fwd_dots"] / tot["fwd_compute"] if tot["fwd_compute"] else 0.0,
            "bwd_over_fwd": tot["bwd_compute"] / tot["fwd_compute"] if tot["fwd_compute"] else 0.0}


def _per_rank(stages: list[dict], ranks: int) -> list[dict]:
    """Interleaved stages summed per rank (stage k on rank k % ranks); unchanged when one per rank."""
    ratios = ("fwd_matmul_share", "bwd_over_fwd")      # shares: averaged over a rank's stages, not summed
    return [{k: (sum(st[k] for st in stages[r::ranks]) / (1 if k not in ratios else len(stages[r::ranks])))
             for k in stages[0]} for r in range(ranks)]


def step_terms(model: models.Model, run: Run, plan) -> dict:
    """The plan's predicted step split into its terms for the slowest rank, plus a consistency check
    against the plan's own per-stage forward + backward."""
    from autoshard._src.bridge.api import hardware_of
    from autoshard._src.core.cost import AnalyticalCostModel
    from autoshard._src.joint.space import SearchState
    from autoshard._src.plan.joint_planner import fixed_shape_options

    kw = plan_kwargs(run)
    cfg = autoshard.Config.make(**kw)
    hw, M = hardware_of(cfg), run.microbatches
    graph = autoshard.trace(model.train_step, *model.abstract_state())
    joint = fixed_shape_options(cfg.mesh, kw["schedule"], M, cfg.pipeline_options)
    srch = SearchState(graph, autoshard.group(graph), run.gpus, hw, cfg.search, joint,
                       lambda mesh: AnalyticalCostModel(mesh, hw))
    tables = srch.table(run.dp, run.tp)
    sp = run.setting == "sp+sel"
    row = tables.megatron_sp if sp else tables.megatron
    if isinstance(row, str):
        return {"error": f"no Megatron row: {row}"}
    kinds = _kind_costs(srch, tables.space_of(sp), row, "replicated")
    sends = srch.sends(run.dp, M, run.dp * run.tp, run.tp)
    chosen = plan.predicted["3d"]["chosen"]
    bounds = [0]
    for n in chosen["units_per_stage"]:
        bounds.append(bounds[-1] + n)
    remat = cfg.pipeline_options["remat"]
    stages = [_stage_terms(srch, kinds, i, j, M, sends, remat) for i, j in zip(bounds[:-1], bounds[1:], strict=True)]
    step = chosen["step_time"]
    if len(stages) == 1:     # a one-stage point is built as a tensor plan: its stage times hold the tail too
        slow = stages[0]
        mismatch = abs(M * slow["per_microbatch"] + slow["exposed_sync"] + slow["optimizer"] - step) / step
    else:
        planned = [s.predicted_forward + s.predicted_backward for s in plan.stages]
        mismatch = max(abs(a["per_microbatch"] - b) / b for a, b in zip(stages, planned, strict=True))
    ranks = _per_rank(stages, len(stages) // run.v)
    slow = max(ranks, key=lambda s: s["per_microbatch"])
    tail = max(ranks, key=lambda s: s["exposed_sync"] + s["optimizer"])
    terms = {"compute": M * slow["compute"], "tp comm": M * slow["tp_comm"], "p2p sends": M * slow["p2p"],
             "grad sync": M * slow["mb_sync"] + tail["exposed_sync"], "zero-3 gather": M * slow["gather"],
             "optimizer": tail["optimizer"]}
    terms["bubble"] = step - M * slow["per_microbatch"] - tail["exposed_sync"] - tail["optimizer"]
    # how much of the slowest stage's forward compute is matmuls (the rest: elementwise, softmax, norms)
    return {"terms": terms, "consistency": mismatch, "stages": len(stages),
            "fwd_matmul_share": slow["fwd_matmul_share"], "bwd_over_fwd_compute": slow["bwd_over_fwd"]}


# --- rows, table, files ------------------------------------------------------------------------------

def price(run: Run, which: str) -> dict:
    """Plan `run` at its published shape with model `which` ("gpu" / "zoo"); predicted vs measured."""
    m = build_model(run, which)
    t0 = time.perf_counter()
    plan = autoshard.plan(m.train_step, *m.abstract_state(), **plan_kwargs(run))
    plan_s = time.perf_counter() - t0
    chosen = plan.predicted["3d"]["chosen"]
    t1 = time.perf_counter()
    try:
        terms = step_terms(m, run, plan)
    except Exception as e:          # internals move under other engineers: report, keep the row
        terms = {"error": f"{type(e).__name__}: {e}"}
    predicted, measured = chosen["step_time"], measured_step(run)
    f = flops(run)
    bandwidth = autoshard.get_hardware(HARDWARE).memory_bandwidth
    del plan
    gc.collect()
    published = dataclasses.asdict(run)
    published["size"] = published.pop("model")
    return {"row": run.name, "model": MODELS[which], **published, "dp": run.dp,
            "microbatches": run.microbatches, "expressible": not run.unsupported, "not_expressed": run.unsupported,
            "priced": chosen["label"] + f", M {chosen['microbatches']}, {chosen['schedule']}, remat "
                      f"{'/'.join(chosen['remat'])}, {'/'.join(chosen['storage'])}, fp16",
            "predicted_s": predicted, "measured_s": measured, "measured_over_predicted": measured / predicted,
            "flops_counted": "SC21 Eq. (3)" if run.source == "SC21" else "KORT model FLOPs",
            "predicted_tflops": f / (predicted * run.gpus) / 1e12, "measured_tflops": f / (measured * run.gpus) / 1e12,
            "memory_gib": chosen["memory"] / 2**30, "fits_80gb": chosen["memory"] <= A100_MEMORY,
            "attention_dropout_share": attention_dropout_seconds(run, bandwidth) / measured,
            "breakdown": terms, "plan_s": plan_s, "breakdown_s": time.perf_counter() - t1}


def dominant(r: dict, n: int = 3) -> str:
    terms = r["breakdown"].get("terms")
    if not terms:
        return r["breakdown"].get("error", "-")
    top = sorted(terms.items(), key=lambda kv: -kv[1])[:n]
    text = ", ".join(f"{k} {v:.3g} s ({v / r['predicted_s']:.0%})" for k, v in top if v > 0)
    bd = r["breakdown"]
    text += f"; fwd {bd['fwd_matmul_share']:.0%} matmul, bwd/fwd compute {bd['bwd_over_fwd_compute']:.1f}"
    off = r["breakdown"]["consistency"]
    return text + (f" (terms off the plan's stage times by {off:.1%})" if off > 0.01 else "")


def summary(rows: list[dict], model: str) -> str:
    errs = [abs(r["measured_over_predicted"] - 1) for r in rows if r["model"] == model and r["expressible"]]
    if not errs:
        return f"{model}: no expressible rows priced"
    return (f"{model}: on {len(errs)} expressible rows |measured/predicted - 1| min {min(errs):.1%}, "
            f"max {max(errs):.1%}, mean {sum(errs) / len(errs):.1%} (acceptance: each <= 15 %, mean <= 8 %)")


def markdown(rows: list[dict], meta: dict) -> str:
    lines = ["# Published Megatron-LM runs priced at their configuration (bench/published_runs.py)", "",
             f"Predicted by autoshard's model on `{HARDWARE}` (commit {meta['git'].get('commit')}); measured by the "
             "papers' authors (`../shared/published_runs.md`). TFLOP/s per GPU: SC21 rows count Eq. (3) "
             "(recompute included), KORT rows model FLOPs. Terms are the slowest stage's over the step. "
             "Not priced: dropout (see the script's docstring; `attn dropout` = its estimated share of the "
             "measured step).", "",
             "| row | model | TP/PP/DP/MBS/M/v | priced | predicted s | measured s | measured/predicted | "
             "pred TFLOP/s | meas TFLOP/s | dominant terms | memory GiB | attn dropout | plan s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = f"{r['tp']}/{r['pp']}/{r['dp']}/{r['mbs']}/{r['microbatches']}/{r['v']}"
        missing = "; ".join(r["not_expressed"])
        priced = r["priced"] + ("" if r["expressible"] else f"; **not expressible yet**: {missing}")
        mem = f"{r['memory_gib']:.0f}" + ("" if r["fits_80gb"] else " (> 80 GB)")
        lines.append(f"| {r['row']} | {r['model']} | {shape} | {priced} | {r['predicted_s']:.3g} | "
                     f"{r['measured_s']:.3g} | {r['measured_over_predicted']:.3f} | {r['predicted_tflops']:.1f} | "
                     f"{r['measured_tflops']:.1f} | {dominant(r)} | {mem} | {r['attention_dropout_share']:.1%} | "
                     f"{r['plan_s']:.1f} |")
    lines += [""] + [f"- {summary(rows, m)}" for m in dict.fromkeys(r["model"] for r in rows)]
    return "\n".join(lines) + "\n"


def select(names: str | None, quick: bool) -> list[Run]:
    if names is None:
        return [r for r in RUNS if r.name in QUICK] if quick else list(RUNS)
    wanted = [n.strip().lower() for n in names.split(",") if n.strip()]
    known = {r.name.lower(): r for r in RUNS}
    missing = [n for n in wanted if n not in known]
    if missing:
        raise SystemExit(f"unknown rows {missing}; valid: {[r.name for r in RUNS]}")
    return [known[n] for n in wanted]


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", help="comma-separated row names, e.g. 'SC21 1.7B,KORT 22B full'")
    ap.add_argument("--model", choices=("gpu", "zoo", "both"), default="both")
    ap.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    ap.add_argument("--out-dir", default=str(ROOT / "bench/results"))
    a = ap.parse_args(argv)
    meta = {"git": git_state(), "hardware": HARDWARE}
    rows: list[dict] = []
    for run in select(a.rows, a.quick):
        for which in (("gpu", "zoo") if a.model == "both" else (a.model,)):
            t0 = time.perf_counter()
            r = price(run, which)
            rows.append(r)
            print(f"{r['row']:>16} {r['model']:>7}: predicted {r['predicted_s']:.3g} s, "
                  f"measured {r['measured_s']:.3g} s, "
                  f"ratio {r['measured_over_predicted']:.3f}; {dominant(r)}; plan {r['plan_s']:.1f} s, "
                  f"row {time.perf_counter() - t0:.1f} s", flush=True)
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(rows, meta)
    (out / "published_runs.md").write_text(text)
    (out / "published_runs.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    print(text)
    return rows


if __name__ == "__main__":
    main()
