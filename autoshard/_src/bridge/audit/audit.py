"""Audit: what XLA compiled for a plan, next to what the plan predicted.

`audit(plan, step, *args)` lowers and compiles the planned step on the (simulated) mesh and reads
the compiled program back: every collective from the HLO text (kind, bytes per device, mesh axes,
source module; see hlo.py), per-device memory from `memory_analysis()` and flops/bytes from
`cost_analysis()`. It compares them with `plan.predicted` and lists each gap with the modules it
comes from. Some differences are the backend's, not the plan's: they are labelled, not hidden. A collective
difference small against the step's collective bytes (`MINOR_SHARE`) is an op the plan does not model, not a
wrong plan: it is reported as a minor gap, apart, and does not fail `fidelity_ok`.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh

from ...core.collectives import lowered_kind
from ...core.errors import PlanError
from ...plan.plan import Plan, buffers
from ...plan.platform_memory import memory_terms_on
from ..api import bind
from ..emit.emit import auto_axes, jit_step, make_mesh, on_own_mesh
from ..emit.plan_fit import check_fingerprint, check_outputs
from ..trace.trace import trace_step
from . import hlo as _hlo

BYTES_TOLERANCE = 0.10      # issue 4: predicted collective bytes within 10 % of the compiled program's
MEMORY_TOLERANCE = 0.15     # and argument + temp memory within 15 %
# A collective kind@axes beyond BYTES_TOLERANCE of its own bytes is still *minor* (reported, not counted by
# `fidelity_ok`) when its difference is at most MINOR_SHARE of the step's total collective bytes (the larger of
# predicted and compiled), and all minor differences together stay within that share too. Why this share: the
# per-key tolerance already lets every collective of the step be 10 % off at once, i.e. the step's bytes 10 %
# off with no gap; a small op the plan does not model (a rotary table's gather, a scalar's all-reduce) that
# moves less than that changes the step's communication by no more than the audit accepts anyway. A wrong plan
# (an activation resharded, a gradient synchronised over the wrong axis, a parameter gathered) moves a
# model-sized share of the bytes and stays a gap; the combined cap keeps many small misses from hiding one.
MINOR_SHARE = BYTES_TOLERANCE

# Differences that come from the backend and not from the plan, per platform.
BACKEND_NOTES = {
    "cpu": (
        "XLA:CPU has no reduce-scatter: FSDP/ZeRO gradient reduce-scatters appear as all-reduce "
        "(+ dynamic-slice), so reduce-scatter bytes are compared with all-reduce bytes on the same axes; an "
        "activation's reduce-scatter over several axes (sequence parallelism) with one all-reduce per axis.",
        "Collective counts depend on XLA's all-reduce combiner (thresholds differ per backend): "
        "bytes are compared, counts are informational.",
        "XLA:CPU all-reduces a ZeRO gradient whole (no reduce-scatter): the plan's CPU memory counts that "
        "result (cpu_temp_extra); a GPU keeps only the scattered shard.",
    ),
}


@dataclasses.dataclass(frozen=True)
class Gap:
    """A prediction the compiled program does not match."""

    what: str                      # "collective all-reduce@data" / "memory argument" ...
    predicted: float
    audited: float
    modules: tuple[tuple[str, float], ...]   # largest contributors (module, bytes; memory: predicted parts)
    # a named backend behaviour accounts for the bytes; the known ones (BACKEND_NOTES) are applied to
    # the prediction instead (Plan.collectives_on / memory_on), so today no gap carries it
    backend_specific: bool
    note: str

    @property
    def relative(self) -> float:
        return abs(self.audited - self.predicted) / max(abs(self.predicted), abs(self.audited), 1.0)


@dataclasses.dataclass(frozen=True)
class Audit:
    """The compiled program of a plan, and how far it is from the plan's prediction."""

    platform: str
    mesh: tuple[tuple[str, int], ...]
    collectives: tuple[_hlo.Collective, ...]
    memory: Mapping[str, int]                 # per device: argument / output / alias / temp bytes
    cost: Mapping[str, float]                 # flops, bytes accessed (compiled program, per device)
    predicted_collectives: Mapping[str, float]    # "kind@axes" -> bytes per step (the plan's)
    audited_collectives: Mapping[str, Mapping[str, float]]  # "kind@axes" -> {bytes, count}
    predicted_memory: Mapping[str, float]
    gaps: tuple[Gap, ...]                     # beyond tolerance: they count against `fidelity_ok`
    notes: tuple[str, ...]
    # collective differences beyond BYTES_TOLERANCE of their own bytes but small against the step's (MINOR_SHARE):
    # an op the plan does not model, not a wrong plan; reported, not counted by `fidelity_ok`
    minor_gaps: tuple[Gap, ...] = ()

    @staticmethod
    def read_collectives(hlo_text: str, mesh: Mesh) -> tuple[list[_hlo.Collective], dict[str, dict[str, float]]]:
        """Every collective of a compiled program's HLO text (`compiled.as_text()`) on `mesh`, and the
        per-step totals by "kind@axes" ({"bytes", "count"}): the reading `audit` does, for any program
        (a hand-written jit, a pipeline runtime) rather than a plan's."""
        records = _hlo.collectives(hlo_text, list(mesh.axis_names), [mesh.shape[a] for a in mesh.axis_names])
        return records, _hlo.summarize(records)

    def by_module(self, kind: str | None = None) -> dict[str, float]:
        """Collective bytes per step by source module (optionally of one kind)."""
        out: dict[str, float] = defaultdict(float)
        for c in self.collectives:
            if kind is None or c.kind == kind:
                out[c.module or "(root)"] += c.bytes * c.count
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    @property
    def fidelity_ok(self) -> bool:
        """Every gap beyond tolerance is one a named backend behaviour explains (`BACKEND_NOTES`);
        collective bytes and memory the plan mispredicts count against it (`minor_gaps` do not)."""
        return all(g.backend_specific for g in self.gaps)

    def to_dict(self) -> dict[str, Any]:
        return {
            "platform": self.platform, "mesh": dict(self.mesh),
            "collectives": [dataclasses.asdict(c) for c in self.collectives],
            "memory": dict(self.memory), "cost": dict(self.cost),
            "predicted_collectives": dict(self.predicted_collectives),
            "audited_collectives": {k: dict(v) for k, v in self.audited_collectives.items()},
            "predicted_memory": dict(self.predicted_memory),
            "gaps": [dict(dataclasses.asdict(g), relative=g.relative) for g in self.gaps],
            "minor_gaps": [dict(dataclasses.asdict(g), relative=g.relative, share=self.share(g))
                           for g in self.minor_gaps],
            "notes": list(self.notes),
        }

    def share(self, gap: Gap) -> float:
        """A collective gap's difference as a share of the step's collective bytes (`step_collective_bytes`)."""
        return abs(gap.audited - gap.predicted) / max(step_collective_bytes(self.predicted_collectives,
                                                                           self.audited_collectives), 1.0)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    def report(self) -> str:
        lines = [f"audit on {self.platform}, mesh {' x '.join(f'{n}={s}' for n, s in self.mesh)}", "",
                 "collectives (bytes per device per step):",
                 f"  {'kind@axes':<28} {'predicted':>14} {'compiled':>14} {'launches':>9}"]
        keys = sorted(set(self.predicted_collectives) | set(self.audited_collectives))
        for k in keys:
            a = self.audited_collectives.get(k, {"bytes": 0.0, "count": 0.0})
            lines.append(f"  {k:<28} {self.predicted_collectives.get(k, 0.0):>14,.0f} {a['bytes']:>14,.0f} "
                         f"{a['count']:>9g}")
        lines += ["", "collective bytes by source module:"]
        for mod, b in list(self.by_module().items())[:20]:
            lines.append(f"  {mod:<48} {b:>14,.0f}")
        lines += ["", "memory per device (bytes):",
                  f"  {'':<22} {'predicted':>14} {'compiled':>14}"]
        pm, mm = self.predicted_memory, self.memory
        for name in ("argument", "temp", "argument+temp"):
            lines.append(f"  {name:<22} {pm.get(name, 0.0):>14,.0f} {mm.get(name, 0):>14,.0f}")
        lines.append(f"  compiled flops {self.cost.get('flops', 0.0):,.0f}, bytes accessed "
                     f"{self.cost.get('bytes accessed', 0.0):,.0f}")
        if self.gaps:
            lines += ["", "gaps beyond tolerance:"]
            lines += [_gap_line(g, " [backend-specific]" if g.backend_specific else "") for g in self.gaps]
        if self.minor_gaps:
            lines += ["", f"minor gaps (each, and all together, <= {MINOR_SHARE:.0%} of the step's collective bytes; "
                          "not counted by fidelity_ok):"]
            lines += [_gap_line(g, f" [{self.share(g):.1%} of the step]") for g in self.minor_gaps]
        for n in self.notes:
            lines.append(f"note: {n}")
        return "\n".join(lines)


