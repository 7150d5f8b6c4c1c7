"""Pipeline and 3-D plans as the CLI prints them (pure: no jax): a stage table with units, the
comparison with the partitioner's baseline or the 3-D search's reference points, the tensor plan
inside 3-D stages grouped by block type, and the schedule's Gantt chart with its time scale."""

from __future__ import annotations

from typing import Any

from ..core.quantities import fmt_bytes, fmt_count, fmt_seconds, ranges
from ..plan.explain import equal_submeshes
from .tables import ParamRecord, bytes_per_device, full_param_lines, grouped_param_lines, mesh_text, table


def summary(plan: Any, full: bool = False) -> list[str]:
    if "3d" in plan.predicted:
        return [*_head_3d(plan), "", *_stage_table_3d(plan), "", *stage_param_lines(plan, full), "",
                *point_lines(plan), *_warnings(plan)]
    return [*_head_pipeline(plan), "", *_stage_table(plan), "", *_baseline_lines(plan), *_warnings(plan)]


def explanation(plan: Any, full: bool = False) -> list[str]:
    """Summary plus why: stage balance, where the bubble comes from, the comparisons in full."""
    if "3d" in plan.predicted:
        j = plan.predicted["3d"]
        why = [f"the 3-D search priced {j['points']} points (stages x data x model x remat x micro-batches x "
               f"schedule) over {j['units']} units in {fmt_seconds(j['search_seconds'])}, each by the event "
               "simulator; the chosen one has the shortest simulated step that fits the memory budget"]
        if not equal_submeshes(j):
            why.append("stages on unequal submeshes: runs MPMD (each stage its own program); best single-program "
                       f"(SPMD) alternative: {j.get('spmd_alternative', j.get('runnable_alternative'))}")
        return [*_head_3d(plan), "", *_stage_table_3d(plan), "", *why, "", *point_lines(plan), "",
                *stage_param_lines(plan, full), *_warnings(plan)]
    pp = plan.predicted["pipeline"]
    busiest = max(plan.stages, key=lambda s: s.predicted_forward + s.predicted_backward)
    why = [f"stage balance: the slowest stage ({busiest.index}) takes {pp['max_over_mean']:.2f}x the mean stage time; "
           f"the schedule's bubble is {pp['bubble_fraction']:.0%} of the step",
           f"micro-batches in flight per stage (activation memory): {', '.join(map(str, pp['peak_inflight']))}"]
    return [*_head_pipeline(plan), "", *_stage_table(plan), "", *why, "", *_baseline_lines(plan),
            *(["", *stage_param_lines(plan, True)] if full else []), *_warnings(plan)]


def _head_pipeline(plan: Any) -> list[str]:
    p, pp = plan.predicted, plan.predicted["pipeline"]
    used = f", {pp['devices_used']} of them used" if pp["devices_used"] != pp["devices"] else ""
    return [
        f"pipeline plan ({pp['method']}, {pp['schedule']} schedule, {pp['profile']} op costs) on mesh "
        f"{mesh_text(plan.mesh)} ({pp['devices']} devices{used}), hardware {plan.hardware}",
        f"{plural(len(plan.stages), 'stage')} (depth {pp['depth']}) x {plural(pp['pipelines'], 'pipeline copy')}, "
        f"{plural(plan.microbatches, 'micro-batch')} of batch {pp['batch_size']}; predicted step "
        f"{fmt_seconds(p['step_time'])} (simulated {fmt_seconds(pp['simulated_step_time'])}, bubble "
        f"{pp['bubble_fraction']:.0%}), {fmt_count(pp['batch_size'] / p['step_time'])} samples/s",
        f"peak memory per device {fmt_bytes(p['memory']['total'])} of {fmt_bytes(p['memory_budget'])}; search "
        f"{fmt_seconds(pp['search_seconds'])} over {pp['units']} {pp['unit']}",
    ]


def _stage_table(plan: Any) -> list[str]:
    pp = plan.predicted["pipeline"]
    dag = any(s.after != ((s.index - 1,) if s.index else ()) for s in plan.stages)
    unit = pp["unit"].split()[-1].rstrip("s")
    rows = [("stage", *(("after",) if dag else ()), unit, "ops", "replicas", "micro-batch", "forward", "backward",
             "memory", "modules")]
    for s in plan.stages:
        mods = ", ".join(s.modules[:3]) + (f", ... ({len(s.modules)})" if len(s.modules) > 3 else "")
        rows.append((str(s.index), *((",".join(map(str, s.after)) or "-",) if dag else ()),
                     ranges(list(s.units)) or "-", str(len(s.ops)), str(s.replicas),
                     f"{s.microbatch_size} x{s.microbatches}", fmt_seconds(s.predicted_forward),
                     fmt_seconds(s.predicted_backward), fmt_bytes(s.memory), mods or "-"))
    n = len(rows[0])
    return table(rows, align="l" * (n - 7) + "rrlrrrl")


