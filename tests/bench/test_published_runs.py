"""bench/published_runs.py: the published table's arithmetic, and one real row end to end (~5 s)."""

import json

import pytest

from bench import published_runs as pr


@pytest.mark.parametrize("run", pr.RUNS, ids=lambda r: r.name)
def test_published_shapes_are_whole(run):
    assert run.dp * run.tp * run.pp == run.gpus
    assert run.microbatches * run.dp * run.mbs == run.gbs
    assert run.layers % run.pp == 0 and run.heads % run.tp == 0


def test_measured_step_round_trips_the_published_throughput():
    sc21 = next(r for r in pr.RUNS if r.name == "SC21 1.7B")
    step = pr.measured_step(sc21)
    assert pr.flops(sc21) / (step * sc21.gpus) == pytest.approx(137e12)
    assert 3.4 < step < 3.7       # 1.55e16 FLOPs (Eq. 3) over 32 GPUs at 137 TFLOP/s
    kort = next(r for r in pr.RUNS if r.name == "KORT 1T full")
    assert pr.measured_step(kort) == 94.42
    assert not any(r.unsupported for r in pr.RUNS)      # every row priced as published (issue 31)


def test_rows_are_priced_with_their_schedule_recompute_and_sequence_parallelism():
    sel = pr.plan_kwargs(next(r for r in pr.RUNS if r.name == "KORT 530B sp+sel"))
    assert sel["schedule"] == "interleaved-1f1b" and sel["pipeline_options"]["virtual_stages"] == 3
    assert sel["pipeline_options"]["remat"] == "selective" and sel["search"]["sequence_parallel"] == "on"
    full = pr.plan_kwargs(next(r for r in pr.RUNS if r.name == "SC21 1008B"))
    assert full["schedule"] == "1f1b" and "virtual_stages" not in full["pipeline_options"]
    assert full["pipeline_options"]["remat"] == "full" and full["search"]["sequence_parallel"] == "off"


@pytest.mark.slow
def test_smallest_row_end_to_end(tmp_path):
    rows = pr.main(["--rows", "SC21 1.7B", "--model", "gpu", "--out-dir", str(tmp_path)])
    (r,) = rows
    assert r["model"] == "gpt-gpu" and (r["tp"], r["pp"], r["dp"], r["microbatches"]) == (1, 1, 32, 1)
    assert r["predicted_s"] > 0 and r["measured_over_predicted"] == pytest.approx(r["measured_s"] / r["predicted_s"])
    assert r["breakdown"]["consistency"] < 1e-6, r["breakdown"]     # the terms add up to the plan's step
    assert sum(r["breakdown"]["terms"].values()) == pytest.approx(r["predicted_s"], rel=1e-6)
    text = (tmp_path / "published_runs.md").read_text()
    for column in ("predicted s", "measured s", "measured/predicted", "pred TFLOP/s", "meas TFLOP/s",
                   "dominant terms"):
        assert column in text
    assert json.loads((tmp_path / "published_runs.json").read_text())["rows"][0]["row"] == "SC21 1.7B"