def _gap_line(g: Gap, tag: str) -> str:
    mods = ", ".join(f"{m} {b:,.0f}" for m, b in g.modules[:5])
    return (f"  {g.what}: predicted {g.predicted:,.0f}, compiled {g.audited:,.0f} ({g.relative:.0%}){tag}; {g.note}"
            + (f"; from {mods}" if mods else ""))


def step_collective_bytes(predicted: Mapping[str, float], audited: Mapping[str, Mapping[str, float]]) -> float:
    """The step's collective bytes per device: the larger of the predicted and the compiled total."""
    return max(sum(predicted.values()), sum(a["bytes"] for a in audited.values()))


def _abstract(args: tuple) -> tuple:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") else x, args)


def predicted_on(plan: Plan, platform: str) -> dict[str, float]:
    """The plan's collective bytes by "kind@axes" as `platform` compiles them (`Plan.collectives_on`)."""
    predicted: dict[str, float] = defaultdict(float)
    if not plan.predicted.get("collectives"):     # plans written before collectives were recorded per phase
        for key, b in plan.predicted.get("comm_bytes", {}).items():
            kind, axes = key.split("@")
            predicted[f"{lowered_kind(kind, platform)}@{axes}"] += b
        return predicted
    for c in plan.collectives_on(platform):
        predicted[f"{c['kind']}@{','.join(c['axes'])}"] += float(c["bytes"])
    return predicted


