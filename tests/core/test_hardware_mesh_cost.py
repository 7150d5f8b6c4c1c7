"""Hardware presets, mesh specs and the analytical cost model: formulas and typed errors (no jax)."""

from __future__ import annotations

import dataclasses
import itertools
import types

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from autoshard._src.core.cost import (
    KINDS,
    AnalyticalCostModel,
    CostModel,
    bytes_on_wire,
    latency_steps,
    overlapped,
    pack_gradients,
)
from autoshard._src.core.errors import AutoshardError, ConfigError, HardwareError, MeshError
from autoshard._src.core.hardware import HardwareSpec, get_hardware, hardware_dict, presets
from autoshard._src.core.mesh import Link, MeshSpec, axis_links, candidate_meshes, mesh_spec

GB = 1e9


# ---- collective formulas ---------------------------------------------------------------------------

def test_ring_bytes_on_wire():
    assert bytes_on_wire("all-reduce", GB, 8) == pytest.approx(1.75 * GB)
    assert bytes_on_wire("all-gather", GB, 8) == pytest.approx(0.875 * GB)
    assert bytes_on_wire("reduce-scatter", GB, 8) == pytest.approx(0.875 * GB)
    assert bytes_on_wire("all-to-all", GB, 8) == pytest.approx(0.875 * GB)
    assert bytes_on_wire("collective-permute", GB, 8) == GB
    for kind in KINDS:
        assert bytes_on_wire(kind, GB, 1) == 0.0
        assert latency_steps(kind, 1) == 0


def test_latency_steps():
    assert [latency_steps(k, 8) for k in KINDS] == [14, 7, 7, 7, 1]


def test_unknown_kind_names_it_and_the_valid_ones():
    with pytest.raises(ConfigError, match="'allreduce'.*all-reduce") as info:
        bytes_on_wire("allreduce", GB, 8)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ConfigError, match="n=0"):
        bytes_on_wire("all-reduce", GB, 0)


# ---- hardware ---------------------------------------------------------------------------------------

def test_presets_are_valid_with_positive_numbers_and_sources():
    names = presets()
    assert names == sorted(names)
    assert {"h100-sxm", "a100-sxm", "v100-sxm", "v100-sxm-nvlink25", "v100-sxm-eth32", "cpu-sim"} <= set(names)
    for name in names:
        hw = get_hardware(name)
        assert hw.name == name and len(hw.source) > 40
        for dtype in ("float32", "bfloat16", "float16"):
            assert hw.peak_flops(dtype) > 0
        assert hw.memory_bytes > 0 and hw.memory_bandwidth > 0 and hw.devices_per_node >= 1
        assert hw.intra_node_bandwidth > 0 and hw.inter_node_bandwidth > 0
        assert hw.intra_node_latency >= 0 and hw.inter_node_latency >= 0
        assert set(hw.collective_efficiency) == set(KINDS)
        assert all(0 < e <= 1 for e in hw.collective_efficiency.values())
        assert 0 < hw.compute_efficiency <= 1
        assert hw.inter_node_bandwidth <= hw.intra_node_bandwidth
        hash(hw)   # usable as a cache key


def test_preset_numbers():
    h100, a100 = get_hardware("h100-sxm"), get_hardware("a100-sxm")
    assert h100.peak_flops("bfloat16") == pytest.approx(989.4e12)
    assert a100.peak_flops("bfloat16") == pytest.approx(312e12)
    assert "TF32" in h100.source and "dense" in h100.source
    assert get_hardware("v100-sxm").intra_node_bandwidth == 50e9
    assert get_hardware("v100-sxm-nvlink25").intra_node_bandwidth == 25e9
    eth = get_hardware("v100-sxm-eth32")
    assert eth.inter_node_bandwidth == 4e9 < get_hardware("v100-sxm").inter_node_bandwidth
    assert "not a performance model" in get_hardware("cpu-sim").source.lower()


