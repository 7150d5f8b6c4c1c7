"""A value cut at a region boundary and also read as produced: emission pins it to its consumed layout, so
the readers that read it as produced move it back, and the evaluator prices that move.

A post-LN encoder layer reads the embedding's output twice: the residual add reads it in the stream (split
along the sequence under Megatron-SP), the query/key/value projections read it whole. The compiled program
gathers it back for them (the audit: tests/bridge/test_fidelity_unseen.py, exact all-gather bytes)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from autoshard._src.bridge.trace.trace import trace
from autoshard._src.core.grouping import group
from autoshard._src.tensor.search import analysis, sequence_parallel_analysis


class _Layer(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(x + nn.MultiHeadDotProductAttention(num_heads=2)(x, x))
        return nn.LayerNorm()(x + nn.Dense(x.shape[-1])(nn.gelu(nn.Dense(32)(x))))


class _Encoder(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 16)(tokens)
        x = _Layer()(_Layer()(x))
        return nn.Dense(64)(x)


def _sp_factor_graph():
    model, opt = _Encoder(), optax.sgd(0.1)
    tokens = jnp.zeros((2, 8), jnp.int32)
    params = model.init(jax.random.key(0), tokens)["params"]

    def step(p, s, x):
        g = jax.grad(lambda p: optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, x),
                                                                                 x).mean())(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    graph = trace(step, params, opt.init(params), tokens)
    grouping = group(graph)
    return graph, sequence_parallel_analysis(graph, grouping, analysis(graph, grouping)).fg


def test_the_embeddings_output_is_cut_for_the_residual_add_only():
    graph, fg = _sp_factor_graph()
    embedded = next(v for v, _, _ in fg.cuts if graph.ops[graph.values[v].producer].module.endswith("Embed_0"))
    cut = fg.cut_readers[embedded]
    readers = {graph.ops[c].primitive for c in graph.values[embedded].consumers if graph.ops[c].phase == "forward"}
    assert {graph.ops[c].primitive for c in cut} == {"add"}          # the residual add reads the split stream
    assert "dot_general" in readers - {graph.ops[c].primitive for c in cut}   # the projections read it whole
