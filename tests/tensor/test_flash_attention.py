"""attention="flash" (SearchOptions): attention cores priced as FlashAttention-2 runs them, in the tensor
evaluator, the pipeline costs and the 3-D tables; the default prices the program as traced."""

from __future__ import annotations

import math

import numpy as np
import pytest

import autoshard
import models
from autoshard._src.bridge.trace.trace import trace
from autoshard._src.core.attention import attention_cores, priced_fusion
from autoshard._src.core.cost import AnalyticalCostModel
from autoshard._src.core.errors import ConfigError
from autoshard._src.core.fusion import fusion
from autoshard._src.core.hardware import get_hardware
from autoshard._src.core.liveness import live_ops
from autoshard._src.joint.space import submesh
from autoshard._src.joint.tables import shape_tables
from autoshard._src.joint.units import build_units
from autoshard._src.pipeline.atomic import atomic_partition
from autoshard._src.pipeline.costs import PipelineCosts
from autoshard._src.tensor.search import SearchOptions, analysis, plan_space

B, S, HEADS, D_MODEL = 2, 2048, 4, 256
H100 = get_hardware("h100-sxm")


@pytest.fixture(scope="module")
def layer():
    """One GPU-style GPT layer (bf16 compute, jax.nn.dot_product_attention(is_causal=True)) at seq 2048."""
    m = models.get("gpt-gpu", "debug", seq_len=S, num_layers=1, d_model=D_MODEL, num_heads=HEADS, batch_size=B)
    args = m.abstract_state()
    return m, args, trace(m.train_step, *args)


def _plan(m, args, attention):
    return autoshard.plan(m.train_step, *args, mesh={"data": 1, "model": 1}, hardware="h100-sxm",
                          search={"attention": attention}).predicted


def _saved_grid_bytes(g) -> float:
    """Bytes of the [B, H, S, S] forward values the traced backward reads (what the program saves)."""
    live, grid = live_ops(g), B * HEADS * S * S
    return float(sum(g.values[v].nbytes for op in g.ops if live[op.index] and op.phase == "forward"
                     for v in op.outputs if math.prod(g.values[v].shape) == grid
                     and any(g.ops[c].phase == "backward" for c in g.values[v].consumers)))


def test_flash_drops_the_grid_activations_and_the_step_time(layer):
    m, args, g = layer
    traced, flash = _plan(m, args, "as_traced"), _plan(m, args, "flash")
    drop = traced["memory"]["activations"] - flash["memory"]["activations"]
    grid = _saved_grid_bytes(g)
    assert grid > 0.5 * traced["memory"]["activations"]          # the scores dominate at seq 2048
    (core,) = attention_cores(g)
    small = 8 * B * HEADS * S * 4 + g.values[core.out].nbytes     # row statistics, the log-sum-exp and O
    # the backward's working set loses its [B, H, S, S] matmul result (dP) too
    dp = max(g.values[v].nbytes for i in core.backward if g.ops[i].primitive == "dot_general"
             for v in g.ops[i].outputs if math.prod(g.values[v].shape) == B * HEADS * S * S)
    assert grid - small <= drop <= grid + dp
    assert flash["step_time"] < 0.7 * traced["step_time"]


def test_the_default_is_the_traced_program(layer):
    m, args, g = layer
    assert SearchOptions().attention == "as_traced"
    assert priced_fusion(g, True) is fusion(g, gpu=True)
    a = _plan(m, args, "as_traced")
    b = autoshard.plan(m.train_step, *args, mesh={"data": 1, "model": 1}, hardware="h100-sxm").predicted
    for key in ("step_time", "memory", "breakdown"):
        assert a[key] == b[key]


def test_flash_kernels_bytes_and_flops(layer):
    """FlashAttention-2's IO (Algorithms 1 and 2) and flops (causal: half; backward: 2.5x the forward)."""
    _, _, g = layer
    (core,) = attention_cores(g)
    fz, flash = fusion(g, gpu=True), priced_fusion(g, True, "flash")
    ops = set(core.forward) | set(core.backward)
    assert flash.launches[list(ops)].sum() == 3                   # forward 1, backward 2
    assert flash.kernels() < fz.kernels()
    qkv = sum(g.values[v].nbytes for v in (core.q, core.k, core.v))
    o, lse = g.values[core.out].nbytes, B * HEADS * S * 4
    fwd = flash.bytes[list(core.forward)].sum()
    assert fwd == pytest.approx(qkv + o + lse)
    assert flash.bytes[list(ops)].sum() < 0.1 * fz.bytes[list(ops)].sum()
    fwd_flops = sum(g.ops[i].flops * flash.scale[i] for i in core.forward)
    bwd_flops = sum(g.ops[i].flops * flash.scale[i] for i in core.backward)
    dense = 4 * B * HEADS * S * S * (D_MODEL // HEADS)          # the two forward matmuls, uncausal
    assert fwd_flops == pytest.approx(dense / 2)
    assert bwd_flops == pytest.approx(2.5 * dense / 2)
    # no grid value is saved; the log-sum-exp is
    assert all(math.prod(g.values[v].shape) != B * HEADS * S * S for v, _ in flash.kept)
    assert core.lse in {v for v, _ in flash.kept}


def test_pipeline_costs_see_flash(layer):
    _, _, g = layer
    atomic = atomic_partition(g)
    everything = range(len(atomic))
    traced, flash = (PipelineCosts(atomic, H100, attention=a).totals(everything) for a in ("as_traced", "flash"))
    assert flash["act"] < traced["act"] - 0.9 * _saved_grid_bytes(g)
    assert flash["fwd"] + flash["bwd"] < 0.7 * (traced["fwd"] + traced["bwd"])
    assert PipelineCosts(atomic, H100).totals(range(len(atomic))) == traced


def test_3d_tables_see_flash(layer):
    _, _, g = layer
    gr = autoshard.group(g)
    an = analysis(g, gr)
    units = build_units(g, gr, an)
    mesh = submesh(1, 2)
    acts = {}
    for att in ("as_traced", "flash"):
        opts = SearchOptions(attention=att)
        t = shape_tables(plan_space(g, gr, mesh, opts, analysed=an), units, H100, AnalyticalCostModel(mesh, H100), opts)
        acts[att] = (t.values["acts"].sum(axis=0).min(), t.values["fwd"].sum(axis=0).min())
    assert acts["flash"][0] < acts["as_traced"][0] - 0.4 * _saved_grid_bytes(g)     # split over model 2 at most
    assert acts["flash"][1] < acts["as_traced"][1]


def test_the_option_is_checked():
    with pytest.raises(ConfigError, match="attention"):
        SearchOptions(attention="cudnn")
    with pytest.raises(ConfigError, match="attention"):
        autoshard.Config.make(mesh={"data": 1}, search={"attention": "fast"})
    assert np.isfinite(SearchOptions(attention="flash").overlap)