def test_peak_flops_unknown_dtype_falls_back_to_float32():
    hw = get_hardware("h100-sxm")
    assert hw.peak_flops("int8") == hw.peak_flops("float32")
    assert hw.peak_flops(np.dtype("float16")) == hw.peak_flops("float16")
    assert hw.peak_flops(np.float16) == hw.peak_flops("float16")


def test_get_hardware_overrides():
    hw = get_hardware({"base": "h100-sxm", "memory_bytes": 40e9})
    assert hw.memory_bytes == 40 * 10**9 and isinstance(hw.memory_bytes, int)
    assert hw.intra_node_bandwidth == get_hardware("h100-sxm").intra_node_bandwidth
    assert "memory_bytes" in hw.source
    merged = get_hardware({"base": "a100-sxm", "flops": {"float32": 19.5e12}})
    assert merged.peak_flops("float32") == 19.5e12 and merged.peak_flops("bfloat16") == 312e12
    spec = get_hardware("cpu-sim")
    assert get_hardware(spec) is spec
    full = {f.name: getattr(spec, f.name) for f in dataclasses.fields(HardwareSpec)}
    assert get_hardware(full) == spec


def test_get_hardware_errors():
    with pytest.raises(HardwareError, match="'tpu-v9'") as info:
        get_hardware("tpu-v9")
    msg = str(info.value)
    assert "h100-sxm" in msg and "base" in msg   # lists valid names and how to pass numbers
    assert isinstance(info.value, AutoshardError) and isinstance(info.value, ValueError)
    with pytest.raises(HardwareError, match="'hbm_bytes'"):
        get_hardware({"base": "h100-sxm", "hbm_bytes": 1})
    with pytest.raises(HardwareError, match="'nope'"):
        get_hardware({"base": "nope"})
    with pytest.raises(HardwareError, match="base"):
        get_hardware({"memory_bytes": 1})
    with pytest.raises(HardwareError, match="int"):
        get_hardware(3)
    with pytest.raises(HardwareError, match="memory_bytes=0"):
        get_hardware({"base": "h100-sxm", "memory_bytes": 0})
    with pytest.raises(HardwareError, match="intra_node_bandwidth"):
        get_hardware({"base": "h100-sxm", "intra_node_bandwidth": -1.0})
    with pytest.raises(HardwareError, match="all-to-all"):
        get_hardware({"base": "h100-sxm", "collective_efficiency": {"all-to-all": 1.5}})



def test_bbgrap_desktop_preset():
    hw = get_hardware("i5-10400-1gbe")
    assert hw.devices_per_node == 1 and hw.node_speeds is None
    assert hw.peak_flops("float32") == pytest.approx(6 * 2.9e9 * 32)     # cores x base clock x AVX2 FMA
    assert hw.peak_flops("bfloat16") == hw.peak_flops("float32")         # no bf16 units on Comet Lake
    assert hw.inter_node_bandwidth == 125e6                              # 1 Gb/s
    assert hw.memory_bandwidth == 41.6e9 and 0 < hw.inter_node_latency < 1e-3
    assert hw.collective_efficiency["collective-permute"] == pytest.approx(1448 / 1538, abs=0.01)
    for cite in ("BBGraP", "i5-10400", "AVX2", "gigabit", "assum"):
        assert cite in hw.source


def test_node_speeds_normalised_and_kept_through_get_hardware():
    base = get_hardware("cpu-sim")
    assert base.node_speeds is None
    hw = get_hardware({"base": "cpu-sim", "node_speeds": [2, 1, 1.5]})
    assert hw.node_speeds == (2.0, 1.0, 1.5) and all(type(s) is float for s in hw.node_speeds)
    assert "node_speeds" in hw.source
    assert dataclasses.replace(base, node_speeds=np.array([1, 3])).node_speeds == (1.0, 3.0)
    assert hash(hw) != hash(base) and hw != base
    assert get_hardware({"base": hw, "node_speeds": None}).node_speeds is None
    # a full dict without node_speeds still works (the field has a default)
    full = {f.name: getattr(base, f.name) for f in dataclasses.fields(HardwareSpec) if f.name != "node_speeds"}
    assert get_hardware(full) == base


