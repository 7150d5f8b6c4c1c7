"""What the CLI prints about a plan (pure: no jax). `summary` answers "what did it choose" in one
screen; `explanation` answers "why": every logical dim and where it went, and each expert plan's
cost next to the chosen one, term by term. Pipeline and 3-D plans are drawn by `stages`."""

from __future__ import annotations

from typing import Any

from ..core.collectives import lowered_differently
from ..core.quantities import fmt_bytes, fmt_seconds
from .stages import explanation as stage_explanation
from .stages import point_lines
from .stages import summary as stage_summary
from .tables import (
    ParamRecord,
    bytes_per_device,
    friendly,
    full_param_lines,
    group_params,
    grouped_param_lines,
    merge_paths,
    mesh_text,
    split_block,
    table,
)

_TERMS = {"compute": "compute", "fwd_comm": "forward comm", "bwd_comm": "backward comm",
          "opt_comm": "optimizer comm", "grad_sync": "gradient sync", "storage_comm": "ZeRO gathers"}
_STORAGE = {"replicated": "no ZeRO: parameters and optimizer state split only by their specs",
            "zero1": "ZeRO-1: optimizer state also split over the batch axes",
            "zero3": "ZeRO-3: parameters and optimizer state also split over the batch axes"}
_MEMORY = (("params", "parameters"), ("optimizer", "optimizer state"), ("grads", "gradients"),
           ("activations", "activations"), ("data", "batch"))


def summary(plan: Any, full: bool = False) -> list[str]:
    """The plan at a glance: cost, what each mesh axis splits, collectives, parameters by block type."""
    if plan.is_pipeline:
        return stage_summary(plan, full)
    lines = [*header(plan), "", *axes_lines(plan), ""]
    lines += collective_lines(plan)
    lines += ["", *param_lines(plan, full)]
    lines += ["", *expert_summary(plan)]
    return lines + warning_lines(plan)


def explanation(plan: Any, full: bool = False) -> list[str]:
    """Why this plan: every logical dim's mesh axes, and the expert plans priced term by term."""
    if plan.is_pipeline:
        return stage_explanation(plan, full)
    lines = [*header(plan), "", *axes_lines(plan), "", *factor_lines(plan), "", *expert_table(plan)]
    if "3d" in plan.predicted:
        lines += ["", *point_lines(plan)]
    if full:
        lines += ["", *param_lines(plan, full=True)]
    return lines + warning_lines(plan)


def header(plan: Any) -> list[str]:
    p = plan.predicted
    devices = 1
    for _, s in plan.mesh:
        devices *= s
    return [f"tensor plan on mesh {mesh_text(plan.mesh)} ({devices} devices), hardware {plan.hardware}; storage "
            f"{plan.storage} ({_STORAGE.get(plan.storage, plan.storage)})",
            step_line(p["step_time"], p["breakdown"]),
            memory_line(p["memory"], p["memory_budget"])]


def step_line(step: float, breakdown: dict) -> str:
    terms = [f"{name} {fmt_seconds(breakdown[k])}" + (" (overlapped with backward)" if k == "grad_sync" else "")
             for k, name in _TERMS.items() if breakdown.get(k, 0) > 0]
    return f"predicted step {fmt_seconds(step)}" + (f": {', '.join(terms)}" if terms else "")


def memory_line(memory: dict, budget: float) -> str:
    parts = [f"{name} {fmt_bytes(memory[k])}" for k, name in _MEMORY if memory.get(k)]
    return (f"memory per device {fmt_bytes(memory['total'])} of {fmt_bytes(budget)}"
            + (f": {', '.join(parts)}" if parts else ""))


def axes_lines(plan: Any) -> list[str]:
    """Per mesh axis, what it splits: inputs by their logical dim, parameters by block type. The
    names are labels the planner ignores, so this is where a reader checks they read right."""
    n_args = len({k.split("]")[0] for k in plan.input_keypaths})
    carried: dict[str, list[str]] = {name: [] for name, _ in plan.mesh}
    for _, desc, size, axes in plan.factors:
        path, _, dim = desc.partition(" dim ")
        where = friendly(path, n_args)
        if not where.startswith("params"):
            text = (f"the batch ({where} dim 0, {size} samples)" if where.startswith("batch") and dim == "0"
                    else f"{where} dim {dim} ({size})")
            for a in axes:
                carried.setdefault(a, []).append(text)
    split: dict[str, dict[str, list[tuple[str, ...]]]] = {}     # axis -> block -> [(*path, "dim d")]
    for r in plan.params:
        block, _, rest = split_block(r.keypath)
        for d, axes in enumerate(r.spec):
            for a in axes:
                paths = split.setdefault(a, {}).setdefault(block, [])
                if (*rest, f"dim {d}") not in paths:
                    paths.append((*rest, f"dim {d}"))
    dims = {a: {b: [t.replace(".dim ", " dim ") for t, _ in merge_paths(ps, [None] * len(ps))]
                for b, ps in blocks.items()} for a, blocks in split.items()}
    rows = [("axis", "splits")]
    for name, size in plan.mesh:
        items = carried.get(name, []) + [f"{block or 'outside blocks'}: {', '.join(ds[:4])}"
                                         + (f" +{len(ds) - 4}" if len(ds) > 4 else "")
                                         for block, ds in dims.get(name, {}).items()]
        shown = items[:3] + ([f"+{len(items) - 3} more (autoshard explain)"] if len(items) > 3 else [])
        rows.append((f"{name}={size}", "; ".join(shown) or "nothing: the devices along it repeat the same work"))
    return ["what each mesh axis splits (axis names are labels: the planner decides):", *table(rows)[2:]]


