"""Golden plans: the planner's choice for each debug model and mesh, diffed key by key against
tests/golden/<model>/<mesh>.json. A planner change that moves a plan shows up here as a readable
diff; if the change is intended, regenerate with `pytest tests/golden --regen-golden`
and review the JSON diff in the commit."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import autoshard
import models

GOLDEN = Path(__file__).resolve().parent
MODELS = ["mlp", "gpt", "gpt_nnx", "bert"]
MESHES = {"1x8": {"a": 1, "b": 8}, "2x4": {"data": 2, "model": 4}, "4x2": {"data": 4, "model": 2},
          "8x1": {"a": 8, "b": 1}, "2x2x2": {"x": 2, "y": 2, "z": 2}}
# near-zero link latency, so that even the debug models shard (a fully replicated golden plan would
# catch little)
HARDWARE = {"base": "cpu-sim", "intra_node_latency": 1e-12, "inter_node_latency": 1e-12}


def _summary(plan: autoshard.Plan) -> dict:
    """The parts of a plan a reviewer cares about, in a stable, diffable form."""
    p = plan.predicted
    return {
        "mesh": dict(plan.mesh),
        "hardware": plan.hardware,
        "storage": plan.storage,
        "specs": {k: [list(d) for d in s] for k, s in sorted(plan.specs_by_keypath().items())
                  if k.startswith(("[0]", "[2]"))},
        "factors": {desc: list(axes) for _, desc, _, axes in plan.factors},
        "step_time": p["step_time"],
        "memory_total": p["memory"]["total"],
        "comm_bytes": dict(sorted(p["comm_bytes"].items())),
        "warnings": list(plan.warnings),
        "stages": [{"mesh": dict(st.mesh), "replicas": st.replicas, "microbatch_size": st.microbatch_size,
                    "storage": st.storage, "activation_constraints": {k: [list(d) for d in sp]
                                                                      for k, sp in st.activation_constraints}}
                   for st in plan.stages],
        "schedule": plan.schedule,
    }


def _diff(want, got, path="") -> list[str]:
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for k in sorted(set(want) | set(got)):
            if k not in got:
                out.append(f"{path}/{k}: missing (golden {want[k]!r})")
            elif k not in want:
                out.append(f"{path}/{k}: new ({got[k]!r})")
            else:
                out += _diff(want[k], got[k], f"{path}/{k}")
        return out
    if isinstance(want, float) or isinstance(got, float):
        ok = isinstance(want, (int, float)) and isinstance(got, (int, float)) and math.isclose(want, got, rel_tol=1e-6)
        return [] if ok else [f"{path}: golden {want!r}, now {got!r}"]
    return [] if want == got else [f"{path}: golden {want!r}, now {got!r}"]


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("name", MODELS)
def test_golden_plan(name, mesh, request):
    m = models.get(name, "debug")
    plan = autoshard.plan(m.train_step, *m.abstract_state(), mesh=MESHES[mesh], hardware=HARDWARE)
    got = json.loads(json.dumps(_summary(plan)))
    path = GOLDEN / name / f"{mesh}.json"
    if request.config.getoption("--regen-golden"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        return
    assert path.exists(), f"no golden plan {path}; create it with --regen-golden"
    diffs = _diff(json.loads(path.read_text()), got)
    assert not diffs, f"plan for {name} on {mesh} moved ({len(diffs)} differences):\n" + "\n".join(diffs[:40])
