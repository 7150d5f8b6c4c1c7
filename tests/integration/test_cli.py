"""The README's main job: `autoshard` traces and groups a GPT on 8 simulated CPU devices."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoshard", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def test_group_prints_block_table():
    out = _run("group", "--config", "debug", "--layers", "3")
    assert out.returncode == 0, out.stderr
    assert "mesh: {'data': 8} on 8 simulated CPU devices" in out.stdout
    row = next(line for line in out.stdout.splitlines() if line.startswith("GPT/block_*"))
    assert row.split()[2] == "3"


def test_default_job_plans_trains_and_matches_one_device():
    out = _run()
    assert out.returncode == 0, out.stderr
    assert "on 8 simulated CPU devices" in out.stdout and "predicted step" in out.stdout
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit()
            and len(line.split()) == 3]
    assert len(rows) == 3
    for _, a, b in rows:
        assert abs(float(a) - float(b)) < 1e-5


def test_plan_command_on_a_large_abstract_mesh():
    out = _run("plan", "gpt", "--config", "gpt2-small", "--mesh", "data=8,model=8")
    assert out.returncode == 0, out.stderr
    assert "mesh data=8 x model=8" in out.stdout


def test_group_json_for_nnx():
    out = _run("group", "gpt_nnx", "--config", "debug", "--layers", "4", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [(b["name"], b["instances"]) for b in data["block_types"]] == [("blocks/*", 4)]
    assert data["mesh"] == {"data": 8}


def test_bad_model_name_is_reported():
    out = _run("group", "no-such-model")
    assert out.returncode == 2
    assert "unknown model 'no-such-model'" in out.stderr and "gpt" in out.stderr


def test_audit_command_compares_compiled_collectives_with_the_plan():
    out = _run("audit", "mlp", "--mesh", "model=8", "--expert", "megatron")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "plan: megatron" in out.stdout and "all-reduce@model" in out.stdout
    assert "MLP/dense_1" in out.stdout  # the row-parallel layer's activation all-reduce, by module


def test_run_with_a_pipeline_plan_matches_one_device():
    out = _run("run", "mlp", "--mesh", "pipe=2,data=4", "--pipeline", "rannc", "--microbatches", "2",
               "--steps", "2")
    assert out.returncode == 0, out.stderr
    assert "Runtime cut of the loss" in out.stdout
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit()
            and len(line.split()) == 3]
    assert len(rows) == 2 and all(abs(float(a) - float(b)) < 1e-5 for _, a, b in rows)
