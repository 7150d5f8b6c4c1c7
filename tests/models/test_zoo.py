"""Model zoo contract tests. Real computation on debug configs only; big configs abstractly."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models

from .._reference import run_steps

ALL_PAIRS = [(n, c) for n in models.names() for c in models.configs(n)]


def _shapes(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), tree)


def _init(m):
    return jax.jit(m.init)(jax.random.key(0))  # jit: op-by-op init is several times slower


def _train(m, steps=3, params=None):
    params = _init(m) if params is None else params
    return run_steps(jax.jit(m.train_step), params, jax.jit(m.init_opt_state)(params), m.batch(), steps)[0]


def test_names():
    assert models.names() == sorted(models.names())
    assert {"bert", "gpt", "gpt_nnx", "mlp"} <= set(models.names())
    assert models.configs("gpt") == models.configs("gpt_nnx")


# the five heaviest models train in the slow step (.ci/run); each has its own checks in the default suite
_SLOW_ZOO = {"resnet", "mmt", "wide_classifier", "moe", "dlrm"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW_ZOO else n
                                  for n in models.names()])
@pytest.mark.slow
def test_debug_trains(name):
    m = models.get(name, "debug")
    assert (m.name, m.config_name) == (name, "debug")
    params = _init(m)
    assert _shapes(params) == _shapes(m.abstract_params())
    loss = jax.jit(m.loss)(params, m.batch())
    assert loss.shape == () and loss.dtype == jnp.float32 and np.isfinite(loss)
    losses = _train(m, params=params)
    assert all(np.isfinite(losses)) and losses[0] > losses[1] > losses[2], losses


@pytest.mark.parametrize("name,config", ALL_PAIRS)
def test_config_abstract(name, config):
    m = models.get(name, config)
    assert dataclasses.is_dataclass(m.config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.config.batch_size = 3
    n = m.num_params()
    assert isinstance(n, int) and n > 0
    abstract = m.batch(abstract=True)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    if config == "debug":  # only materialize small batches
        assert _shapes(m.batch()) == _shapes(abstract)


@pytest.mark.parametrize("name", ["gpt", "gpt_nnx"])
@pytest.mark.slow
def test_abstract_train_step(name):
    # The whole step must trace on ShapeDtypeStructs (what autoshard does), without memory.
    m = models.get(name, "gpt2-small")
    params, opt_state, batch = m.abstract_state()
    new_params, new_opt_state, loss = jax.eval_shape(m.train_step, params, opt_state, batch)
    assert _shapes(new_params) == _shapes(params)
    assert _shapes(new_opt_state) == _shapes(opt_state)
    assert loss.shape == () and loss.dtype == jnp.float32


@pytest.mark.parametrize(
    "name,config,expected",
    [("gpt", "gpt2-small", 124e6), ("gpt", "gpt3-175b", 175e9), ("bert", "bert-large", 340e6)],
)
def test_param_counts(name, config, expected):
    n = models.get(name, config).num_params()
    assert abs(n - expected) / expected < 0.02, n


@pytest.mark.parametrize("config", ["debug", "gpt2-small"])
def test_nnx_param_count_matches_linen(config):
    assert models.get("gpt_nnx", config).num_params() == models.get("gpt", config).num_params()


@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_scan_count_matches_unrolled(name):
    # num_params() counts via the scan twin; the unrolled tree must agree.
    for layers in (1, 3):
        m = models.get(name, "debug", num_layers=layers)
        unrolled = sum(x.size for x in jax.tree.leaves(m.abstract_params()))
        scanned = models.get(name, "debug", num_layers=layers, scan_layers=True)
        assert unrolled == scanned.num_params() == m.num_params()


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [dict(scan_layers=True), dict(remat=True), dict(scan_layers=True, remat=True)])
def test_gpt_scan_remat_trains(overrides):
    losses = _train(models.get("gpt", "debug", **overrides))
    assert losses[0] > losses[1] > losses[2], losses


def test_overrides_and_scan_layout():
    m = models.get("gpt", "debug", num_layers=4, scan_layers=True)
    assert m.config.num_layers == 4 and m.config.scan_layers
    p = m.abstract_params()
    assert set(p) == {"wte", "wpe", "blocks", "ln_f"}
    assert p["blocks"]["attn"]["q"]["kernel"].shape == (4, 32, 32)  # stacked on a leading layer axis
    assert models.get("gpt", "debug", d_model=64).config.ff_dim == 256  # d_ff follows d_model


def test_module_names():
    gpt = models.get("gpt", "debug").abstract_params()
    assert set(gpt) == {"wte", "wpe", "block_0", "block_1", "ln_f"}
    assert set(gpt["block_0"]) == {"ln1", "attn", "ln2", "fc1", "fc2"}
    assert set(gpt["block_0"]["attn"]) == {"q", "k", "v", "o"}
    nnx_paths = {tuple(str(getattr(k, "key", k)) for k in path)
                 for path, _ in jax.tree_util.tree_leaves_with_path(models.get("gpt_nnx", "debug").abstract_params())}
    assert ("blocks", "0", "attn", "q", "kernel") in {p[:5] for p in nnx_paths}
    assert {p[0] for p in nnx_paths} == {"wte", "wpe", "blocks", "ln_f"}
    bert = models.get("bert", "debug").abstract_params()
    assert set(bert) == {"word_emb", "pos_emb", "type_emb", "emb_ln", "layer_0", "layer_1",
                         "mlm_dense", "mlm_ln", "mlm_bias"}
    assert set(bert["layer_0"]) == {"attn", "ln1", "fc1", "fc2", "ln2"}
    mlp = models.get("mlp", "debug").abstract_params()
    assert set(mlp) == {f"dense_{i}" for i in range(4)}


@pytest.mark.slow
def test_bfloat16_gpt():
    m = models.get("gpt", "debug", dtype="bfloat16")
    params = _init(m)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    loss = jax.jit(m.loss)(params, m.batch())
    assert loss.dtype == jnp.float32 and np.isfinite(loss)


@pytest.mark.parametrize(
    "args,kwargs,needles",
    [
        (("nope",), {}, ["'nope'", "gpt", "mlp"]),
        (("gpt", "huge"), {}, ["'huge'", "gpt2-small", "debug"]),
        (("gpt", "debug"), {"num_layerz": 3}, ["'num_layerz'", "num_layers", "d_model"]),
    ],
)
def test_get_errors(args, kwargs, needles):
    with pytest.raises(ValueError) as err:
        models.get(*args, **kwargs)
    for needle in needles:
        assert needle in str(err.value)
    with pytest.raises(ValueError, match="nope"):
        models.configs("nope")
