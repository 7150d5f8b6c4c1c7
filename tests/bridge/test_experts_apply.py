"""The Megatron experts apply to the code users write (issue 19): Flax default module names
(`Dense_0`), `nn.MultiHeadDotProductAttention`, nnx modules and flat dicts of weights. Megatron's
splits come from the program's structure (column-parallel matmul in, row-parallel out), and a flat
dict the optimizer updates is parameters, not data."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import autoshard
import models

MESH = {"data": 2, "model": 4}
opt = optax.adam(1e-3)


def _step(loss):
    def step(params, opt_state, batch):
        value, grads = jax.value_and_grad(loss)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value
    return step


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _specs(name, step, params, batch, mesh=MESH):
    args = _abstract((params, opt.init(params), batch))
    plan = autoshard.expert_plan(name, step, *args, mesh=mesh, hardware="cpu-sim")
    return plan.input_specs[0], plan


def _axes(spec):
    return {a for part in spec if part is not None for a in ((part,) if isinstance(part, str) else part)}


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for width in (256, 128, 256):
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(64)(x)


@pytest.mark.slow
def test_flax_default_names_alternate_column_and_row():
    x = jnp.ones((16, 64))
    params = MLP().init(jax.random.key(0), x)
    step = _step(lambda p, b: jnp.mean((MLP().apply(p, b["x"]) - b["y"]) ** 2))
    specs, _ = _specs("data-megatron", step, params, {"x": x, "y": x})
    k = {name: specs["params"][name]["kernel"] for name in ("Dense_0", "Dense_1", "Dense_2", "Dense_3")}
    assert k["Dense_0"] == P(None, "model") and k["Dense_1"] == P("model", None)   # column, row
    assert k["Dense_2"] == P(None, "model") and k["Dense_3"] == P("model", None)
    assert specs["params"]["Dense_0"]["bias"] == P("model")


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=32)(h, h)
        h = nn.LayerNorm()(x)
        return x + nn.Dense(32)(nn.gelu(nn.Dense(128)(h)))


@pytest.mark.slow
def test_multi_head_dot_product_attention_splits_heads():
    x = jnp.ones((8, 6, 32))
    params = Block().init(jax.random.key(0), x)
    step = _step(lambda p, b: jnp.mean((Block().apply(p, b["x"]) - b["y"]) ** 2))
    specs, plan = _specs("data-megatron", step, params, {"x": x, "y": x}, {"data": 2, "model": 2})
    attn = specs["params"]["MultiHeadDotProductAttention_0"]
    for name in ("query", "key", "value"):
        assert attn[name]["kernel"] == P(None, "model", None), name     # (features, heads, head_dim)
    assert attn["out"]["kernel"] == P("model", None, None)               # (heads, head_dim, features)
    # Dense(32)(gelu(Dense(128)(h))) creates the outer Dense first: Dense_1 is fc1, Dense_0 fc2
    assert specs["params"]["Dense_1"]["kernel"] == P(None, "model")
    assert specs["params"]["Dense_0"]["kernel"] == P("model", None)
    assert _axes(specs["params"]["LayerNorm_0"]["scale"]) == set()


def test_flat_dict_of_weights_is_parameters():
    params = {"w0": jnp.ones((64, 256)), "b0": jnp.zeros((256,)), "w1": jnp.ones((256, 64))}

    def loss(p, b):
        return jnp.mean((jax.nn.relu(b["x"] @ p["w0"] + p["b0"]) @ p["w1"] - b["y"]) ** 2)

    batch = {"x": jnp.ones((32, 64)), "y": jnp.ones((32, 64))}
    graph = autoshard.trace(_step(loss), params, opt.init(params), batch)
    roles = {graph.values[v].keypath: graph.values[v].role for v in graph.inputs}
    assert roles["[0]['w0']"] == roles["[0]['w1']"] == "parameter" and roles["[2]['x']"] == "data"
    specs, _ = _specs("data-parallel", _step(loss), params, batch)
    assert all(_axes(s) == set() for s in specs.values())              # weights replicated, not batch-split
    specs, _ = _specs("megatron", _step(loss), params, batch)
    assert specs["w0"] == P(None, ("data", "model")) and specs["w1"] == P(("data", "model"), None)
    plan = autoshard.plan(_step(loss), *_abstract((params, opt.init(params), batch)), mesh=MESH, hardware="cpu-sim")
    # Megatron applies; Megatron-SP does not (no sequence between the two matmuls), and says so
    lines = plan.explain().splitlines()
    assert "[0]['w0']" in plan.explain()
    assert not [line for line in lines if "not applicable" in line and "megatron-sp" not in line], lines


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt", "gpt_nnx", "bert", "t5"])
def test_megatron_priced_for_every_zoo_transformer(name):
    m = models.get(name, "debug")
    params = jax.eval_shape(m.init, jax.random.key(0))
    args = (params, jax.eval_shape(m.init_opt_state, params), m.batch(abstract=True))
    plan = autoshard.plan(m.train_step, *args, mesh={"data": 2, "model": 2}, hardware="cpu-sim")
    lines = [line for line in plan.explain().splitlines() if "megatron" in line]
    assert len(lines) == 3 and not any("not applicable" in line for line in lines), lines


def test_explain_names_dims_that_cannot_split():
    params = {"w0": jnp.ones((60, 1000)), "w1": jnp.ones((1000, 60))}
    batch = {"x": jnp.ones((30, 60)), "y": jnp.ones((30, 60))}

    def loss(p, b):
        return jnp.mean((jax.nn.relu(b["x"] @ p["w0"]) @ p["w1"] - b["y"]) ** 2)

    args = _abstract((params, opt.init(params), batch))
    text = autoshard.plan(_step(loss), *args, mesh={"data": 4}, hardware="cpu-sim").explain()
    # 30 rows cannot split over 4 devices: said, with what padding would cost
    assert "[2]['x'] dim 0 (size 30) over data (4): padding to 32 would add 6.7% work" in text
    text = autoshard.plan(_step(loss), *args, mesh={"data": 2, "model": 2}, hardware="cpu-sim").explain()
    assert "could not split" not in text                           # everything divides


# the vocabulary and grouped-query attention, found from structure (issue 34) ----------------------

VOCAB, SEQ, WIDTH = 64, 16, 32


def _lm_step(logits_fn):
    ce = optax.softmax_cross_entropy_with_integer_labels
    return _step(lambda p, b: ce(logits_fn(p, b["ids"]), b["labels"]).mean())


def _lm_batch():
    ids = jax.random.randint(jax.random.key(1), (8, SEQ), 0, VOCAB)
    return {"ids": ids, "labels": jnp.roll(ids, -1, axis=1)}


class TinyLM(nn.Module):
    """Token table `table` plus learned positions ("learned": no name says what it is), an FFN, and a
    head: the table's transpose (`tied`) or a Dense named "proj"."""

    table: str = "embed_tokens"
    tied: bool = False

    @nn.compact
    def __call__(self, ids):
        emb = nn.Embed(VOCAB, WIDTH, name=self.table)
        x = emb(ids) + nn.Embed(SEQ, WIDTH, name="learned")(jnp.arange(ids.shape[1]))[None]
        x = x + nn.Dense(WIDTH)(nn.relu(nn.Dense(4 * WIDTH)(x)))
        return emb.attend(x) if self.tied else nn.Dense(VOCAB, name="proj")(x)


