"""A value cut at a region boundary is kept, for the backward pass, in the layouts its backward
readers read (tensor/evaluator.py `_build_tensors`, tensor/memory.py). Under Megatron-LM's sequence
parallelism (Korthikanti et al. 2022, §4.2.2) the vocabulary-parallel embedding's output is
reduce-scattered straight into the sequence-split stream: no backward op reads the whole [B, S, h]
value, so the first pipeline stage keeps one split stream more than a middle stage (the first layer's
input), not the whole embedding output besides (1T on 512 A100s: 105 MB per micro-batch, x64 in flight)."""

from __future__ import annotations

import numpy as np

import autoshard
import models
from autoshard._src.bridge.trace.trace import trace
from autoshard._src.core.cost import AnalyticalCostModel
from autoshard._src.core.hardware import get_hardware
from autoshard._src.joint.space import submesh
from autoshard._src.joint.tables import expert_row, megatron_expert, shape_tables
from autoshard._src.joint.units import build_units
from autoshard._src.tensor.search import SearchOptions, analysis, plan_space, sequence_parallel_analysis

B, S, H, T = 8, 512, 256, 8


def test_embedding_stage_keeps_one_split_stream_more_than_a_layer():
    m = models.get("gpt-gpu", "debug", num_layers=4, d_model=H, num_heads=8, seq_len=S, vocab_size=1024,
                   batch_size=B, dtype="float16")
    g = trace(m.train_step, *m.abstract_state())
    gr = autoshard.group(g)
    an = analysis(g, gr)
    units = build_units(g, gr, an)
    hw, mesh, opts = get_hardware("a100-sxm"), submesh(1, T), SearchOptions(sequence_parallel="on")
    space = plan_space(g, gr, mesh, opts, an)
    sp_space = plan_space(g, gr, mesh, opts, sequence_parallel_analysis(g, gr, an))
    t = shape_tables(space, units, hw, AnalyticalCostModel(mesh, hw), opts, sp_space)
    row = expert_row(sp_space, megatron_expert(mesh, sequence_parallel=True))
    assert not isinstance(row, str), row
    p = t.index(tuple(int(x) for x in row), sequence_parallel=True)
    acts = t.values["acts"][:, 0, p]               # per unit kind, replicated storage
    first, middle = units.kind_of[0], units.kind_of[1]
    assert first != middle
    split_stream = B * S * H * 2 / T                # float16 [B, S/T, h]
    token_ids = B * S * 4                          # int32, read by the embedding's backward (scatter-add)
    np.testing.assert_allclose(acts[first] - acts[middle], split_stream + token_ids, rtol=0.02)
