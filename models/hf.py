"""Hugging Face transformers' Flax models as unmodified client code (issue 34): tiny random configs (no
downloads) and the ordinary optax step a user writes around them. Needs the `hf` extra
(`pip install -e .[hf]`, transformers 4.46.3); not registered in the zoo (`import models.hf`).

    step, args = models.hf.build("gpt2")            # gpt2, llama, mistral, gemma, bert, t5
    with models.hf.t5_compat():                      # only T5 needs it (see t5_compat)
        plan = autoshard.plan(step, *args, mesh={"data": 2, "model": 4})
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

NAMES = ("gpt2", "llama", "mistral", "gemma", "bert", "t5")
VOCAB, HIDDEN, HEADS, LAYERS = 256, 64, 8, 2


def _model(name: str, seq: int) -> Any:
    import transformers as T

    common = dict(vocab_size=VOCAB, max_position_embeddings=64)
    if name == "gpt2":
        cfg = T.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS)
        return T.FlaxGPT2LMHeadModel(cfg, seed=0, input_shape=(1, seq))
    if name in ("llama", "mistral", "gemma"):
        kv = {"llama": HEADS, "mistral": HEADS // 2, "gemma": 1}[name]      # MHA, GQA, MQA
        cls, conf = {"llama": (T.FlaxLlamaForCausalLM, T.LlamaConfig),
                     "mistral": (T.FlaxMistralForCausalLM, T.MistralConfig),
                     "gemma": (T.FlaxGemmaForCausalLM, T.GemmaConfig)}[name]
        extra = {"head_dim": HIDDEN // HEADS} if name == "gemma" else {}
        cfg = conf(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                   num_attention_heads=HEADS, num_key_value_heads=kv, **common, **extra)
        return cls(cfg, seed=0, input_shape=(1, seq))
    if name == "bert":
        cfg = T.BertConfig(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                           intermediate_size=2 * HIDDEN, **common)
        return T.FlaxBertForMaskedLM(cfg, seed=0, input_shape=(1, seq))
    if name == "t5":
        cfg = T.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=2 * HIDDEN,
                         num_layers=LAYERS, num_heads=HEADS)
        with t5_compat():
            return T.FlaxT5ForConditionalGeneration(cfg, seed=0, input_shape=(1, seq))
    raise ValueError(f"models.hf.build: name={name!r} is not one of {NAMES}")


@contextlib.contextmanager
def t5_compat() -> Iterator[None]:
    """transformers 4.46.3's FlaxT5 calls `jnp.clip(x, a_max=...)`, keywords jax 0.10 removed: while
    this is active they mean min / max again (for T5's tracing; nothing else changes)."""
    clip = jnp.clip

    def compat_clip(x: Any, min: Any = None, max: Any = None, *, a_min: Any = None, a_max: Any = None) -> Any:
        return clip(x, a_min if min is None else min, a_max if max is None else max)

    jnp.clip = compat_clip
    try:
        yield
    finally:
        jnp.clip = clip


def build(name: str, batch: int = 8, seq: int = 16, optimizer: Any = None) -> tuple[Callable, tuple]:
    """(step, (params, opt_state, batch)) for HF model `name`: `jax.value_and_grad` of softmax cross-entropy
    on the model's logits, then the optimizer (default adamw) — the step of HF's Flax training scripts."""
    model = _model(name, seq)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, VOCAB, (batch, seq)), jnp.int32)
    labels = jnp.asarray(rng.integers(0, VOCAB, (batch, seq)), jnp.int32)
    data = {"input_ids": ids, "labels": labels}
    if name == "t5":
        data["decoder_input_ids"] = labels

    def logits_of(params: Any, b: dict) -> Any:
        if name == "t5":
            return model(b["input_ids"], decoder_input_ids=b["decoder_input_ids"], params=params, train=False).logits
        return model(b["input_ids"], params=params, train=False).logits

    opt = optimizer if optimizer is not None else optax.adamw(1e-3)

    def step(params: Any, opt_state: Any, b: dict) -> tuple:
        def loss(p: Any) -> Any:
            return optax.softmax_cross_entropy_with_integer_labels(logits_of(p, b), b["labels"]).mean()
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    params = model.params
    return step, (params, opt.init(params), data)


def build_train_state(name: str = "gpt2", batch: int = 8, seq: int = 16, optimizer: Any = None
                      ) -> tuple[Callable, tuple]:
    """(step, (state, batch)) as in transformers' `run_clm_flax.py`: a flax `TrainState` carrying the dropout
    key (a legacy uint32[2] `jax.random.PRNGKey`), dropout on, the key split afresh every step."""
    from flax.training import train_state

    class TrainState(train_state.TrainState):
        dropout_rng: Any

    if name == "t5":
        raise ValueError("models.hf.build_train_state: T5 needs decoder inputs; use a decoder-only or BERT model")
    model = _model(name, seq)
    rng = np.random.default_rng(1)
    data = {"input_ids": jnp.asarray(rng.integers(0, VOCAB, (batch, seq)), jnp.int32),
            "labels": jnp.asarray(rng.integers(0, VOCAB, (batch, seq)), jnp.int32)}
    opt = optimizer if optimizer is not None else optax.adamw(1e-3)
    state = TrainState.create(apply_fn=model.__call__, params=model.params, tx=opt,
                              dropout_rng=jax.random.PRNGKey(0))

    def step(state: Any, b: dict) -> tuple:
        dropout_rng, new_dropout_rng = jax.random.split(state.dropout_rng)

        def loss(params: Any) -> Any:
            logits = state.apply_fn(b["input_ids"], params=params, dropout_rng=dropout_rng, train=True)[0]
            return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()

        value, grads = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=grads, dropout_rng=new_dropout_rng), value

    return step, (state, data)
