"""Options, config files and the command line (issue 29): every option checked at the boundary by
one schema, nothing silently ignored, absurd sizes refused in a second, Ctrl-C is one line and 130."""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import autoshard
import models
from autoshard import ConfigError, MeshError, PipelineError
from autoshard._src.cli import main
from autoshard._src.core.hardware import get_hardware
from autoshard._src.core.mesh import MeshSpec, axis_links, candidate_meshes

ROOT = Path(__file__).resolve().parents[2]
M = models.get("mlp", "debug")
PIPE3D = {"pipe": 2, "data": 2, "model": 2}


def fresh():
    params = M.init(jax.random.key(0))
    return params, M.optimizer.init(params), M.batch()


def toml(tmp: Path, body: str | bytes) -> Path:
    path = tmp / "config.toml"
    path.write_bytes(body if isinstance(body, bytes) else body.encode())
    return path


CASES = [
    # (id, Config.make(config, **kw) arguments from tmp, error, message pattern)
    ("k not an int", lambda t: (None, dict(pipeline="rannc", pipeline_options={"k": "many"})), ConfigError,
     r"k='many' must be an int >= 1"),
    ("prune as the string 'false'", lambda t: (None, dict(pipeline="rannc", pipeline_options={"prune": "false"})),
     ConfigError, r"prune='false' must be True or False"),
    ("negative max_model", lambda t: (None, dict(mesh="auto", devices=8, pipeline_options={"max_model": -1})),
     ConfigError, r"max_model=-1 must be an int >= 1"),
    ("max_model below a fixed mesh's model axis", lambda t: (None, dict(mesh=PIPE3D, pipeline="auto",
                                                                       pipeline_options={"max_model": 1})),
     ConfigError, r"max_model=1 contradicts mesh .*model=2"),
    ("unknown pipeline option", lambda t: (None, dict(pipeline="rannc", pipeline_options={"blocks": 4})),
     ConfigError, r"\['blocks'\] are unknown.*valid: \['k'"),
    ("remat policy unknown", lambda t: (None, dict(mesh="auto", devices=8, pipeline_options={"remat": ["most"]})),
     ConfigError, r"remat=\['most'\] must be one or a non-empty list of \['none', 'selective', 'dots', 'full'\]"),
    ("num_microbatches with graphpipe", lambda t: (None, dict(pipeline="graphpipe", num_microbatches=2)),
     ConfigError, r"num_microbatches=2 with pipeline='graphpipe'.*pipeline='rannc'"),
    ("pipeline_options not a table", lambda t: (None, dict(pipeline="rannc", pipeline_options=[("k", 2)])),
     ConfigError, r"pipeline_options=\[\('k', 2\)\] must be a dict"),
    ("search value mistyped", lambda t: (None, dict(search={"overlap": "1"})), ConfigError,
     r"overlap='1' must be a number in \[0, 1\]"),
    ("TOML binary", lambda t: (toml(t, b"\x00\xff\xfe"), {}), ConfigError, r"config\.toml' is not a text file"),
    ("TOML a directory", lambda t: (t, {}), ConfigError, r"is a directory; give the path of a \.toml file"),
    ("TOML with [options] and [search]", lambda t: (toml(t, "[options]\nmax_plans = 3\n[search]\noverlap = 0.5\n"),
                                                    {}), ConfigError, r"both \[options\] and \[search\]"),
    ("TOML value mistyped", lambda t: (toml(t, 'mesh = "auto"\ndevices = "8"\n'), {}), ConfigError,
     r"devices='8' must be an int >= 1\. \(in config '.*config\.toml'"),
    ("TOML mesh size mistyped", lambda t: (toml(t, '[mesh]\ndata = "2"\n'), {}), MeshError,
     r"'data' has size '2'.*\(in config '.*config\.toml'"),
    ("TOML option mistyped", lambda t: (toml(t, 'pipeline = "rannc"\n[pipeline_options]\nprune = "no"\n'), {}),
     ConfigError, r"prune='no' must be True or False.*config\.toml"),
    ("a billion devices", lambda t: (None, dict(mesh="auto", devices=10**9)), ConfigError,
     r"devices=1000000000 is 1000000000 devices, more than any cluster"),
    ("a mesh of 2**21 devices", lambda t: (None, dict(mesh={"data": 2**21})), ConfigError, r"more than any cluster"),
    ("mesh='auto' on a count with thousands of shapes", lambda t: (None, dict(mesh="auto", devices=55440)),
     ConfigError, r"would price 2192 mesh shapes"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_option_or_file_is_a_typed_error_in_a_second(case, tmp_path):
    _, make, error, pattern = case
    args = fresh()
    config, kw = make(tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(error, match=pattern):
        autoshard.autoshard(M.train_step, config=config, hardware="cpu-sim", **kw)(*args)
    assert time.perf_counter() - t0 < 5
    assert not [x for x in jax.tree.leaves(args) if x.is_deleted()]      # refused before any donation


def test_num_microbatches_is_the_rannc_plans_count():
    """The plan is made for the count the runtime will run (it kept its own 1 before)."""
    args = fresh()
    mesh = {"pipe": 2, "data": 4}
    own = autoshard.plan(M.train_step, *args, mesh=mesh, hardware="cpu-sim", pipeline="rannc")
    asked = autoshard.plan(M.train_step, *args, mesh=mesh, hardware="cpu-sim", pipeline="rannc", num_microbatches=2)
    assert own.microbatches != 2 and asked.microbatches == 2
    assert all(s.microbatches == 2 for s in asked.stages)
    auto = autoshard.plan(M.train_step, *args, mesh={"data": 8}, hardware="cpu-sim", pipeline="auto",
                          num_microbatches=2)
    assert auto.microbatches == 2          # graphpipe chose another count: skipped, on record
    assert "num_microbatches=2" in auto.predicted["pipeline"]["auto"]["skipped"].get("graphpipe", "num_microbatches=2")


def test_a_partitioner_that_ignores_the_count_is_refused():
    from autoshard._src.pipeline.partition import PartitionedStage, PartitionProblem, StagePartition
    from autoshard._src.plan import pipeline_planner

    class Own:
        name = "own"

        def partition(self, problem):
            st = PartitionedStage((0,), (), 1, 8, 1.0, 1.0, 1.0, microbatches=4)
            return StagePartition("own", (st,), None, 1.0, 1.0, 8, 1, 0.0, 1, "blocks")

    problem = PartitionProblem(None, MeshSpec((("data", 8),)), get_hardware("cpu-sim"), None, "1f1b", {},
                               num_microbatches=2)
    with pytest.raises(PipelineError, match=r"num_microbatches=2, but the own partitioner .* \(4\)"):
        pipeline_planner._partition(Own(), problem)


def test_mesh_links_and_factorisations_by_arithmetic():
    """axis_links equals the per-device reference on random meshes (aligned or not) without an array
    per device; a billion devices factorise in well under a second."""
    rng = random.Random(0)
    hw = get_hardware("h100-sxm")
    for _ in range(300):
        sizes = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 4)))
        per_node = rng.randint(1, 12)
        node = np.arange(math.prod(sizes)).reshape(sizes) // per_node
        want = [bool((node.min(axis=i) == node.max(axis=i)).all()) for i in range(len(sizes))]
        links = axis_links(MeshSpec(tuple((f"a{i}", s) for i, s in enumerate(sizes))),
                           get_hardware({"base": "h100-sxm", "devices_per_node": per_node}))
        assert [not link.inter_node for link in links.values()] == want, (sizes, per_node)
    t0 = time.perf_counter()
    big = axis_links(MeshSpec((("pipe", 1000), ("data", 1000), ("model", 8))), hw)
    assert not big["model"].inter_node and big["data"].inter_node
    assert len(candidate_meshes(10**9)) == 2827 and time.perf_counter() - t0 < 2


