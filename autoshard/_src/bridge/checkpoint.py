"""Checkpoints that move between meshes and plans: `autoshard.save` / `autoshard.restore` (orbax).

    autoshard.save("/ckpt/step_100", (params, opt_state), plan=train_step.plan)
    like = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        (params, opt_state), new_step.shardings(params, opt_state, batch)[:2])
    params, opt_state = autoshard.restore("/ckpt/step_100", like=like)

A checkpoint is a directory: `state/` holds the arrays (orbax's standard format, written
asynchronously by every process for its own shards), `plan.json` the plan that produced them (for
inspection; restoring does not need it). `restore` reads each array straight into the sharding of
the matching leaf of `like` (any mesh, any plan: orbax reads only the slices each device needs), and
rebuilds the pytree types of `like` (optax states come back as optax states, not dicts).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from ..core.errors import ConfigError, PlanError
from ..plan.plan import Plan

STATE, PLAN = "state", "plan.json"


class Saving:
    """A checkpoint being written (`autoshard.save(..., wait=False)`): `wait()` blocks until it is
    complete on disk; the arrays may be updated by the next step meanwhile (orbax copied them)."""

    def __init__(self, path: Path, checkpointer: Any):
        self.path, self._checkpointer = path, checkpointer

    def wait(self) -> Path:
        if self._checkpointer is not None:
            self._checkpointer.wait_until_finished()
            self._checkpointer.close()
            self._checkpointer = None
        return self.path


def save(path: str | os.PathLike, tree: Any, *, plan: Plan | None = None, wait: bool = True,
         overwrite: bool = False) -> Saving:
    """Write `tree` (a pytree of jax/numpy arrays and scalars, any shardings) to the directory `path`,
    and `plan`'s JSON beside it. Asynchronous underneath: with `wait=False` it returns once the arrays
    are copied off the devices; call `.wait()` on the result before reading the checkpoint."""
    path = Path(path).absolute()
    _check_leaves(tree, "tree")
    if plan is not None and not isinstance(plan, Plan):
        raise PlanError(f"autoshard.save: plan must be an autoshard Plan (e.g. step.plan), got {type(plan).__name__}.")
    if path.exists() and any(path.iterdir()):
        if not overwrite:
            raise ConfigError(f"autoshard.save: {path} exists and is not empty; pass overwrite=True to replace it, "
                              "or save to a new directory (e.g. one per step).")
        if not (path / STATE).exists():
            raise ConfigError(f"autoshard.save: {path} holds files that are not an autoshard checkpoint; refusing to "
                              "overwrite them. Fix: choose another directory.")
    path.mkdir(parents=True, exist_ok=True)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(path / STATE, tree, force=overwrite)
    if plan is not None and jax.process_index() == 0:
        (path / PLAN).write_text(plan.to_json())
    saving = Saving(path, checkpointer)
    if wait:
        saving.wait()
    return saving


def restore(path: str | os.PathLike, like: Any) -> Any:
    """The checkpoint at `path` as a pytree shaped and typed like `like`, each leaf placed with the
    sharding of `like`'s leaf (an array, or a `jax.ShapeDtypeStruct` with `.sharding`; leaves without
    one are restored onto the first local device)."""
    path = Path(path).absolute()
    if not (path / STATE).is_dir():
        raise ConfigError(f"autoshard.restore: no checkpoint at {path} (expected the directory {path / STATE} "
                          "written by autoshard.save).")
    _check_leaves(like, "like")
    abstract = jax.tree.map(_abstract_leaf, like)
    checkpointer = ocp.StandardCheckpointer()
    try:
        _check_structure(checkpointer.metadata(path / STATE).item_metadata, abstract, path)
        restored = checkpointer.restore(path / STATE, abstract)
    except ConfigError:
        raise
    except ValueError as e:      # orbax's word on a tree that does not match what was saved
        raise ConfigError(f"autoshard.restore: the checkpoint at {path} does not match like=: {e}") from e
    finally:
        checkpointer.close()
    # orbax rebuilds `like`'s structure from its leaves; keep `like`'s own pytree types exactly
    return jax.tree.unflatten(jax.tree.structure(like), jax.tree.leaves(restored))


def _abstract_leaf(x: Any) -> jax.ShapeDtypeStruct:
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x), sharding=sharding)


def _check_leaves(tree: Any, what: str) -> None:
    for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        ok = isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, bool, jax.ShapeDtypeStruct))
        if not ok:
            raise ConfigError(f"autoshard checkpoint: {what}{jax.tree_util.keystr(kp)} is a {type(x).__name__}; "
                              "checkpoints hold arrays and numbers. Fix: keep other values out of the saved tree.")
        if isinstance(x, jax.Array) and x.is_deleted():
            raise ConfigError(f"autoshard checkpoint: {what}{jax.tree_util.keystr(kp)} was deleted (donated to a "
                              "step); save the arrays the step returned.")


def _check_structure(saved: Any, abstract: Any, path: Path) -> None:
    """`like` must hold as many leaves as were saved, with the saved shapes (on disk an optax state
    is plain containers, so paths differ in kind; shapes are compared as multisets)."""
    got = [tuple(getattr(m, "shape", ()) or ()) for m in jax.tree.leaves(saved)]
    want = [tuple(x.shape) for x in jax.tree.leaves(abstract)]
    if len(got) != len(want):
        raise ConfigError(f"autoshard.restore: the checkpoint at {path} has {len(got)} arrays, like= has {len(want)}; "
                          "pass a like= with the structure of the saved tree (e.g. (params, opt_state)).")
    if sorted(got) != sorted(want):
        diff = sorted(set(want) - set(got))[:3]
        raise ConfigError(f"autoshard.restore: like= has arrays of shapes {diff} that the checkpoint at {path} does "
                          "not hold; restore into a tree of the model that was saved.")