@pytest.mark.parametrize("name", ["cpu-sim", "i5-10400-1gbe", "h100-sxm"])
@pytest.mark.parametrize("speeds", [None, (2.0, 1.0, 1.0, 1.0), (0.25,)])
def test_hardware_dict_round_trip_is_lossless(name, speeds):
    import json

    hw = dataclasses.replace(get_hardware(name), node_speeds=speeds)
    data = hardware_dict(hw)
    assert get_hardware(data) == hw
    again = get_hardware(json.loads(json.dumps(data)))
    assert again == hw and again.node_speeds == hw.node_speeds and hash(again) == hash(hw)
    assert hardware_dict(again) == data


def test_hardware_dict_round_trip_keeps_the_gemm_constants():
    import json

    hw = get_hardware({"base": "a100-sxm", "kernels": {"sms": 108, "mma_efficiency": 0.7, "k_overhead": 256}})
    again = get_hardware(json.loads(json.dumps(hardware_dict(hw))))
    assert again.kernels == hw.kernels and (again.kernels.mma_efficiency, again.kernels.k_overhead) == (0.7, 256)
    assert hardware_dict(get_hardware("h100-sxm"))["kernels"]["mma_efficiency"] == 0.75


@pytest.mark.parametrize(("speeds", "match"), [
    ((1.0, 0.0), r"node_speeds\[1\]=0\.0 must be a finite number > 0"),
    ((1.0, -2.0), r"node_speeds\[1\]=-2\.0"),
    ((float("inf"),), r"node_speeds\[0\]=inf"),
    ((float("nan"), 1.0), r"node_speeds\[0\]=nan"),
    ((True, 1.0), r"node_speeds\[0\]=True"),
    (("2", 1.0), r"node_speeds\[0\]='2'"),
    ((), r"node_speeds=\(\) is empty"),
    ("fast", r"node_speeds='fast' is not a sequence"),
    (2.0, r"node_speeds=2\.0 is not a sequence"),
    ({"a": 1.0}, r"is not a sequence"),
])
def test_node_speeds_errors_name_the_value_and_the_fix(speeds, match):
    with pytest.raises(HardwareError, match=match) as info:
        get_hardware({"base": "cpu-sim", "node_speeds": speeds})
    assert "one finite number > 0 per node" in str(info.value) and "None" in str(info.value)
    assert isinstance(info.value, ConfigError)

# ---- meshes -----------------------------------------------------------------------------------------

def test_mesh_spec_from_dict_and_duck_typed_mesh():
    m = mesh_spec({"data": 2, "model": 4})
    assert m.names == ("data", "model") and m.sizes == (2, 4) and m.size == 8
    assert m.axis_size("model") == 4 and m.to_dict() == {"data": 2, "model": 4}
    assert str(m) == "data=2 x model=4"
    assert mesh_spec(m) is m
    fake = types.SimpleNamespace(axis_names=("x", "y"), shape={"y": 4, "x": np.int64(2)})  # like jax Mesh
    assert mesh_spec(fake) == MeshSpec((("x", 2), ("y", 4)))


@pytest.mark.parametrize("mesh, match", [
    ({"data": 0}, "'data' has size 0"),
    ({"data": 2.0}, "'data' has size 2.0"),
    ({"data": True}, "'data' has size True"),
    ({}, "at least one"),
    ({"": 2}, "non-empty"),
    ("data=2", "not a mesh"),
])
def test_mesh_errors(mesh, match):
    with pytest.raises(MeshError, match=match) as info:
        mesh_spec(mesh)
    assert isinstance(info.value, ValueError)


def test_duplicate_axis_names():
    with pytest.raises(MeshError, match="'a' appears twice"):
        MeshSpec((("a", 2), ("a", 4)))
    with pytest.raises(MeshError, match="'b'.*valid axes"):
        mesh_spec({"a": 2}).axis_size("b")