def compare(plan: Plan, records: list[_hlo.Collective], memory: Mapping[str, int], platform: str,
            bytes_tol: float = BYTES_TOLERANCE, memory_tol: float = MEMORY_TOLERANCE,
            terms: Mapping[str, float] | None = None, minor_share: float = MINOR_SHARE
            ) -> tuple[dict, dict, list[Gap], list[Gap], list[str]]:
    """(predicted by key, audited by key, gaps, minor gaps, notes). `terms`: the plan's memory terms as priced
    for `platform` (`plan.platform_memory.memory_terms_on`; default the plan's own); `minor_share`: see
    MINOR_SHARE."""
    predicted = predicted_on(plan, platform)
    audited = _hlo.summarize(records)
    beyond = _collective_gaps(predicted, audited, records, bytes_tol)
    gaps, minor = split_minor(beyond, step_collective_bytes(predicted, audited), minor_share)
    gaps += _memory_gaps(plan, memory, platform, memory_tol, terms)
    notes = list(BACKEND_NOTES.get(platform, ()))
    return dict(predicted), audited, gaps, minor, notes


def split_minor(beyond: list[Gap], step_bytes: float, share: float) -> tuple[list[Gap], list[Gap]]:
    """(gaps, minor gaps) of the collective gaps `beyond` tolerance: the smallest differences are minor while
    each, and all of them together, stay within `share` of the step's collective bytes `step_bytes`."""
    budget = share * step_bytes
    minor: list[Gap] = []
    used = 0.0
    for g in sorted(beyond, key=lambda g: abs(g.audited - g.predicted)):
        diff = abs(g.audited - g.predicted)
        if used + diff > budget:
            break
        minor.append(g)
        used += diff
    small = {id(g) for g in minor}
    return [g for g in beyond if id(g) not in small], sorted(minor, key=lambda g: g.what)


