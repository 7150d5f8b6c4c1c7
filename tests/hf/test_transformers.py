"""Hugging Face transformers' Flax models, unmodified (issue 34): tiny random configs of GPT-2 (fused
q/k/v), Llama, Mistral (GQA), Gemma (MQA, tied embeddings), BERT and T5 under an ordinary optax step on
data 2 x model 4. The automatic plan's compiled program matches its prediction, it is predicted no
slower than any expert, and it trains as on one device. Needs the `hf` extra (slow CI step)."""

from __future__ import annotations

import contextlib
import re

import jax
import numpy as np
import optax
import pytest

import autoshard

from .._reference import run_steps

pytest.importorskip("transformers")
import models.hf as hf  # noqa: E402

MESH = {"data": 2, "model": 4}
HW = {"mesh": MESH, "hardware": "cpu-sim"}
pytestmark = pytest.mark.slow


def _context(name: str):
    return hf.t5_compat() if name == "t5" else contextlib.nullcontext()


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "gemma", "bert", "t5"])
def test_the_auto_plan_compiles_as_predicted_and_beats_every_expert(name):
    step, args = hf.build(name)
    with _context(name):
        plan = autoshard.plan(step, *args, **HW)
        audit = autoshard.audit(plan, step, *args)
    assert audit.fidelity_ok, audit.report()
    # a minor gap is a small op the plan does not model (under 1 % of the step's bytes) or a collective priced
    # within 2x (BERT's all-reduce@data: 12 % over, 3.8 % of the step); one off by more is mis-modelled
    assert not [g.what for g in audit.minor_gaps if audit.share(g) >= 0.01
                and max(g.predicted, g.audited) > 2 * min(g.predicted, g.audited)], audit.report()
    assert not any("plan space cap" in w for w in plan.warnings), plan.warnings
    for expert, e in plan.predicted["experts"].items():
        if "step_time" in e and e.get("feasible", True):
            assert plan.predicted["step_time"] <= e["step_time"] * (1 + 1e-9), (expert, plan.explain())


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5"])
def test_the_data_megatron_expert_splits_heads_mlp_and_vocabulary_and_compiles_as_predicted(name):
    step, args = hf.build(name)
    with _context(name):
        plan = autoshard.expert_plan("data-megatron", step, *args, **HW)
        audit = autoshard.audit(plan, step, *args)
    assert audit.fidelity_ok, audit.report()
    # no activation reshuffles (GPT-2's fused c_attn is split by heads in compute: bridge/trace/fused.py)
    assert not {k.split("@")[0] for k in audit.audited_collectives} & {"all-to-all", "collective-permute"}
    split = {k for k, s in zip(plan._args.keypaths, plan.input_specs_flat, strict=True)
             if k.startswith("[0]") and any("model" in axes for axes in s)}
    assert len(split) >= 4 * hf.LAYERS, sorted(split)      # attention and MLP weights of every layer


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_the_auto_plan_trains_like_one_device(name):
    # SGD: Adam turns zero gradients (a key bias softmax ignores) into rounding noise at the learning rate
    step, (params, _, batch) = hf.build(name, optimizer=optax.sgd(0.1))[0], hf.build(name)[1]
    opt_state = optax.sgd(0.1).init(params)
    with _context(name):
        fast = autoshard.autoshard(step, **HW)
        slow = jax.jit(step)
        got, p1, _ = run_steps(fast, params, opt_state, batch, 2)
        want, p2, _ = run_steps(slow, params, opt_state, batch, 2)
        np.testing.assert_allclose(got, want, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


# (pattern over "a/b/c" parameter paths, the dim Megatron-LM splits) per model and part. GPT-2's fused c_attn
# is split by heads in compute only (its kernel is stored whole: no contiguous split lines up with q/k/v).
_ATTN = [(r"self_attn/(q|k|v)_proj/kernel$", 1)]
_LLAMA_MLP = [(r"mlp/(gate|up)_proj/kernel$", 1), (r"mlp/down_proj/kernel$", 0)]
_EMBED = [(r"^model/embed_tokens/embedding$", 0)]
MEGATRON_SPLITS = {
    "gpt2": {"mlp": [(r"mlp/c_fc/kernel$", 0), (r"mlp/c_proj/kernel$", 1)],
             "vocab": [(r"^transformer/wte/embedding$", 0)]},
    "llama": {"heads": _ATTN, "mlp": _LLAMA_MLP, "vocab": _EMBED},
    "mistral": {"heads": [(r"self_attn/q_proj/kernel$", 1)], "mlp": _LLAMA_MLP, "vocab": _EMBED},
    # multi-query attention: the one key/value head stays whole (as Megatron-LM keeps it); queries split
    "gemma": {"heads": [(r"self_attn/q_proj/kernel$", 1)], "mlp": _LLAMA_MLP, "vocab": _EMBED},
    "bert": {"heads": [(r"attention/self/(query|key|value)/kernel$", 1)],
             "mlp": [(r"intermediate/dense/kernel$", 1), (r"layer/\d+/output/dense/kernel$", 0)],
             "vocab": [(r"^bert/embeddings/word_embeddings/embedding$", 0)]},
    "t5": {"heads": [(r"(SelfAttention|EncDecAttention)/(q|k|v)/kernel$", 1)],
           "mlp": [(r"DenseReluDense/wi/kernel$", 1), (r"DenseReluDense/wo/kernel$", 0)],
           "vocab": [(r"^shared/embedding$", 0)]},
}


def _path(keypath: str) -> str:
    """"[0]['model']['layers']['0']['mlp']['up_proj']['kernel']" -> "model/layers/0/mlp/up_proj/kernel"."""
    return "/".join(re.findall(r"\['([^']*)'\]", keypath))


@pytest.mark.parametrize("name", hf.NAMES)
def test_the_megatron_expert_finds_heads_mlp_and_vocabulary_by_structure(name):
    step, args = hf.build(name)
    with _context(name):
        plan = autoshard.expert_plan("megatron", step, *args, **HW)
    specs = {kp: s for kp, s in plan.specs_by_keypath().items() if kp.startswith("[0]")}
    unsplit = []
    for part, rules in MEGATRON_SPLITS[name].items():
        for pattern, dim in rules:
            hits = {kp: s for kp, s in specs.items() if re.search(pattern, _path(kp))}
            assert hits, (part, pattern, sorted(specs))
            unsplit += [(part, kp, s) for kp, s in hits.items() if "model" not in (s[dim] or ())]
    assert not unsplit, unsplit