def test_candidate_meshes():
    found = candidate_meshes(8)
    sizes = [m.sizes for m in found]
    assert {(8,), (4, 2), (2, 4), (2, 2, 2)} <= set(sizes)
    assert len(sizes) == len(set(sizes))
    assert all(m.size == 8 for m in found)
    assert all(m.names == tuple(f"a{i}" for i in range(len(m.sizes))) for m in found)
    assert all(s >= 2 for m in found for s in m.sizes)
    assert found == candidate_meshes(8)
    assert [m.sizes for m in candidate_meshes(1)] == [(1,)]
    assert [m.sizes for m in candidate_meshes(8, max_axes=1)] == [(8,)]
    assert all(m.size == 12 and len(m.sizes) <= 3 for m in candidate_meshes(12))
    with pytest.raises(MeshError, match="devices=0"):
        candidate_meshes(0)


def test_axis_links_intra_vs_inter_node():
    hw = get_hardware("h100-sxm")
    links = axis_links({"node": 2, "gpu": 8}, hw)
    assert links["gpu"] == Link(hw.intra_node_bandwidth, hw.intra_node_latency, inter_node=False)
    assert links["node"] == Link(hw.inter_node_bandwidth, hw.inter_node_latency, inter_node=True)
    assert axis_links({"a": 16}, hw)["a"].inter_node
    assert not axis_links({"a": 8}, hw)["a"].inter_node
    # the first axis has stride 4: groups {0,4} stay in a node; the second (stride 1, size 4) too
    assert not any(link.inter_node for link in axis_links({"x": 2, "y": 4}, hw).values())
    # stride 8: the "outer" axis crosses nodes even though it is small
    assert axis_links({"outer": 2, "inner": 8, "one": 1}, hw)["outer"].inter_node
    assert not axis_links({"outer": 2, "inner": 8, "one": 1}, hw)["one"].inter_node


# ---- cost model -------------------------------------------------------------------------------------

def test_all_gather_slower_per_wire_byte_than_all_reduce():
    cost = AnalyticalCostModel({"gpu": 8}, "h100-sxm")
    t_ar = cost.collective("all-reduce", GB, ["gpu"])
    t_ag = cost.collective("all-gather", 2 * GB, ["gpu"])   # same bytes on the wire: 1.75 GB
    assert t_ag > t_ar
    assert cost.collective("all-to-all", 2 * GB, ["gpu"]) > t_ag


def test_collective_time_formula():
    hw = get_hardware("h100-sxm")
    cost = AnalyticalCostModel({"gpu": 8}, hw)
    expected = 14 * hw.intra_node_latency + 1.75 * GB / (hw.intra_node_bandwidth
                                                         * hw.collective_efficiency["all-reduce"])
    assert cost.collective("all-reduce", GB, ("gpu",)) == pytest.approx(expected)
    assert cost.collective("all-reduce", GB, "gpu") == pytest.approx(expected)   # a lone axis name


def test_inter_node_axis_slower_than_intra_node():
    cost = AnalyticalCostModel({"node": 2, "gpu": 2}, "h100-sxm")   # 4 devices in one node: both intra
    assert not any(link.inter_node for link in cost.links.values())
    # same group size 2 and bytes: "node" (stride 8) crosses nodes, "pair" (stride 1) does not
    for hw in ("h100-sxm", "a100-sxm", "v100-sxm", "v100-sxm-eth32"):
        cross = AnalyticalCostModel({"node": 2, "gpu": 8}, hw).collective("all-reduce", GB, ["node"])
        local = AnalyticalCostModel({"rest": 8, "pair": 2}, hw).collective("all-reduce", GB, ["pair"])
        assert cross > 2 * local
    eth = AnalyticalCostModel({"node": 2, "gpu": 8}, "v100-sxm-eth32")
    assert eth.collective("all-gather", GB, ["node"]) > 5 * eth.collective("all-gather", GB, ["gpu"])


def test_multi_axis_collective_uses_the_bottleneck():
    hw = get_hardware("h100-sxm")
    cost = AnalyticalCostModel({"node": 2, "gpu": 8}, hw)
    eff = hw.collective_efficiency["all-reduce"]
    expected = 30 * hw.inter_node_latency + bytes_on_wire("all-reduce", GB, 16) / (hw.inter_node_bandwidth * eff)
    assert cost.collective("all-reduce", GB, ["node", "gpu"]) == pytest.approx(expected)
    assert cost.collective("all-reduce", GB, ["node", "gpu"]) > cost.collective("all-reduce", GB, ["node"])