class NnxLM(nnx.Module):
    def __init__(self, rngs):
        self.tokens = nnx.Embed(VOCAB, WIDTH, rngs=rngs)
        self.learned = nnx.Embed(SEQ, WIDTH, rngs=rngs)
        self.fc1, self.fc2 = nnx.Linear(WIDTH, 4 * WIDTH, rngs=rngs), nnx.Linear(4 * WIDTH, WIDTH, rngs=rngs)

    def __call__(self, ids):
        x = self.tokens(ids) + self.learned(jnp.arange(ids.shape[1]))[None]
        return self.tokens.attend(x + self.fc2(jax.nn.relu(self.fc1(x))))


def _linen_lm(table, tied):
    model = TinyLM(table, tied)
    return model.init(jax.random.key(0), _lm_batch()["ids"]), _lm_step(lambda p, ids: model.apply(p, ids))


def _nnx_lm():
    graphdef, params = nnx.split(NnxLM(nnx.Rngs(0)))
    return params, _lm_step(lambda p, ids: nnx.merge(graphdef, p)(ids))


def _flat_lm():
    k = jax.random.split(jax.random.key(0), 3)
    params = {"tok": jax.random.normal(k[0], (VOCAB, WIDTH)), "positions": jax.random.normal(k[1], (SEQ, WIDTH)),
              "out": jax.random.normal(k[2], (WIDTH, VOCAB))}

    def logits(p, ids):
        return (jnp.take(p["tok"], ids, axis=0) + jnp.take(p["positions"], jnp.arange(ids.shape[1]), axis=0)) @ p["out"]
    return params, _lm_step(logits)