BAD_FLAGS = [
    (["run", "--microbatches", "2"], "--microbatches", "--pipeline rannc"),
    (["plan", "--recompute"], "--recompute", "--pipeline rannc"),
    (["plan", "--blocks", "4"], "--blocks", "--pipeline rannc"),
    (["plan", "--pipeline", "graphpipe", "--blocks", "4"], "--blocks", "takes no 'k' option"),
    (["plan", "--schedule", "gpipe"], "--schedule", "--pipeline"),
    (["plan", "--devices", "1000000000"], "--devices", "--mesh auto"),
    (["plan", "--layers", "20000"], "--layers", "--max-layers 20000"),
    (["plan", "--set", "num_layers=20000"], "--set", "--max-layers"),
]


@pytest.mark.parametrize("argv, flag, fix", BAD_FLAGS, ids=[" ".join(a) for a, _, _ in BAD_FLAGS])
def test_a_flag_that_would_be_ignored_is_refused(argv, flag, fix, capsys):
    t0 = time.perf_counter()
    code = main(argv)
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and f"argument {flag}" in err[0] and fix in err[0], err
    assert time.perf_counter() - t0 < 10


def test_absurd_device_count_in_the_cli_is_one_line_at_once(capsys):
    assert main(["plan", "gpt", "--config", "debug", "--mesh", "auto", "--devices", "1000000000"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "more than any cluster" in err[0]


def _ctrl_c_default() -> None:
    """A shell starts background jobs with SIGINT ignored, and Python keeps an ignored SIGINT ignored: the
    command under test gets Ctrl-C's default disposition, as at a terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_sigint_in_every_phase_is_one_line_and_130():
    """Ctrl-C while tracing, planning, compiling and stepping: exit 130, the one line, no traceback
    and no crash (it segfaulted 6 of 8 times). The delays land in different phases of `run`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for delay in (2.0, 3.5, 5.0):
        proc = subprocess.Popen([sys.executable, "-m", "autoshard", "run", "--steps", "40"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_default)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        if proc.returncode == 0:          # finished before the signal: a slow start elsewhere cannot fail this
            continue
        assert proc.returncode == 130, (delay, proc.returncode, err[-2000:])
        assert err.splitlines()[-1] == "autoshard run: interrupted" and "Traceback" not in err, err[-2000:]


B4 = {"pipe": 2, "data": 4}


def exit_code(argv: list[str]) -> int:
    """main's code, or argparse's exit code for a flag refused while parsing."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code
SPLITS = [
    # (id, batch size, autoshard() keywords, message pattern)
    ("8 micro-batches of a batch of 4", 4, dict(mesh=B4, pipeline="rannc", num_microbatches=8),
     r"batch size 4 does not split into 8 micro-batches x 4 data-parallel replicas .*num_microbatches among \[1\]"),
    ("batch 6 over 4 replicas", 6, dict(mesh=B4, pipeline="rannc", num_microbatches=4),
     r"num_microbatches=4: batch size 6 cannot be split over the 4 data-parallel replicas \(data\)"),
    ("batch 6 over 4 replicas, count chosen", 6, dict(mesh=B4, pipeline="rannc"),
     r"batch size 6 cannot be split over the 4 data-parallel replicas"),
    ("3-D: 4 micro-batches x data=2 of a batch of 4", 4, dict(mesh=PIPE3D, pipeline="auto", num_microbatches=4),
     r"batch size 4 does not split into 4 micro-batches x 2 .*\(num_microbatches=4; data of mesh pipe=2 x data=2 x "
     r"model=2\).*among \[1, 2\]"),
]


@pytest.mark.parametrize("case", SPLITS, ids=[c[0] for c in SPLITS])
def test_a_batch_the_micro_batches_cannot_cut_is_refused_up_front(case):
    """It was 'no stage split fits the memory budget of 2.9 GB' although the smallest peak is 34 kB."""
    _, size, kw, pattern = case
    params, opt_state, batch = fresh()
    batch = {k: v[:size] for k, v in batch.items()}
    before = jax.tree.map(np.asarray, (params, opt_state, batch))
    t0 = time.perf_counter()
    with pytest.raises(PipelineError, match=pattern):
        autoshard.autoshard(M.train_step, hardware="cpu-sim", **kw)(params, opt_state, batch)
    with pytest.raises(PipelineError, match=pattern):       # planning alone, abstractly: the same refusal
        autoshard.plan(M.train_step, *jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                                   (params, opt_state, batch)), hardware="cpu-sim", **kw)
    assert time.perf_counter() - t0 < 10
    after = (params, opt_state, batch)
    assert not [x for x in jax.tree.leaves(after) if x.is_deleted()]
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, after))


def test_pipelined_names_the_counts_that_split_the_batch():
    params, _, batch = fresh()
    batch = {k: v[:4] for k, v in batch.items()}
    with pytest.raises(PipelineError, match=r"batch size 4 does not split into 8 micro-batches x 4 .*among \[1\]"):
        autoshard.pipelined(M.loss, params, batch, mesh=B4, num_microbatches=8)
    assert not [x for x in jax.tree.leaves((params, batch)) if x.is_deleted()]


def test_out_that_cannot_be_created_is_refused_before_planning(tmp_path, capsys):
    """/proc passes a permission check (and root passes every one): the file itself is opened."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for out, why in (("/proc/nope.json", "No such file or directory"), (str(blocker / "x.json"), "is a file"),
                     (str(tmp_path) + "/", "is a directory")):
        for command in (["plan", "mlp", "--config", "debug"], ["audit", "mlp"]):
            t0 = time.perf_counter()
            assert exit_code([*command, "--out", out]) == 2
            captured = capsys.readouterr()
            err = captured.err.splitlines()
            assert len(err) == 1 and "argument --out" in err[0] and why in err[0], err
            assert captured.out == "" and time.perf_counter() - t0 < 2          # nothing planned
    kept = tmp_path / "plan.json"
    kept.write_text("the user's file")
    new = tmp_path / "new.json"
    from autoshard._src.cli.args import output_path
    assert output_path(str(kept)) == str(kept) and output_path(str(new)) == str(new)
    assert kept.read_text() == "the user's file" and not new.exists()       # probed, never clobbered or left


def test_out_that_fails_when_written_is_one_line(capsys):
    """Writable at parsing, full when written (/dev/full): one line naming --out, the plan printed above."""
    assert main(["plan", "mlp", "--config", "debug", "--hardware", "cpu-sim", "--out", "/dev/full"]) == 2
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert "tensor plan on mesh" in captured.out
    assert "argument --out: could not write '/dev/full'" in err[-1], err       # after the phase timings
    assert not [line for line in err[:-1] if "Traceback" in line or "Error" in line], err


BAD_SETS = [
    ("learning_rate=nan", "must be a finite number"),
    ("learning_rate=inf", "must be a finite number"),
    ("learning_rate=-0.001", "must be >= 0"),
    ("d_model=0", "must be a whole number >= 1"),
    ("num_layers=-2", "must be a whole number >= 1"),
    ("d_model=1099511627776", "must be <= 2147483647"),
    ("seq_len=1e3", "seq_len is int"),
    ("num_heads=3", "cannot be built with num_heads=3: ValueError: d_model=32 not divisible by num_heads=3"),
    ("dtype=float8", "cannot be built with dtype=float8: ValueError: unsupported dtype"),
]


@pytest.mark.parametrize("item, why", BAD_SETS, ids=[s for s, _ in BAD_SETS])
def test_set_values_are_checked_against_the_config_field(item, why, capsys):
    t0 = time.perf_counter()
    assert exit_code(["plan", "gpt", "--config", "debug", "--set", item]) == 2
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert len(err) == 1 and "argument --set" in err[0] and why in err[0], err
    assert captured.out == "" and time.perf_counter() - t0 < 5


def test_set_takes_tuples_and_paddings_of_zero(capsys):
    assert main(["group", "convnet_toy", "--config", "debug", "--set", "channels=4,8", "--set", "paddings=(0, 0)",
                 "--json"]) == 0
    assert '"channels=4,8"' not in capsys.readouterr().out         # parsed as a tuple, not taken as text
    assert exit_code(["group", "convnet_toy", "--config", "debug", "--set", "channels=4"]) == 2
    assert "channels is tuple[int, int] (now (4, 4)); e.g. --set channels=4,4" in capsys.readouterr().err


def _numpy_loaded(pid: int) -> bool:
    try:
        return "numpy" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def test_sigint_while_python_imports_the_package_is_one_line_and_130():
    """Ctrl-C in the first half second (imports, before the command's handler) printed Python's
    KeyboardInterrupt traceback. Once at fixed delays, once as soon as numpy's library is mapped (mid-import,
    certainly past Python's own start-up, which no package code can cover: a signal there is skipped)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for delay in (0.05, 0.1, 0.2, 0.3, "numpy"):
        proc = subprocess.Popen([sys.executable, "-m", "autoshard", "run"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_default)
        if delay == "numpy":
            t0 = time.perf_counter()
            while not _numpy_loaded(proc.pid) and time.perf_counter() - t0 < 20:
                time.sleep(0.001)
        else:
            time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        if proc.returncode != 130 and "autoshard/_src" not in err and delay != "numpy":
            continue          # interrupted in Python's start-up or the package's first lines: not reachable
        assert proc.returncode == 130, (delay, proc.returncode, err[-2000:])
        assert err.splitlines() == ["autoshard run: interrupted"], (delay, err[-2000:])


@pytest.mark.parametrize("options", [{"pipeline": "rannc"}, {"num_microbatches": 4},
                                     {"pipeline_options": {"k": 2}}, {"mesh": "auto"}])
def test_expert_plans_refuse_options_they_would_ignore(options):
    """Expert plans are tensor plans on a fixed mesh: a pipeline option given to one was dropped."""
    args = fresh()
    kw = {"mesh": {"data": 8}, "hardware": "cpu-sim", **options}
    with pytest.raises(ConfigError, match="would be ignored: expert plans are tensor plans|pipeline plans only"):
        autoshard.expert_plan("fsdp", M.train_step, *args, **kw)
    assert not any(x.is_deleted() for x in jax.tree.leaves(args))


def test_pipelined_on_one_stage_says_there_is_nothing_to_pipeline():
    """A pipe axis of 1 crashed in numpy (a reduction over no cuts)."""
    params, _, batch = fresh()
    with pytest.raises(PipelineError, match="pipe=1: one stage, nothing to pipeline"):
        autoshard.pipelined(M.loss, params, batch, mesh={"pipe": 1, "data": 8}, num_microbatches=1)
    assert not any(x.is_deleted() for x in jax.tree.leaves((params, batch)))


def test_sweep_entries_are_typed(tmp_path, capsys):
    """quick = "yes" was taken as true; every entry key has its TOML type now."""
    path = tmp_path / "sweep.toml"
    path.write_text('hardware = "cpu-sim"\n[meshes.compiled]\n"8" = { data = 8 }\n'
                    '[[compiled]]\nname = "mlp"\nconfig = "debug"\nquick = "yes"\n')
    assert main(["sweep", str(path), "--quick"]) != 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "quick = 'yes' must be a TOML bool (true or false)" in err[0], err


@pytest.mark.parametrize("extra", [["--mesh", "data=8"], ["--hardware", "v100-sxm"], ["gpt_nnx"]],
                         ids=["mesh", "hardware", "model"])
def test_explain_of_a_saved_plan_refuses_planning_flags(tmp_path, capsys, extra):
    """explain/plan --plan FILE shows the file's plan: a mesh, hardware or model given beside it was dropped."""
    path = tmp_path / "plan.json"
    assert main(["plan", "mlp", "--config", "debug", "--mesh", "data=8", "--hardware", "cpu-sim",
                 "--out", str(path)]) == 0
    capsys.readouterr()
    assert main(["explain", *extra, "--plan", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "argument --plan" in err[0] and "would be ignored" in err[0], err
    assert main(["explain", "--plan", str(path)]) == 0
