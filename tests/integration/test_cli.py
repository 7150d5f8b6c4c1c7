"""The `autoshard` command line: every command in a real subprocess at debug size, the Quick start's
output size, one-line errors for every bad flag, units and grouping on plain data.

Subprocesses cost ~2.5 s of imports each, so the command table runs two at a time and the
bad-flag table calls `main(argv)` in this process (the same code path: parsing and checks happen
before any work, and nothing is cached between calls).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from autoshard._src.cli import main
from autoshard._src.cli.progress import NativeStderr, Progress
from autoshard._src.cli.tables import ParamRecord, grouped_param_lines, split_block
from autoshard._src.core.quantities import fmt_bytes, fmt_seconds, parse_bytes

pytestmark = pytest.mark.slow     # heavy: CI's second step (`pytest -m slow`)


ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoshard", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env={**os.environ, "COLUMNS": "120"})


def _loss_rows(stdout: str) -> list[tuple[float, float]]:
    rows = [line.split() for line in stdout.splitlines()]
    return [(float(r[1]), float(r[2])) for r in rows if len(r) == 3 and r[0].isdigit()]


GPT3 = ["plan", "gpt", "--config", "gpt3-175b", "--mesh", "auto", "--devices", "64", "--hardware", "h100-sxm"]


def _sweep_file(tmp: Path) -> str:
    path = tmp / "sweep.toml"
    path.write_text('hardware = "h100-sxm"\n[meshes.compiled]\n"2x4" = { data = 2, model = 4 }\n'
                    '[meshes.abstract]\n"8x8" = { data = 8, model = 8 }\n'
                    '[[compiled]]\nname = "mlp"\nconfig = "debug"\n'
                    '[[abstract]]\nname = "gpt"\nconfig = "debug"\noverrides = { batch_size = 64 }\n')
    return str(path)


def _commands(tmp: Path) -> list[tuple[list[str], list[str]]]:
    """(argv, words its stdout must hold) for every command at debug size; `run` is the Quick start."""
    return [
        (["list"], ["gpt3-175b", "h100-sxm", "1f1b", "rannc", "data-megatron"]),
        (["plan", "gpt", "--config", "debug", "--mesh", "data=4,model=2"], ["block_* x2", "best expert plan"]),
        (["explain", "gpt", "--config", "debug", "--mesh", "data=4,model=2"], ["logical dims", "slower: "]),
        (["schedule", "bert", "--config", "debug", "--mesh", "pipe=2,data=4", "--width", "60"],
         ["one column = ", "rank 1 |"]),
        (["audit", "mlp", "--mesh", "model=8", "--expert", "megatron"], ["all-reduce@model", "MLP/dense_1"]),
        (["group", "gpt_nnx", "--config", "debug", "--layers", "3"], ["blocks/* x3"]),
        (["sweep", _sweep_file(tmp), "--audit"], ["mlp", "8x8 (data=8 x model=8)"]),
        (["run", "mlp", "--mesh", "pipe=2,data=4", "--pipeline", "rannc", "--microbatches", "2", "--steps", "2"],
         ["runtime cut of the loss", "pipeline plan (rannc"]),
    ]


def _plan_then_run(tmp: Path) -> list[tuple[list[str], subprocess.CompletedProcess]]:
    path = str(tmp / "mlp_plan.json")
    first = ["plan", "mlp", "--config", "debug", "--mesh", "data=4,model=2", "--hardware", "cpu-sim", "--out", path]
    second = ["run", "mlp", "--plan", path, "--steps", "2"]
    return [(first, _run(*first)), (second, _run(*second))]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every subprocess of this file, two at a time, longest first: {"quick", "gpt3", "commands", "plan_run"}."""
    tmp = tmp_path_factory.mktemp("cli")
    commands = _commands(tmp)
    with ThreadPoolExecutor(max_workers=2) as pool:
        gpt3, quick = pool.submit(_run, *GPT3), pool.submit(_run)
        plan_run = pool.submit(_plan_then_run, tmp)
        done = [(argv, words, pool.submit(_run, *argv)) for argv, words in reversed(commands)]
        return {"quick": quick.result(), "gpt3": gpt3.result(), "plan_run": plan_run.result(),
                "commands": [(argv, words, f.result()) for argv, words, f in done]}


def test_quick_start_fits_one_screen_and_matches_one_device(runs):
    """README's first command with no arguments: plan, train 3 steps, compare; <= 60 lines in all."""
    out = runs["quick"]
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines() + out.stderr.splitlines()
    assert len(lines) <= 60, "\n".join(lines)
    losses = _loss_rows(out.stdout)
    assert len(losses) == 3 and all(abs(a - b) < 1e-5 for a, b in losses)
    text = out.stdout
    assert "mesh data=4 x model=2" in text and "predicted step" in text
    # the axis names read the way the plan uses them (which axis takes the 4 samples is the planner's
    # choice: at this size the collectives' latency can outweigh the compute a wider split saves)
    assert re.search(r"(data=4|model=2) +the batch", text), text
    assert "block_* x2" in text and "--full" in text   # grouped by block type
    for bad in ("0.000 ", "e-0", "e+0"):                # units, not bare or zero-rounded floats
        assert bad not in text.split("max |parameter difference|")[0], bad
    assert any(line.strip().startswith("compile + step 1") for line in out.stderr.splitlines())


def test_every_command_runs_in_a_subprocess(runs):
    """Each command at debug size exits 0 and prints what it is for; a saved plan runs with --plan."""
    for argv, words, out in runs["commands"] + [(a, [], o) for a, o in runs["plan_run"]]:
        assert out.returncode == 0, f"autoshard {' '.join(argv)}:\n{out.stdout}\n{out.stderr}"
        for word in words:
            assert word in out.stdout, f"{word!r} not in `autoshard {' '.join(argv)}`:\n{out.stdout}"
    ran = runs["plan_run"][-1][1].stdout
    assert len(_loss_rows(ran)) == 2 and all(abs(a - b) < 1e-5 for a, b in _loss_rows(ran))