def _collective_gaps(predicted: Mapping[str, float], audited: Mapping[str, Mapping[str, float]],
                     records: list[_hlo.Collective], bytes_tol: float) -> list[Gap]:
    """A gap per "kind@axes" whose compiled bytes differ from the predicted by more than `bytes_tol` of them."""
    gaps: list[Gap] = []
    for key in sorted(set(predicted) | set(audited)):
        p, a = predicted.get(key, 0.0), audited.get(key, {"bytes": 0.0})["bytes"]
        if abs(a - p) <= bytes_tol * max(p, a) or max(p, a) == 0:
            continue
        kind, axes = key.split("@")
        mods: dict[str, float] = defaultdict(float)
        for r in records:
            if r.kind == kind and ",".join(r.axes) == axes:
                mods[r.module or "(root)"] += r.bytes * r.count
        if p == 0:
            note = "collective the plan does not predict"
        elif a == 0:
            note = "predicted collective absent from the compiled program"
        else:
            note = "more bytes than the plan predicts" if a > p else "fewer bytes than the plan predicts"
        gaps.append(Gap(f"collective {key}", p, a, tuple(sorted(mods.items(), key=lambda kv: -kv[1])),
                        False, note))
    return gaps


def _memory_gaps(plan: Plan, memory: Mapping[str, int], platform: str, memory_tol: float,
                 terms: Mapping[str, float] | None) -> list[Gap]:
    """A gap per compared memory total (argument, argument+temp) beyond `memory_tol`, its predicted parts
    listed and its note worded by direction: memory the plan misses, or memory it predicts and XLA does not hold."""
    m = terms if terms is not None else plan.predicted["memory"]
    pm = buffers(m, platform)
    parts = {"argument": (("parameters", m["params"]), ("optimizer state", m["optimizer"]), ("batch", m["data"])),
             "argument+temp": (("saved activations", m["activations"]), ("gradients", m["grads"]),
                               ("XLA:CPU all-reduce results", pm["temp"] - m["grads"] - m["activations"]))}
    what = {"argument": "argument memory (parameters + optimizer state + batch)", "argument+temp": "temp memory"}
    gaps: list[Gap] = []
    for name in ("argument", "argument+temp"):
        p, a = pm[name], float(memory[name])
        if abs(a - p) > memory_tol * max(p, a, 1.0):
            # no backend behaviour is known to account for these bytes: the gap counts against fidelity
            note = (f"{what[name]} the plan does not account for (its predicted parts listed)" if a > p
                    else f"{what[name]} the plan predicts and the compiled program does not hold (its predicted "
                         "parts listed)")
            gaps.append(Gap(f"memory {name}", p, a, tuple((k, b) for k, b in parts[name] if b), False, note))
    return gaps