def _spec_of(specs, *names):
    """The spec of the one leaf whose keypath names all of `names`."""
    hits = [s for k, s in jax.tree_util.tree_flatten_with_path(specs)[0]
            if all(f"'{n}'" in jax.tree_util.keystr(k) for n in names)]
    assert len(hits) == 1, (names, hits)
    return hits[0]


@pytest.mark.parametrize("case", ["embed_tokens", "word_embeddings tied", "nnx.Embed", "flat dict"])
def test_vocabulary_is_found_by_what_reads_it(case):
    if case == "nnx.Embed":
        (params, step), table, pos, head = _nnx_lm(), ("tokens", "embedding"), ("learned", "embedding"), None
    elif case == "flat dict":
        (params, step), table, pos, head = _flat_lm(), ("tok",), ("positions",), ("out",)
    else:
        name, tied = case.split()[0], case.endswith("tied")
        (params, step) = _linen_lm(name, tied)
        table, pos, head = (name, "embedding"), ("learned", "embedding"), None if tied else ("proj", "kernel")
    specs, plan = _specs("data-megatron", step, params, _lm_batch())
    assert _spec_of(specs, *table) == P("model", None)         # its rows: the vocabulary
    assert _axes(_spec_of(specs, *pos)) == set()                # indexed by arange: positions stay whole
    if head is not None:
        assert _spec_of(specs, *head) == P(None, "model")      # an untied head's columns
    assert plan.predicted["memory"]["params"] > 0


def test_positions_passed_in_as_data_stay_whole():
    class WithPositions(nn.Module):
        @nn.compact
        def __call__(self, ids, pos):
            emb = nn.Embed(VOCAB, WIDTH, name="embed_tokens")
            return nn.Dense(VOCAB, name="proj")(emb(ids) + nn.Embed(SEQ, WIDTH, name="learned")(pos))

    batch = {**_lm_batch(), "pos": jnp.broadcast_to(jnp.arange(SEQ), (8, SEQ))}
    m = WithPositions()
    params = m.init(jax.random.key(0), batch["ids"], batch["pos"])

    def loss(p, b):
        return optax.softmax_cross_entropy_with_integer_labels(m.apply(p, b["ids"], b["pos"]), b["labels"]).mean()

    specs, _ = _specs("data-megatron", _step(loss), params, batch)
    assert _spec_of(specs, "embed_tokens", "embedding") == P("model", None)
    # data-indexed too, but its rows (16) are not the logits' (64): not the vocabulary
    assert _axes(_spec_of(specs, "learned", "embedding")) == set()


