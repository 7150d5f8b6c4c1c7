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


def test_default_job_prints_block_table():
    out = _run("--config", "debug", "--layers", "3")
    assert out.returncode == 0, out.stderr
    assert "mesh: {'data': 8} on 8 simulated CPU devices" in out.stdout
    row = next(line for line in out.stdout.splitlines() if line.startswith("GPT/block_*"))
    assert row.split()[2] == "3"


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