def _check_auditable(plan: Any) -> None:
    """audit compiles one jit program of a training step under a tensor plan: anything else is a PlanError
    saying what to call instead."""
    if not isinstance(plan, Plan):
        inference = type(plan).__name__ == "InferencePlan"
        raise PlanError(
            f"autoshard.audit: plan={type(plan).__name__} is not a training autoshard.Plan"
            + (". An inference plan's program is compiled by its decorated function: fast = autoshard.autoshard(fn, "
               "mode='inference', mesh=...); fast.lower(*args).compile().as_text() (its collectives via "
               "autoshard.Audit.read_collectives(text, mesh))" if inference else "")
            + ". Fix: pass the result of autoshard.plan(step, *args, ...) or autoshard.expert_plan(...).")
    if plan.is_pipeline:
        method = ("3-D (stages x data x model)" if "3d" in plan.predicted
                  else plan.predicted.get("pipeline", {}).get("method", "pipeline"))
        raise PlanError(
            f"autoshard.audit: this is a {method} pipeline plan ({len(plan.stages)} stages); audit compiles one "
            "jit program of the step under a tensor plan, and a pipeline runs as a shard_map over its stages. Fix: "
            "run it with @autoshard(..., plan=plan) and read the compiled collectives of step.lower(*args).compile() "
            "with autoshard.Audit.read_collectives(compiled.as_text(), step.mesh); or audit a tensor sharding plan "
            "(autoshard.plan without pipeline=..., or a mesh without a 'pipe' axis).")


@on_own_mesh
def audit(plan: Plan, step: Callable, *args: Any, mesh: Mesh | None = None) -> Audit:
    """Compile `step` under `plan` on `mesh` (default: the plan's axes over the local devices) and
    compare the compiled program with the plan's prediction. `args` may be ShapeDtypeStructs."""
    _check_auditable(plan)
    abstract = _abstract(args)
    traced = trace_step(step, *abstract)
    # the decorator's checks: a plan of another step or other argument shapes audits nothing real
    check_fingerprint(plan, traced.graph, "autoshard.audit: plan=")
    check_outputs(plan, traced.graph, "autoshard.audit: plan=")
    plan = bind(plan, *abstract)      # always: a plan bound to other arguments is checked against these
    if mesh is None:
        mesh = make_mesh(plan)
    elif not isinstance(mesh, Mesh):
        raise PlanError(f"autoshard.audit: mesh={type(mesh).__name__} is not a jax.sharding.Mesh. Fix: pass "
                        "jax.make_mesh(sizes, names) with the plan's axes, or leave mesh out (the plan's axes over the "
                        "local devices).")
    elif tuple(zip(mesh.axis_names, mesh.devices.shape, strict=True)) != tuple(plan.mesh):
        raise PlanError(f"autoshard.audit: mesh {dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))} "
                        f"differs from the plan's mesh {dict(plan.mesh)}. Fix: pass a mesh with the plan's "
                        "axis names and sizes, or re-plan for this mesh.")
    mesh = auto_axes(mesh)        # an Explicit-axis mesh (jax.make_mesh's default): same devices, Auto axes
    compiled = jit_step(traced, plan, mesh, abstract, remat=plan.stages[0].remat != "none").lower(*abstract).compile()
    platform = mesh.devices.flat[0].platform
    names = tuple(n for n, _ in plan.mesh)
    sizes = tuple(s for _, s in plan.mesh)
    records = _hlo.collectives(compiled.as_text(), names, sizes)
    ma = compiled.memory_analysis()
    memory = {"argument": int(ma.argument_size_in_bytes), "output": int(ma.output_size_in_bytes),
              "alias": int(ma.alias_size_in_bytes), "temp": int(ma.temp_size_in_bytes)}
    memory["argument+temp"] = memory["argument"] + memory["temp"]
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    cost = {k: float(ca[k]) for k in ("flops", "bytes accessed", "transcendentals") if k in ca}
    terms = memory_terms_on(plan, traced.graph, platform)     # saved activations as this compiler fuses
    predicted, audited, gaps, minor, notes = compare(plan, records, memory, platform, terms=terms)
    return Audit(platform, tuple(plan.mesh), tuple(records), memory, cost, predicted, audited,
                 buffers(terms, platform), tuple(gaps), tuple(notes), tuple(minor))
