"""HLO collective parsing on hand-written HLO text (pure: no compilation)."""
# ruff: noqa: E501  (HLO lines are long by nature)

from __future__ import annotations

import pytest

from autoshard._src.bridge.audit.hlo import (
    array_bytes,
    collectives,
    group_axes,
    parse_replica_groups,
    source_of,
    summarize,
)

MESH = (("data", "model"), (2, 4))

HLO = """
HloModule jit_step, entry_computation_layout={(f32[8,16]{1,0})->f32[8,16]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

%body (p: (s32[], f32[4,16])) -> (s32[], f32[4,16]) {
  %p = (s32[], f32[4,16]{1,0}) parameter(0)
  %gte = f32[4,16]{1,0} get-tuple-element(%p), index=1
  %ar.loop = f32[4,16]{1,0} all-reduce(%gte), channel_id=7, replica_groups=[2,4]<=[8], to_apply=%add, metadata={op_name="jit(step)/while/body/jvp(Net)/layers/dense/dot_general"}
  ROOT %t = (s32[], f32[4,16]{1,0}) tuple(%gte, %ar.loop)
}

%cond (p.1: (s32[], f32[4,16])) -> pred[] {
  %p.1 = (s32[], f32[4,16]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[8,16], b: bf16[32]) -> f32[8,16] {
  %a = f32[8,16]{1,0} parameter(0), metadata={op_name="a"}
  %b = bf16[32]{0} parameter(1)
  %dot.1 = f32[8,16]{1,0} dot(%a, %a), metadata={op_name="jit(step)/jvp(Net)/fc1/dot_general"}
  %ar = f32[8,16]{1,0} all-reduce(%dot.1), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(step)/jvp(Net)/fc1/dot_general"}
  %ag = f32[8,64]{1,0} all-gather(%a), channel_id=2, replica_groups=[2,4]<=[8], dimensions={1}, metadata={op_name="jit(step)/transpose(jvp(Net))/fc2/dot_general"}
  %grad.w = f32[16,16]{1,0} dot(%a, %a), metadata={op_name="jit(step)/transpose(jvp(Net))/fc1/dot_general"}
  %ar.t = (f32[16,16]{1,0}, /*index=1*/bf16[32]{0}) all-reduce(%grad.w, %b), channel_id=3, replica_groups=[1,8]<=[8], to_apply=%add, metadata={op_name="jit(step)/combined"}
  %cp = f32[8,16]{1,0} collective-permute(%a), channel_id=4, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %rs = f32[2,16]{1,0} reduce-scatter(%a), channel_id=5, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, to_apply=%add
  %init = (s32[], f32[4,16]{1,0}) tuple(%b, %a)
  %w = (s32[], f32[4,16]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  ROOT %out = f32[8,16]{1,0} add(%ar, %cp)
}
"""


def test_array_bytes_handles_tuples_comments_and_scalars():
    assert array_bytes("f32[8,16]{1,0}") == [512]
    assert array_bytes("(f32[16,16]{1,0}, /*index=1*/bf16[32]{0}, f32[])") == [1024, 64, 4]
    assert array_bytes("token[]") == [0]


@pytest.mark.parametrize("text,expected", [
    ("{{0,4},{1,5},{2,6},{3,7}}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("{}", [list(range(8))]),
    ("[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("mesh['axis_0'=4,'axis_1'=1,'axis_2'=1,'axis_3'=2], device_ids=([2,4]T(1,0)) {'axis_0'}",
     [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("mesh['a'=2,'b'=4] {'a'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
])
def test_replica_group_forms(text, expected):
    assert parse_replica_groups(text, 8) == expected


def test_group_axes_from_mesh_positions():
    assert group_axes([[0, 4], [1, 5]], *MESH) == ("data",)
    assert group_axes([[0, 1, 2, 3]], *MESH) == ("model",)
    assert group_axes([list(range(8))], *MESH) == ("data", "model")


def test_source_module_and_phase():
    assert source_of("jit(step)/transpose(jvp(GPT))/block_0/attn/q/dot_general") == ("GPT/block_0/attn/q", "backward")
    assert source_of("jit(step)/jvp(GPT)/block_1/fc2/dot_general") == ("GPT/block_1/fc2", "forward")
    assert source_of("jit(step)/optimizer/mul")[1] == "optimizer"


def test_collectives_of_a_module():
    recs = collectives(HLO, *MESH)
    by = {(r.instruction, r.element): r for r in recs}
    ar = by[("ar", 0)]
    assert (ar.kind, ar.bytes, ar.axes, ar.module, ar.phase, ar.count) == (
        "all-reduce", 512, ("data",), "Net/fc1", "forward", 1)
    ag = by[("ag", 0)]
    assert (ag.kind, ag.bytes, ag.axes, ag.phase) == ("all-gather", 2048, ("model",), "backward")  # gathered result
    # a combined tuple all-reduce: one record per element, each with its operand's source
    t0, t1 = by[("ar.t", 0)], by[("ar.t", 1)]
    assert (t0.bytes, t1.bytes, t0.elements, t0.axes) == (1024, 64, 2, ("data", "model"))
    assert t0.module == "Net/fc1" and t0.phase == "backward"
    assert by[("cp", 0)].kind == "collective-permute" and by[("cp", 0)].axes == ("model",)
    rs = by[("rs", 0)]
    assert (rs.kind, rs.bytes, rs.axes) == ("reduce-scatter", 512, ("data",))  # full operand
    loop = by[("ar.loop", 0)]
    assert loop.count == 6 and loop.bytes == 256 and loop.axes == ("model",)  # runs once per trip
    s = summarize(recs)
    assert s["all-reduce@model"] == {"bytes": 6 * 256, "count": 6}
    assert s["all-reduce@data,model"] == {"bytes": 1024 + 64, "count": 1}  # one launch, two elements


def test_ops_outside_modules_belong_to_the_step_function():
    assert source_of("jit(train_step)/jvp()/reduce_sum") == ("train_step", "forward")
