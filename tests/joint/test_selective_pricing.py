"""Selective activation recompute in the 3-D tables (Korthikanti et al. 2022, arXiv:2205.05198 §4):
per unit kind, the forward compute of the attention scores / mask / softmax (`fwd_attn`) and the
bytes of those ops' outputs the backward reads (`acts_attn`), priced on a traced tiny GPT whose
scores tensors ([B, H, S, S]) dwarf everything else (S >> d_model)."""

from __future__ import annotations

import numpy as np
import pytest

import autoshard
import models
from autoshard._src.bridge.trace.trace import trace
from autoshard._src.core.attention import attention_cores, recomputed_ops
from autoshard._src.core.cost import AnalyticalCostModel
from autoshard._src.core.hardware import get_hardware
from autoshard._src.joint.space import submesh
from autoshard._src.joint.stage_choice import REMAT, choice_table, compositions
from autoshard._src.joint.tables import shape_tables
from autoshard._src.joint.units import build_units
from autoshard._src.tensor.search import SearchOptions, analysis, plan_space

H100 = get_hardware("h100-sxm")
B, S, HEADS, LAYERS = 2, 128, 2, 2
F32 = 4


def tables_of(name: str, attention: str = "as_traced", **config):
    m = models.get(name, "debug", **config)
    g = trace(m.train_step, *m.abstract_state())
    gr = autoshard.group(g)
    an = analysis(g, gr)
    units = build_units(g, gr, an)
    mesh, opts = submesh(1, 1), SearchOptions(attention=attention)
    t = shape_tables(plan_space(g, gr, mesh, opts, analysed=an), units, H100, AnalyticalCostModel(mesh, H100), opts)
    return g, units, t


@pytest.fixture(scope="module")
def gpt():
    return tables_of("gpt", seq_len=S, d_model=16, num_heads=HEADS, num_layers=LAYERS, batch_size=B, vocab_size=32)


def _choices(units, t, microbatches=1):
    """(b, held, transient) per remat policy of the whole chain as one stage, plan 0, replicated."""
    comps = np.bincount(units.kind_of, minlength=len(units.kinds))[None, :].astype(float)
    c = compositions(t, comps, np.zeros(len(units.kinds)))
    ct = choice_table(c, microbatches, np.inf, REMAT, np.ones(t.n_plans, dtype=bool), 1.0)
    P, Z, R = ct.shape
    out = {}
    for k in range(P * Z * R):
        flat = int(ct.order[0, k])
        if flat // R == 0:                         # plan 0, storage mode 0
            out[REMAT[flat % R]] = (float(ct.b[0, k]), float(ct.held[0, k]), float(ct.transient[0, k]), k)
    return out


def test_freed_bytes_follow_from_the_shapes(gpt):
    """Once XLA has fused the step, the backward of softmax attention keeps the scores and the
    probabilities (f32 grids: the masking and the exponentials are recomputed from the scores inside
    the backward's fusions) and two [B, H, S] row values (the max and the sum); selective recompute
    frees exactly those, per block."""
    g, units, t = gpt
    grid = B * HEADS * S * S
    per_block = grid * (F32 + F32) + 2 * B * HEADS * S * F32
    np.testing.assert_allclose(t.values["acts_attn"][:, 0, 0], per_block)
    assert len(attention_cores(g)) == LAYERS
    # the recomputed ops are the scores matmul through the softmax, never the values matmul
    for core in attention_cores(g):
        ops = recomputed_ops(g, core)
        assert core.scores in ops and core.values not in ops
        assert {g.ops[i].primitive for i in ops} >= {"dot_general", "exp", "reduce_max", "reduce_sum", "div"}


def test_selective_lies_between_none_and_full(gpt):
    _, units, t = gpt
    ch = _choices(units, t)
    none, sel, full = ch["none"], ch["selective"], ch["full"]
    assert full[1] < sel[1] < none[1]
    acts, attn = t.values["acts"].sum(axis=0)[0, 0], t.values["acts_attn"].sum(axis=0)[0, 0]
    assert none[1] - sel[1] == pytest.approx(attn) and attn > 0.4 * acts     # scores dominate at S >> d
    # the recompute: the attention's forward only, a small part of what 'full' reruns
    extra_sel, extra_full = sel[0] - none[0], full[0] - none[0]
    assert extra_sel == pytest.approx(t.values["fwd_attn"].sum(axis=0)[0, 0]) and 0 < extra_sel < 0.25 * extra_full
    # the recomputed scores of one block at a time are the transient
    assert sel[2] == pytest.approx(t.values["acts_attn"][:, 0, 0].max())


