"""Plan reports: the text of `Plan.explain()` for tensor and pipeline plans (pure: no jax import)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.collectives import lowered_differently
from ..core.quantities import fmt_bytes
from .specs import spec_str


def _span(units: tuple[int, ...]) -> str:
    if not units:
        return "-"
    if list(units) == list(range(units[0], units[-1] + 1)):
        return f"{units[0]}-{units[-1]}" if len(units) > 1 else str(units[0])
    return f"{len(units)} ({units[0]}..{units[-1]})"


def _uneven_dims(factors: Any, mesh: Any) -> list[str]:
    """One line per unsplit dim that some mesh axis does not divide: the axis, and the work padding
    it to the next multiple would add (jax cannot shard a step argument unevenly; this plan leaves it
    whole on that axis instead, each device computing it in full)."""
    out = []
    for _, desc, size, axes in factors:
        if axes or size < 2:
            continue
        for name, n in mesh:
            if n > 1 and size % n and size >= n:
                padded = -(-size // n) * n
                out.append(f"  {desc} (size {size}) over {name} ({n}): padding to {padded} would add "
                           f"{(padded - size) / size:.1%} work; left whole on {name}, its work repeats on each "
                           f"of the {n} devices")
    return out


def explain_tensor(self: Any) -> str:
    """Tensor plan report: factors -> axes, predicted collectives, per-parameter specs, vs experts."""
    p = self.predicted
    lines = [
        f"autoshard plan on mesh {' x '.join(f'{n}={s}' for n, s in self.mesh)}, "
        f"hardware {self.hardware}, storage {self.storage}",
        f"predicted step {p['step_time'] * 1e3:.3f} ms "
        f"(compute {p['breakdown']['compute'] * 1e3:.3f} ms, forward comm "
        f"{p['breakdown']['fwd_comm'] * 1e3:.3f} ms, backward comm {p['breakdown']['bwd_comm'] * 1e3:.3f} ms, "
        f"grad sync {p['breakdown']['grad_sync'] * 1e3:.3f} ms (overlapped), storage comm "
        f"{p['breakdown']['storage_comm'] * 1e3:.3f} ms); memory "
        f"{fmt_bytes(p['memory']['total'])} per device of {fmt_bytes(p['memory_budget'])}",
        *([f"searched {p['plans_evaluated']:,} plans in {p['search_seconds']:.3f} s"]
          if "plans_evaluated" in p and "search_seconds" in p else []),
        *([f"{p['axis_hint']}"] if p.get("axis_hint") else []),
        *_remat_lines(self),
        "",
        "logical dims (factors) -> mesh axes:",
    ]
    for _, desc, size, axes in self.factors:
        lines.append(f"  {desc:<40} size {size:<8} -> {', '.join(axes) if axes else 'replicated'}")
    uneven = _uneven_dims(self.factors, self.mesh)
    if uneven:
        lines.append("dims the search could not split (a dim splits only over axes whose size divides it):")
        lines.extend(uneven)
    lines.append("")
    if p.get("collectives"):
        lines.append("predicted collectives per step (per-device buffer bytes):")
        for c in p["collectives"]:
            cpu = lowered_differently(c, "cpu", dict(self.mesh))
            on_cpu = "  (XLA:CPU: " + " + ".join(f"{k} over {','.join(a)}" for k, a in cpu) + ")" if cpu else ""
            lines.append(f"  {c['kind']:<15} over {','.join(c['axes']):<12} {c['phase']:<9} "
                         f"x{c['count']:<6g} {c['bytes']:>16,.0f} B{on_cpu}")
        lines.append("")
    rows = [("parameter", "shape", "spec", "bytes/device", "gradient sync")]
    for r in self.params:
        rows.append((r.keypath, "x".join(map(str, r.shape)) or "scalar", spec_str(r.spec),
                     f"{r.bytes_per_device:,}", r.grad_sync))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for k, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    if "experts" in p:
        lines.append("")
        lines.append("vs expert plans (same cost model):")
        lines.extend(_expert_lines(p))
    if "3d" in p:
        lines.extend(explain_3d_comparison(self))
    for w in self.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def explain_pipeline(self: Any) -> str:
    """Pipeline plan report: stage table, simulated step, vs the partitioner's baseline."""
    p, pp = self.predicted, self.predicted["pipeline"]
    unit = pp["unit"]
    lines = [
        f"autoshard pipeline plan ({pp['method']}, {pp['schedule']} schedule, profile {pp['profile']}) on "
        f"{pp['devices']} devices (mesh {' x '.join(f'{n}={s}' for n, s in self.mesh)}), hardware {self.hardware}"
        + (f", {pp['devices_used']} of them used" if pp["devices_used"] != pp["devices"] else ""),
        f"{len(self.stages)} stages (depth {pp['depth']}) x {pp['pipelines']} pipeline copies, "
        f"{self.microbatches} micro-batches of batch {pp['batch_size']}; predicted step "
        f"{p['step_time'] * 1e3:.3f} ms, throughput {pp['batch_size'] / p['step_time']:.4g} samples/s, "
        f"max/mean stage time {pp['max_over_mean']:.3f}; peak memory {fmt_bytes(p['memory']['total'])} "
        f"per device of {fmt_bytes(p['memory_budget'])}",
        f"search {pp['search_seconds']:.3f} s over {pp['units']} {unit}; event simulator: step "
        f"{pp['simulated_step_time'] * 1e3:.3f} ms, bubble {pp['bubble_fraction']:.1%}, in flight per stage "
        f"{list(pp['peak_inflight'])}",
        "",
    ]
    dag = any(s.after != ((s.index - 1,) if s.index else ()) for s in self.stages)
    rows = [("stage", *(("after",) if dag else ()), unit.split()[-1].rstrip("s"), "ops", "replicas", "micro-batch",
             "forward ms", "backward ms", "memory GiB", "modules")]
    for s in self.stages:
        mods = ", ".join(s.modules[:3]) + (f", ... ({len(s.modules)})" if len(s.modules) > 3 else "")
        rows.append((str(s.index), *((",".join(map(str, s.after)) or "-",) if dag else ()), _span(s.units),
                     str(len(s.ops)), str(s.replicas), f"{s.microbatch_size} x{s.microbatches}",
                     f"{s.predicted_forward * 1e3:.3f}", f"{s.predicted_backward * 1e3:.3f}",
                     f"{s.memory / 2**30:.3f}", mods or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for k, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    base = pp.get("baseline")
    if base:
        ratio = base["step_time"] / p["step_time"]
        lines.append(f"vs {base['name']} ({base['stages']} stages, depth {base['depth']}, {base['microbatches']} "
                     f"micro-batches): {base['step_time'] * 1e3:.3f} ms, max/mean {base['max_over_mean']:.3f}; "
                     + (f"this plan is {ratio:.2f}x faster" if ratio >= 1 else
                        f"the {base['name']} is {1 / ratio:.2f}x faster ({base['hint']})"))
    else:
        lines.append(f"vs {pp['baseline_name']}: none applies ({pp['baseline_reason']})")
    auto = pp.get("auto")
    if auto:
        steps = auto["simulated_step_time"]
        others = [f"{n} {t * 1e3:.3f} ms" for n, t in sorted(steps.items()) if n != auto["chosen"]]
        others += [f"{n} skipped: {why}" for n, why in sorted(auto["skipped"].items())]
        lines.append(f"pipeline='auto' chose {auto['chosen']} (simulated step {steps[auto['chosen']] * 1e3:.3f} ms)"
                     + (f" over {'; '.join(others)}" if others else ""))
    for w in self.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def explain_3d(self: Any) -> str:
    """3-D plan report: per stage its units, submesh, tensor plan by block type, remat, memory and
    times; then the comparison with the best tensor-only, pipeline-only and Megatron-LM grid points
    (and, for stages on unequal submeshes, that it runs MPMD and the best single-program alternative)."""
    p, j = self.predicted, self.predicted["3d"]
    labels = j["unit_labels"]
    equal = equal_submeshes(j)
    where = (f"mesh {' x '.join(f'{n}={s}' for n, s in self.mesh)}" if equal else
             f"{self.mesh[0][1]} devices, stages on unequal submeshes")
    lines = [
        f"autoshard 3-D plan on {where}, hardware {self.hardware}: {j['chosen']['label']}",
        f"predicted step {p['step_time'] * 1e3:.3f} ms; peak memory {fmt_bytes(p['memory']['total'])} per device "
        f"of {fmt_bytes(p['memory_budget'])}; search {j['search_seconds']:.2f} s over {j['points']} points, "
        f"{j['units']} units",
        *([] if equal else [mpmd_line(self)]),
        "",
    ]
    rows = [("stage", "units", "submesh", "tensor plan", "storage", "remat", "forward ms", "backward ms",
             "memory GiB")]
    for s in self.stages:
        first, last = labels[s.units[0]], labels[s.units[-1]]
        rows.append((str(s.index), first if first == last else f"{first} .. {last} ({len(s.units)})",
                     " x ".join(f"{n}={k}" for n, k in s.mesh), _tensor_summary(s.factors), s.storage, s.remat,
                     f"{s.predicted_forward * 1e3:.3f}", f"{s.predicted_backward * 1e3:.3f}",
                     f"{s.memory / 2**30:.3f}"))
    lines.extend(_table(rows))
    lines.append("")
    lines.append("vs (same cost model, same event simulator):")
    lines.extend(_point_lines(j, p["step_time"]))
    for w in self.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def stage_submeshes(stages: Any) -> str:
    """Each stage's submesh, runs of one shape folded: "stages 0-13 data 4 x model 1, stage 14 data 4 x model 2"."""
    runs: list[list] = []
    for s in stages:
        axes = dict(s.mesh)
        shape = (f"data {axes.get('data', 1)} x model {axes.get('model', 1)}" if set(axes) <= {"data", "model"}
                 else " x ".join(f"{n} {k}" for n, k in s.mesh))
        if runs and runs[-1][1] == shape:
            runs[-1][0].append(s.index)
        else:
            runs.append([[s.index], shape])
    return ", ".join((f"stage {ix[0]}" if len(ix) == 1 else f"stages {ix[0]}-{ix[-1]}") + f" {shape}"
                     for ix, shape in runs)


def equal_submeshes(j: Mapping[str, Any]) -> bool:
    """Whether a 3-D plan's stages share one submesh shape (plans written before 0.3 call it "runnable")."""
    return bool(j.get("equal_submeshes", j.get("runnable", True)))


def spmd_alternative(j: Mapping[str, Any]) -> str:
    """The best equal-submesh point of a 3-D search (one SPMD program runs it), its step and how to plan it."""
    alt = j.get("spmd_alternative", j.get("runnable_alternative"))
    if alt is None:
        return "no plan with equal stage submeshes fits the memory budget"
    staged = alt["stages"] > 1 or alt["microbatches"] > 1
    axes = [(n, k) for n, k in (("pipe", alt["stages"]), ("data", alt["data"]), ("model", alt["model"]))
            if k > 1 or (n == "pipe" and staged)] or [("data", 1)]
    mesh = "{" + ", ".join(f'"{n}": {k}' for n, k in axes) + "}" + (', pipeline="auto"' if staged else "")
    return (f"{alt['label']}, predicted step {alt['step_time'] * 1e3:.3f} ms; plan it with "
            f'pipeline_options={{"equal_submeshes": True}} (mesh="auto") or the fixed mesh={mesh}')


def mpmd_line(self: Any) -> str:
    j, step = self.predicted["3d"], self.predicted["step_time"]
    alt = j.get("spmd_alternative", j.get("runnable_alternative"))
    slower = f" ({alt['step_time'] / step:.2f}x this plan's step)" if alt else ""
    return (f"runs MPMD: each stage its own program on its own devices ({stage_submeshes(self.stages)}), "
            f"activations sent between them. Best single-program (SPMD) alternative{slower}: {spmd_alternative(j)}")


def explain_3d_comparison(self: Any) -> list[str]:
    """For a tensor plan chosen by the 3-D search: the lines comparing it with the other points."""
    j = self.predicted["3d"]
    return ["", f"3-D search: {j['points']} points over {j['units']} units in {j['search_seconds']:.2f} s; vs:",
            *_point_lines(j, self.predicted["step_time"])]


def _point_lines(j: Mapping[str, Any], step: float) -> list[str]:
    out = []
    for key, name in (("tensor_only", "best tensor-only"), ("pipeline_only", "best pipeline-only"),
                      ("megatron_grid", "best Megatron-LM grid point")):
        q = j.get(key)
        if q is None:
            fixed = j.get("fixed_shape")
            why = (j.get("megatron_grid_reason") if key == "megatron_grid" else
                   f"not of the mesh's fixed shape {fixed}" if fixed else "none fits the memory budget")
            out.append(f"  {name:<29} none ({why or 'none fits the memory budget'})")
            continue
        out.append(f"  {name:<29} {q['step_time'] * 1e3:12.3f} ms  {q['memory'] / 2**30:8.3f} GiB  {q['label']}"
                   + (f"; the chosen plan is {q['step_time'] / step:.2f}x faster" if q["step_time"] > step * 1.0005
                      else ""))
    return out


def _tensor_summary(factors: tuple) -> str:
    """Factors split over the stage's axes, by their logical description (first three)."""
    split = [f"{desc.split(' dim ')[0].split(']')[-2].strip(chr(39) + '[') if ']' in desc else desc}:"
             f"{'+'.join(axes)}" for _, desc, _, axes in factors if axes]
    return ", ".join(split[:3]) + (f" +{len(split) - 3}" if len(split) > 3 else "") if split else "replicated"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for k, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


_PARTS = {"compute": "compute", "fwd_comm": "forward communication", "bwd_comm": "backward communication",
          "opt_comm": "optimizer communication", "grad_sync": "gradient sync", "storage_comm": "ZeRO gathers"}


def _remat_lines(plan: Any) -> list[str]:
    """What a tensor plan's rematerialisation does (none: nothing to say)."""
    policy = plan.stages[0].remat
    if policy == "none":
        return []
    blocks = plan.remat_labels
    what = {"full": "every forward value of a block", "dots": "a block's forward values but its matmul results",
            "selective": "the attention scores and probabilities"}.get(policy, policy)
    return [f"rematerialisation {policy!r} in {len(blocks)} block(s) ({', '.join(blocks[:3])}"
            f"{' ...' if len(blocks) > 3 else ''}): the backward pass recomputes {what} instead of keeping it "
            "(the step time counts the replay and its collectives, marked backward)"]


def _expert_lines(p: Mapping[str, Any]) -> list[str]:
    """One line per expert: its step time and memory, and why the chosen plan differs."""
    lines = []
    t, bd = p["step_time"], p["breakdown"]
    for name, e in p["experts"].items():
        if "reason" in e:
            lines.append(f"  {name:<15} not applicable: {e['reason']}")
            continue
        head = (f"  {name:<15} {e['step_time'] * 1e3:10.3f} ms  {e['memory'] / 2**30:8.3f} GiB"
                + ("" if e["feasible"] else "  (exceeds the memory budget)"))
        if not e["feasible"]:
            lines.append(head + "; the chosen plan fits")
        elif e["step_time"] > t * (1 + 1e-9):
            # the component where the chosen plan saves most
            diffs = {k: e["breakdown"][k] - bd[k] for k in _PARTS}
            k = max(diffs, key=diffs.get)
            lines.append(head + f"; chosen plan is {e['step_time'] / t:.2f}x faster: {_PARTS[k]} "
                                f"{bd[k] * 1e3:.3f} ms instead of {e['breakdown'][k] * 1e3:.3f} ms")
        else:
            lines.append(head + "; ties with the chosen plan")
    return lines