def _baseline_lines(plan: Any) -> list[str]:
    p, pp = plan.predicted, plan.predicted["pipeline"]
    base, lines = pp.get("baseline"), []
    if base:
        ratio = base["step_time"] / p["step_time"]
        verdict = (f"this plan is {ratio:.2f}x faster" if ratio >= 1 else
                   f"the {base['name']} is {1 / ratio:.2f}x faster ({base['hint']})")
        lines.append(f"vs {base['name']} ({plural(base['stages'], 'stage')}, depth {base['depth']}, "
                     f"{plural(base['microbatches'], 'micro-batch')}): {fmt_seconds(base['step_time'])}; {verdict}")
    else:
        lines.append(f"vs {pp['baseline_name']}: none applies ({pp['baseline_reason']})")
    auto = pp.get("auto")
    if auto:
        steps = auto["simulated_step_time"]
        others = [f"{n} {fmt_seconds(t)}" for n, t in sorted(steps.items()) if n != auto["chosen"]]
        others += [f"{n} skipped: {why}" for n, why in sorted(auto["skipped"].items())]
        lines.append(f"pipeline='auto' chose {auto['chosen']} (simulated step {fmt_seconds(steps[auto['chosen']])})"
                     + (f" over {'; '.join(others)}" if others else ""))
    return lines


def _head_3d(plan: Any) -> list[str]:
    p, j = plan.predicted, plan.predicted["3d"]
    devices = 1
    for _, s in plan.mesh:
        devices *= s
    return [f"3-D plan on mesh {mesh_text(plan.mesh)} ({devices} devices), hardware {plan.hardware}: "
            f"{j['chosen']['label']}" + ("" if equal_submeshes(j) else " (stages on unequal submeshes: runs MPMD)"),
            f"predicted step {fmt_seconds(p['step_time'])}; peak memory per device {fmt_bytes(p['memory']['total'])} "
            f"of {fmt_bytes(p['memory_budget'])}; search {fmt_seconds(j['search_seconds'])} over {j['points']} "
            f"points, {j['units']} units"]


def _stage_table_3d(plan: Any) -> list[str]:
    labels = plan.predicted["3d"]["unit_labels"]
    rows = [("stage", "units", "submesh", "batch over", "storage", "remat", "forward", "backward", "memory")]
    for s in plan.stages:
        first, last = labels[s.units[0]], labels[s.units[-1]]
        rows.append((str(s.index), first if first == last else f"{first} .. {last} ({len(s.units)})",
                     mesh_text(s.mesh), "+".join(s.batch_axes) or "-", s.storage, s.remat,
                     fmt_seconds(s.predicted_forward), fmt_seconds(s.predicted_backward), fmt_bytes(s.memory)))
    return table(rows, align="llllllrrr")


def stage_param_lines(plan: Any, full: bool) -> list[str]:
    """The parameters of every stage with their specs on the stage's submesh, grouped by block type."""
    shapes = {r.keypath: (tuple(r.shape), r.dtype) for r in plan.params}
    records = []
    for s in plan.stages:
        specs = dict(s.param_specs)
        for k in s.params:
            shape, dtype = shapes.get(k, ((), "float32"))
            spec = specs.get(k, ())
            records.append(ParamRecord(k, shape, spec, bytes_per_device(shape, dtype, spec, dict(s.mesh)),
                                       (str(s.index),) if full else (), stage=s.index))
    if not records:
        return []
    head = "parameters per stage, specs on the stage's submesh" + ("" if full else " (by block type; --full: each)")
    lines = full_param_lines(records, ["stage"]) if full else grouped_param_lines(records, [])
    return [head, *lines]


def point_lines(plan: Any) -> list[str]:
    """The 3-D search's reference points against the chosen plan."""
    j, step = plan.predicted["3d"], plan.predicted["step_time"]
    out = ["vs (same cost model, same event simulator):"]
    for key, name in (("tensor_only", "best tensor-only"), ("pipeline_only", "best pipeline-only"),
                      ("megatron_grid", "best Megatron-LM grid point")):
        q = j.get(key)
        if q is None:
            fixed = j.get("fixed_shape")
            why = (j.get("megatron_grid_reason") if key == "megatron_grid" else
                   f"not of the mesh's fixed shape {fixed}" if fixed else "")
            out.append(f"  {name:<28} none ({why or 'none fits the memory budget'})")
            continue
        faster = (f"; the chosen plan is {q['step_time'] / step:.2f}x faster" if q["step_time"] > step * 1.0005
                  else "")
        out.append(f"  {name:<28} {fmt_seconds(q['step_time']):>9}  {fmt_bytes(q['memory']):>9}  {q['label']}{faster}")
    return out


def gantt_lines(sim: Any, width: int) -> list[str]:
    """The simulator's chart with its time scale in units (the chart's own header is unitless)."""
    durations = [t.end - t.start for t in sim.timings if t.end > t.start]
    if not durations or sim.makespan <= 0:
        return ["(empty timeline)"]
    unit = max(min(durations), sim.makespan / width)
    chart = sim.gantt(unit=unit, max_width=width).splitlines()[1:]
    return [f"schedule ({sim.schedule.name}): one column = {fmt_seconds(unit)}; makespan "
            f"{fmt_seconds(sim.makespan)}, bubble {sim.bubble_fraction:.0%}", *chart]


def plural(n: int, word: str) -> str:
    if n == 1:
        return f"1 {word}"
    return f"{n} {word[:-1] + 'ies' if word.endswith('y') else word + 'es' if word.endswith('ch') else word + 's'}"


def _warnings(plan: Any) -> list[str]:
    return ([""] if plan.warnings else []) + [f"warning: {w}" for w in plan.warnings]