def factor_lines(plan: Any) -> list[str]:
    """Every logical dim (factor) of the step and its mesh axes, the split ones first."""
    n_args = len({k.split("]")[0] for k in plan.input_keypaths})
    factors = sorted(plan.factors, key=lambda f: (not f[3], f[0]))
    rows = [("logical dim (one parameter or input that carries it)", "size", "mesh axes")]
    for _, desc, size, axes in factors:
        path, _, dim = desc.partition(" dim ")
        rows.append((f"{friendly(path, n_args)} dim {dim}", str(size), "+".join(axes) if axes else "replicated"))
    return ["logical dims -> mesh axes (each dim stands for every tensor dim the step ties to it):",
            *table(rows, align="lrl")]


def collective_lines(plan: Any) -> list[str]:
    coll = plan.predicted.get("collectives") or []
    if not coll:
        return ["predicted collectives: none (every device works alone)"]
    rows = [("collective", "over", "phase", "count", "bytes per device", "on XLA:CPU")]
    for c in coll:
        cpu = lowered_differently(c, "cpu", dict(plan.mesh))
        rows.append((c["kind"], ",".join(c["axes"]), c["phase"], f"x{c['count']:g}", fmt_bytes(c["bytes"]),
                     " + ".join(f"{k}@{','.join(a)}" for k, a in cpu) if cpu else "same"))
    return ["predicted collectives per step:", *table(rows, align="lllrrl")]


def param_records(plan: Any) -> list[ParamRecord]:
    return [ParamRecord(r.keypath, tuple(r.shape), r.spec, r.bytes_per_device, (r.grad_sync,)) for r in plan.params]


def param_lines(plan: Any, full: bool) -> list[str]:
    records = param_records(plan)
    total = sum(r.per_device for r in records)
    whole = sum(bytes_per_device(r.shape, r.dtype, (), {}) for r in plan.params)
    head = (f"parameters: {len(records)} tensors, {fmt_bytes(total)} per device of {fmt_bytes(whole)}"
            + ("" if full else f"; by block type ({_blocks(records)}), --full for one row per parameter"))
    lines = full_param_lines(records, ["gradient sync"]) if full else grouped_param_lines(records, ["gradient sync"])
    return [head, *lines]


def _blocks(records: list[ParamRecord]) -> str:
    _, instances = group_params(records)
    named = [f"{b} x{len(i)}" for b, i in instances.items() if b]
    return ", ".join(named[:3]) + (f", +{len(named) - 3}" if len(named) > 3 else "") if named else "no repeated blocks"


def expert_summary(plan: Any) -> list[str]:
    """One line: the best applicable expert plan against the chosen one."""
    experts = plan.predicted.get("experts") or {}
    if not experts:
        return []
    t = plan.predicted["step_time"]
    priced = {n: e for n, e in experts.items() if "reason" not in e}
    skipped = sorted(n for n in experts if n not in priced)
    fits = {n: e for n, e in priced.items() if e["feasible"]}
    if fits:
        name, e = min(fits.items(), key=lambda kv: kv[1]["step_time"])
        ratio = e["step_time"] / t
        verdict = (f"the chosen plan is {ratio:.2f}x faster" if ratio > 1.0005 else "it ties with the chosen plan")
        text = f"best expert plan: {name} {fmt_seconds(e['step_time'])}; {verdict}"
    else:
        text = "no expert plan fits" if priced else "no expert plan applies"
    if skipped:
        text += f" ({', '.join(skipped)}: not applicable)"
    return [text + ". Why: autoshard explain"]


def expert_table(plan: Any) -> list[str]:
    """Each expert's cost term by term next to the chosen plan, and why it loses (or cannot apply)."""
    p = plan.predicted
    experts = p.get("experts") or {}
    terms = [k for k in _TERMS if p["breakdown"].get(k) or any(e.get("breakdown", {}).get(k) for e in experts.values())]
    rows = [("plan", "step", *(_TERMS[k] for k in terms), "memory/device", "verdict")]
    rows.append(("chosen", fmt_seconds(p["step_time"]), *(fmt_seconds(p["breakdown"][k]) for k in terms),
                 fmt_bytes(p["memory"]["total"]), ""))
    notes = []
    for name, e in experts.items():
        if "reason" in e:
            notes.append(f"  {name}: not applicable: {e['reason']}")
            continue
        rows.append((name, fmt_seconds(e["step_time"]), *(fmt_seconds(e["breakdown"][k]) for k in terms),
                     fmt_bytes(e["memory"]), _verdict(e, p)))
    return ["vs the expert plans (same cost model):", *table(rows, align="lr" + "r" * len(terms) + "rl"), *notes]


def _verdict(e: dict, p: dict) -> str:
    if not e["feasible"]:
        return f"exceeds the {fmt_bytes(p['memory_budget'])} budget"
    t = p["step_time"]
    if e["step_time"] <= t * 1.0005:
        return "ties with the chosen plan"
    diffs = {k: e["breakdown"][k] - p["breakdown"][k] for k in _TERMS if k in e["breakdown"]}
    k = max(diffs, key=diffs.get)
    return (f"{e['step_time'] / t:.2f}x slower: {_TERMS[k]} {fmt_seconds(e['breakdown'][k])} "
            f"vs {fmt_seconds(p['breakdown'][k])}")


def warning_lines(plan: Any) -> list[str]:
    return ([""] if plan.warnings else []) + [f"warning: {w}" for w in plan.warnings]