def test_trivial_collectives_are_free_and_bad_axes_named():
    cost = AnalyticalCostModel({"data": 8, "one": 1}, "cpu-sim")
    assert cost.collective("all-reduce", GB, []) == 0.0
    assert cost.collective("all-reduce", GB, ["one"]) == 0.0
    assert cost.collective("all-reduce", GB, ["one", "data"]) == cost.collective("all-reduce", GB, ["data"])
    with pytest.raises(ConfigError, match="'model'.*'data'"):
        cost.collective("all-reduce", GB, ["model"])
    with pytest.raises(ConfigError, match="'psum'"):
        cost.collective("psum", GB, ["data"])
    with pytest.raises(ConfigError, match="repeat"):
        cost.collective("all-reduce", GB, ["data", "data"])


def test_roofline_picks_the_max():
    hw = get_hardware("a100-sxm")
    cost = AnalyticalCostModel({"d": 8}, hw)
    t_flops = 1e15 / (hw.peak_flops("bfloat16") * hw.compute_efficiency)
    assert cost.compute(1e15, 1e6, "bfloat16") == pytest.approx(t_flops)          # compute-bound
    assert cost.compute(1e6, 1e12, "bfloat16") == pytest.approx(1e12 / hw.memory_bandwidth)  # memory-bound
    assert cost.compute(1e12, 0) > cost.compute(1e12, 0, "bfloat16")             # float32 (TF32) is slower


def test_cost_model_protocol():
    cost = AnalyticalCostModel({"d": 8}, "cpu-sim")
    assert isinstance(cost, CostModel)
    assert not isinstance(object(), CostModel)
    assert "d=8" in repr(cost)


def test_overlapped():
    assert overlapped(3.0, 1.0) == 2.0
    assert overlapped(1.0, 3.0) == 0.0
    assert overlapped(3.0, 2.0, overlap=0.5) == 2.0
    assert overlapped(3.0, 2.0, overlap=0.0) == 3.0
    with pytest.raises(ConfigError, match="overlap=1.5"):
        overlapped(1.0, 1.0, overlap=1.5)


# ---- gradient packing -------------------------------------------------------------------------------

def test_pack_gradients_examples():
    assert pack_gradients([], 10) == []
    assert pack_gradients([3, 3, 3, 3], 10) == [9, 3]
    assert pack_gradients([3, 20, 3, 10, 4], 10) == [3, 20, 3, 10, 4]   # big ones close the bucket
    assert pack_gradients([5, 5, 5], 10) == [10, 5]
    assert sum(pack_gradients([100] * 1000)) == 100_000 and len(pack_gradients([100] * 1000)) == 1
    with pytest.raises(ConfigError, match=r"grad_bytes\[1\]=-1"):
        pack_gradients([1, -1])
    with pytest.raises(ConfigError, match="bucket_bytes=0"):
        pack_gradients([1], 0)


@given(st.lists(st.integers(0, 200), max_size=60), st.integers(1, 100))
def test_pack_gradients_properties(grads, bucket):
    messages = pack_gradients(grads, bucket)
    assert sum(messages) == sum(grads)
    # order kept: every message is a contiguous run of gradients, so its end is a gradient prefix sum
    assert set(itertools.accumulate(messages)) <= set(itertools.accumulate(grads))
    big = [g for g in grads if g >= bucket]
    assert [m for m in messages if m > bucket] == [g for g in big if g > bucket]
    assert len(messages) >= len(big)
    if grads:
        assert len(messages) <= len(grads)
    # fusion is greedy: two neighbouring buckets of small gradients could not have been one
    small_only = all(g < bucket for g in grads)
    if small_only:
        assert all(a + b > bucket for a, b in itertools.pairwise(messages))
        assert len(messages) <= 2 * sum(grads) / bucket + 1
