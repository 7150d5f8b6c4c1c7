"""Bad input to trace(): typed errors naming the argument and the cause."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import autoshard


def test_not_callable():
    with pytest.raises(autoshard.NotCallableError, match="must be callable, got a dict") as info:
        autoshard.trace({"not": "a function"}, jnp.ones(3))
    assert isinstance(info.value, autoshard.AutoshardError)
    assert isinstance(info.value, TypeError)


def test_untraceable_argument_is_named_by_keypath():
    params = {"w": jnp.ones((2, 2)), "name": "layer-1"}
    with pytest.raises(autoshard.UntraceableArgumentError) as info:
        autoshard.trace(lambda p, x: p["w"] @ x, params, jnp.ones(2))
    msg = str(info.value)
    assert "args[0]['name']" in msg and "str" in msg and "'layer-1'" in msg
    assert "ShapeDtypeStruct" in msg  # says what is accepted
    assert isinstance(info.value, autoshard.AutoshardError)


def test_user_exception_is_chained():
    class Boom(RuntimeError):
        pass

    def step(x):
        raise Boom("shape mismatch in my loss")

    with pytest.raises(autoshard.TraceFailedError) as info:
        autoshard.trace(step, jnp.ones(3))
    err = info.value
    assert isinstance(err.__cause__, Boom)
    assert "step" in str(err) and "Boom: shape mismatch in my loss" in str(err)


def test_jax_rejection_is_chained():
    """A function jax cannot trace (Python control flow on a traced value)."""

    def step(x):
        if x.sum() > 0:
            return x
        return -x

    with pytest.raises(autoshard.TraceFailedError) as info:
        autoshard.trace(step, jnp.ones(3))
    assert info.value.__cause__ is not None
    assert type(info.value.__cause__).__name__ in str(info.value)


def test_shape_error_from_jax_is_chained():
    with pytest.raises(autoshard.TraceFailedError, match="TypeError") as info:
        autoshard.trace(lambda a, b: a @ b, jnp.ones((2, 3)), jnp.ones((4, 5)))
    assert isinstance(info.value.__cause__, TypeError)