class GQABlock(nn.Module):
    """Grouped-query attention as Llama/Mistral write it (kv heads repeated to the query heads with
    `jnp.repeat`), then an FFN."""

    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8

    @nn.compact
    def __call__(self, x):
        b, s, d = x.shape
        dense = lambda n, name: nn.Dense(n, use_bias=False, name=name)      # noqa: E731
        q = dense(self.heads * self.head_dim, "q")(x).reshape(b, s, self.heads, self.head_dim)
        k, v = (dense(self.kv_heads * self.head_dim, n)(x).reshape(b, s, self.kv_heads, self.head_dim)
                for n in ("k", "v"))
        k, v = (jnp.repeat(t, self.heads // self.kv_heads, axis=2) for t in (k, v))
        p = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / self.head_dim ** 0.5, axis=-1)
        x = x + dense(d, "o")(jnp.einsum("bhqk,bkhd->bqhd", p, v).reshape(b, s, -1))
        return x + dense(d, "fc2")(nn.relu(dense(4 * d, "fc1")(x)))


@pytest.mark.parametrize("kv_heads,mesh,kv_spec", [
    (2, {"data": 2, "model": 4}, P(None, None)),       # 2 kv heads, 4-way: k/v replicated (Megatron-LM)
    (2, {"data": 4, "model": 2}, P(None, "model")),    # they divide: split with their query heads
    (1, {"data": 2, "model": 4}, P(None, None)),       # multi-query attention
])
def test_grouped_query_attention_splits_query_heads_whatever_the_kv_heads(kv_heads, mesh, kv_spec):
    block = GQABlock(kv_heads=kv_heads)
    x = jax.random.normal(jax.random.key(0), (8, SEQ, WIDTH))
    params = block.init(jax.random.key(1), x)
    step = _step(lambda p, b: jnp.mean((block.apply(p, b["x"]) - b["y"]) ** 2))
    specs, plan = _specs("data-megatron", step, params, {"x": x, "y": x}, mesh)
    p = specs["params"]
    assert p["q"]["kernel"] == P(None, "model") and p["o"]["kernel"] == P("model", None)
    assert p["fc1"]["kernel"] == P(None, "model") and p["fc2"]["kernel"] == P("model", None)
    assert p["k"]["kernel"] == kv_spec and p["v"]["kernel"] == kv_spec


@pytest.mark.slow
def test_grouped_query_attention_with_kv_heads_whole_runs_as_priced():
    # the compiled collectives' bytes and argument memory are the predicted ones (the repeat's local slice
    # forward, its cotangent's all-gather backward), and one step equals the unsharded step
    block = GQABlock(kv_heads=2)
    x = jax.random.normal(jax.random.key(0), (8, SEQ, WIDTH))
    params = block.init(jax.random.key(1), x)
    step = _step(lambda p, b: jnp.mean((block.apply(p, b["x"]) - b["y"]) ** 2))
    args = (params, opt.init(params), {"x": x, "y": x})
    _, plan = _specs("data-megatron", step, params, {"x": x, "y": x})
    report = autoshard.audit(plan, step, *_abstract(args))
    assert not [g for g in report.gaps if g.what.startswith("collective")], report.report()
    assert report.memory["argument"] == pytest.approx(report.predicted_memory["argument"], rel=0.01)
    got = autoshard.autoshard(step, mesh=MESH, hardware="cpu-sim", plan=plan)(*args)
    want = jax.jit(step)(*args)
    # (Adam's first step moves every weight by about its learning rate, 1e-3, whatever its gradient's
    # size: reduction-order noise in a tiny gradient shows there, hence atol 1e-5 on the weights)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_expert_that_cannot_apply_names_the_parameter_dim():
    block = GQABlock(heads=6, kv_heads=2)
    x = jnp.ones((8, SEQ, WIDTH))
    params = block.init(jax.random.key(1), x)
    step = _step(lambda p, b: jnp.mean((block.apply(p, b["x"]) - b["y"]) ** 2))
    with pytest.raises(autoshard.PlanError) as e:
        _specs("data-megatron", step, params, {"x": x, "y": x})
    msg = str(e.value)
    # 6 query heads of the 48-wide projections (o's rows, q's columns) cannot split 4 ways; the kv heads
    # would stay whole
    assert "tensor-parallel dims do not divide axes ('model',) (4 devices): " \
           "[0]['params']['o']['kernel'] dim 0 (and 1 more parameter): of size [6] (parts of the dim of size 48)" in msg
    assert "['k']" not in msg and "Fix: choose a mesh" in msg