def test_gpt3_plan_summary_fits_two_screens(runs):
    """GPT-3 175B on 64 H100s: <= 120 lines. Without sequence parallelism no tensor-only plan fits 80 GB
    per device and the 3-D plan is shown; with it, a tensor plan splitting the stream's sequence fits."""
    out = runs["gpt3"]
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.splitlines() + out.stderr.splitlines()) <= 120, out.stdout
    assert "GiB" in out.stdout and "175B parameters" in out.stdout
    assert ("block_* x96" in out.stdout and "stages" in out.stdout) or "tensor plan on mesh" in out.stdout


BAD_FLAGS = [
    (["plan", "--mesh", "data=2,data=4"], "--mesh", "appears twice"),
    (["run", "--mesh", "data=0"], "--mesh", ">= 1"),
    (["run", "--mesh", "data"], "--mesh", "name=size"),
    (["run", "--mesh", "auto"], "--mesh", "--plan FILE"),
    (["plan", "--layers", "-2"], "--layers", ">= 1"),
    (["run", "--steps", "0"], "--steps", ">= 1"),
    (["plan", "--hardware", "tpu"], "--hardware", "h100-sxm"),
    (["plan", "--memory-budget", "1"], "--memory-budget", "1GiB"),
    (["plan", "--memory-budget", "lots"], "--memory-budget", "16GiB"),
    (["audit", "--expert", "nope"], "--expert", "megatron"),
    (["plan", "--set", "num_layers=abc"], "--set", "num_layers is int"),
    (["plan", "--set", "num_layers=0"], "--set", ">= 1"),
    (["plan", "--set", "no_such_field=1"], "--set", "fields: vocab_size"),
    (["plan", "--out", "/nonexistent/x.json"], "--out", "does not exist"),
    (["plan", "--plan", "/nonexistent/plan.json"], "--plan", "no such file"),
    (["plan", "no_such_model"], "MODEL", "gpt"),
    (["plan", "--config", "huge"], "--config", "gpt3-175b"),
    (["plan", "--profile", "measured"], "--profile", "--pipeline"),
    (["frobnicate"], "COMMAND", "plan"),
]


@pytest.mark.parametrize("argv, flag, fix", BAD_FLAGS, ids=[" ".join(a) for a, _, _ in BAD_FLAGS])
def test_a_bad_flag_is_one_line_naming_the_flag(argv, flag, fix, capsys):
    try:
        code = main(argv)
    except SystemExit as exit_:          # argparse exits; checks after parsing return the code
        code = exit_.code
    captured = capsys.readouterr()
    assert code != 0
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err                 # nothing planned: no progress lines either
    assert f"argument {flag}" in lines[0] and fix in lines[0], lines[0]
    assert not captured.out


def test_bad_flag_in_a_real_process_and_debug_traceback(tmp_path):
    out = _run("plan", "--mesh", "data=2,data=4")
    assert out.returncode == 2 and len(out.stderr.splitlines()) == 1 and "--mesh" in out.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["explain", "--plan", str(bad)]) == 1          # a typed PlanError: one line, exit 1
    with pytest.raises(Exception, match="format_version"):
        main(["explain", "--plan", str(bad), "--debug"])        # --debug: the exception itself


def test_units_scale():
    assert [fmt_bytes(n) for n in (0, 512, 1536, 101376, 2.7 * 2**30)] == ["0 B", "512 B", "1.5 KiB", "99 KiB",
                                                                           "2.7 GiB"]
    assert [fmt_seconds(s) for s in (0, 3.47859e-05, 0.00094, 1.7566)] == ["0 s", "34.8 µs", "940 µs", "1.76 s"]
    assert parse_bytes("16GiB") == (16 * 2**30, True) and parse_bytes("1e9") == (1e9, False)


def test_parameters_group_by_block_type():
    records = [ParamRecord(f"[0]['block_{i}']['attn']['{p}']['kernel']", (8, 8), (("model",), ()), 128, ("x",))
               for i in range(96) for p in "qkv"]
    records += [ParamRecord("[0]['wte']['embedding']", (100, 8), ((), ()), 3200, ("x",))]
    lines = grouped_param_lines(records, ["sync"])
    assert len(lines) == 4, lines                                  # header, rule, one block row, one other
    assert "block_* x96" in lines[2] and "attn.{k,q,v}.kernel" in lines[2] and "P(model, None)" in lines[2]
    assert "(outside blocks)" in lines[3] and "replicated" in lines[3]
    assert split_block("[0]['blocks'][3]['fc1']['kernel'].value") == ("blocks[*]", (3,), ("fc1", "kernel"))


def test_native_stderr_is_summarised_not_interleaved(capfd):
    """XLA writes from C++ to fd 2; the run captures it and prints one line after its tables."""
    progress = Progress(quiet=True)
    with NativeStderr(progress) as native:
        os.write(2, b"W0000 00:00:1732459999.123456   12345 spmd_partitioner.cc:652] Involuntary full "
                    b"rematerialization. The compiler was not able to go from sharding A to B\n  detail\n")
    assert capfd.readouterr().err == ""
    (line,) = native.summary()
    assert "XLA wrote 1 warning" in line and "Involuntary full rematerialization" in line and "--debug" in line


def test_group_json_for_nnx(capsys):
    assert main(["group", "gpt_nnx", "--config", "debug", "--layers", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(b["name"], b["instances"]) for b in data["block_types"]] == [("blocks/*", 4)]