def test_a_budget_between_selective_and_none_chooses_selective(gpt):
    """Memory for the activations minus the scores, not for all of them: selective, the cheapest
    policy that fits (dots and full recompute more)."""
    _, units, t = gpt
    comps = np.bincount(units.kind_of, minlength=len(units.kinds))[None, :].astype(float)
    c = compositions(t, comps, np.zeros(len(units.kinds)))
    valid = np.ones(t.n_plans, dtype=bool)
    static = float(c["static"][0, 0, 0])
    ch = _choices(units, t)
    for room, want in ((ch["none"][1], "none"), (ch["selective"][1] + ch["selective"][2], "selective")):
        ct = choice_table(c, 1, static + 1.01 * room, REMAT, valid, 1.0)
        _, pos = ct.best(np.array([1.0]))
        assert REMAT[int(ct.order[0, pos[0, 0]]) % len(REMAT)] == want


def test_without_attention_selective_is_none_and_never_chosen():
    g, units, t = tables_of("mlp")
    assert not attention_cores(g)
    assert not t.values["fwd_attn"].any() and not t.values["acts_attn"].any()
    ch = _choices(units, t)
    assert ch["selective"][:3] == ch["none"][:3]
    assert ch["none"][3] < ch["selective"][3]          # ties keep 'none' (listed first)


def test_flash_attention_leaves_nothing_to_recompute():
    """FlashAttention saves no grid and recomputes the scores in its own backward: selective is 'none'."""
    _, units, t = tables_of("gpt", "flash", seq_len=S, d_model=16, num_heads=HEADS, num_layers=LAYERS, batch_size=B,
                            vocab_size=32)
    assert not t.values["fwd_attn"].any() and not t.values["acts_attn"].any()


def _live_residuals(fun, params, batch):
    """The arrays the backward of `fun` reads (jax.vjp's residuals the DCE'd backward jaxpr uses)."""
    import jax
    from jax._src.interpreters import partial_eval as pe

    vjp = jax.jit(lambda p, b: jax.vjp(lambda q: fun(q, b), p)[1])(params, batch)     # jitted: not op by op
    closed = jax.make_jaxpr(vjp)(np.float32(1.0))
    _, used = pe.dce_jaxpr(pe.convert_constvars_jaxpr(closed.jaxpr), [True] * len(closed.jaxpr.outvars),
                           instantiate=True)
    return [np.asarray(c) for c, u in zip(closed.consts, used, strict=False) if u]


@pytest.mark.slow
def test_priced_bytes_are_what_jax_saves():
    """jax's own residuals of the same GPT's loss on the [B, H, S, ...] attention grid and rows: under
    'selective' none; under 'none' the f32 grids and rows are as many bytes as priced (`acts_attn`):
    jax saves the exponentials and the probabilities, XLA keeps the scores in place of the
    exponentials (recomputed from them in the backward's fusion) and recomputes the bool causal mask
    from its iota, so the mask is not priced. jax.vjp also hands the backward an all-zero f32 grid per
    block (jnp.where's cotangent fill): a constant in the compiled step, so neither counted nor priced."""
    import jax

    from autoshard._src.bridge.emit.remat import remat_loss

    m = models.get("gpt", "debug", seq_len=S, d_model=16, num_heads=HEADS, num_layers=LAYERS, batch_size=B,
                   vocab_size=32)
    params, batch = jax.jit(m.init)(jax.random.key(0)), m.batch()
    _, _, t = tables_of("gpt", seq_len=S, d_model=16, num_heads=HEADS, num_layers=LAYERS, batch_size=B, vocab_size=32)
    labels = tuple(f"GPT/block_{i}" for i in range(LAYERS))
    on_grid = {}
    for policy in ("none", "selective"):
        res = _live_residuals(remat_loss(m.loss, policy, labels), params, batch)
        on_grid[policy] = sum(r.nbytes for r in res if r.shape[:3] == (B, HEADS, S) and r.dtype != bool and r.any())
    assert on_grid["none"] == t.values["acts_attn"][:, 0, 0].sum() and on_grid["selective"] == 0


def test_forced_selective_without_attention_says_it_runs_as_none():
    m = models.get("mlp", "debug")
    plan = autoshard.plan(m.train_step, *m.abstract_state(), mesh={"pipe": 2, "data": 2}, pipeline="auto",
                          num_microbatches=2, hardware="cpu-sim", pipeline_options={"remat": "selective"})
    assert all(st.remat == "selective" for st in plan.stages)
    notes = [w for w in plan.warnings if "remat 'selective'" in w]
    assert len(notes) == len(plan.stages) and all("runs as 'none'" in w for w in notes)
    assert "runs as 'none'" in plan.explain()
    assert autoshard.Plan.from_json(plan.to_json()).stages[0].remat == "selective"     # a valid policy in files
    gpt = models.get("gpt", "debug")
    plan = autoshard.plan(gpt.train_step, *gpt.abstract_state(), mesh={"pipe": 2, "data": 2}, pipeline="auto",
                          num_microbatches=2, hardware="cpu-sim", pipeline_options={"remat": "selective"})
    assert not [w for w in plan.warnings if "remat 'selective'" in w]
