"""Checkpoints that move between meshes and plans: `autoshard.save` / `autoshard.restore` (orbax).

    autoshard.save("/ckpt/step_100", (params, opt_state), plan=train_step.plan)
    like = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        (params, opt_state), new_step.shardings(params, opt_state, batch)[:2])
    params, opt_state = autoshard.restore("/ckpt/step_100", like=like)

A checkpoint is a directory: `state/` holds the arrays (orbax's standard format, written
asynchronously by every process for its own shards), `plan.json` the plan that produced them (for
inspection; restoring does not need it), `manifest.json` the size and sha256 of every file and the
path, shape, dtype and sha256 of every array. `restore` reads each array straight into the sharding
of the matching leaf of `like` (any mesh, any plan: orbax reads only the slices each device needs),
and rebuilds the pytree types of `like` (optax states come back as optax states, not dicts).

Nothing is lost or read back wrong:
- saves are atomic: the new checkpoint is written beside `path` and swapped in only once complete
  (disk.py); a process killed at any moment leaves the previous or the new checkpoint
  restorable, and `restore` finds it;
- `restore` checks every file against the manifest before reading it, and every array read against
  its checksum, so any changed, missing or truncated byte is a `CheckpointError`, never wrong values;
- dtypes are never converted silently: `like` asking for another float dtype than saved (float32
  saved, bfloat16 asked) casts with a warning; any other difference (int <-> float, int8 vs int32,
  bool) is refused, since the cast would change values. Without jax_enable_x64, float64 leaves are
  saved as float32 with a warning, and refused when their values overflow it (ints likewise);
- trees whose leaves orbax would store under one name ({"a.b": x, "a": {"b": y}}) are refused;
- zero-size arrays and empty trees round-trip (the manifest holds them; orbax cannot).
Saves to one path from one process are swapped in in the order they were called; concurrent saves
from several programs are not supported (the last swap wins).
"""

from __future__ import annotations

import math
import os
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from ...core.errors import CheckpointError, ConfigError, PlanError
from ...plan.plan import Plan
from . import disk
from .leaves import (
    abstract_leaf,
    check_leaves,
    check_structure,
    leaf_records,
    match_like,
    verify_leaves,
    warn_narrowed_likes,
)

STATE, PLAN, MANIFEST = disk.STATE, disk.PLAN, disk.MANIFEST
_IN_FLIGHT: set[Path] = set()     # this process's unfinished saves: their tmp dirs are not leftovers
_IN_FLIGHT_LOCK = threading.Lock()
_LAST_ASYNC: dict[Path, threading.Thread] = {}   # per path, the newest save still committing in the background


class Saving:
    """A checkpoint being written (`autoshard.save(..., wait=False)`): `wait()` blocks until it is
    complete on disk and swapped in at `path` (raising what went wrong, if anything); the arrays may be
    updated by the next step meanwhile (orbax copied them). The save completes even without `wait()`."""

    def __init__(self, path: Path, thread: threading.Thread | None = None):
        self.path, self._thread, self._error = path, thread, None

    def wait(self) -> Path:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.path


def save(path: str | os.PathLike, tree: Any, *, plan: Plan | None = None, wait: bool = True,
         overwrite: bool = False) -> Saving:
    """Write `tree` (a pytree of jax/numpy arrays and scalars, any shardings) to the directory `path`,
    and `plan`'s JSON beside it. Asynchronous underneath: with `wait=False` it returns once the arrays
    are copied off the devices; call `.wait()` on the result before reading the checkpoint."""
    path = Path(path).absolute()
    check_leaves(tree, "tree")
    if plan is not None and not isinstance(plan, Plan):
        raise PlanError(f"autoshard.save: plan must be an autoshard Plan (e.g. step.plan), got {type(plan).__name__}.")
    _check_target(path, overwrite)
    saved_ns, records = time.time_ns(), leaf_records(tree)
    token = _shared_token()
    tmp = disk.sibling(path, "tmp", token)
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT.add(tmp)
    try:
        checkpointer = _start_writing(tree, plan, tmp)
    except BaseException:
        _forget(tmp, discard=True)
        raise
    with _IN_FLIGHT_LOCK:
        earlier = _LAST_ASYNC.get(path)
    commit = (checkpointer, tmp, path, token, records, saved_ns, earlier)
    if wait:
        _commit(*commit)
        return Saving(path)
    saving = Saving(path)
    saving._thread = threading.Thread(target=_commit_in_background, args=(saving, *commit),
                                      name=f"autoshard-save-{path.name}")
    with _IN_FLIGHT_LOCK:
        _LAST_ASYNC[path] = saving._thread
    saving._thread.start()
    return saving


def restore(path: str | os.PathLike, like: Any, *, verify: bool = True) -> Any:
    """The checkpoint at `path` as a pytree shaped and typed like `like`, each leaf placed with the
    sharding of `like`'s leaf (an array, or a `jax.ShapeDtypeStruct` with `.sharding`; leaves without
    one are restored onto the first local device). Every file and array is checked against the
    checkpoint's manifest; `verify=False` skips the checksums (and reads checkpoints written before
    autoshard had manifests)."""
    path = Path(path).absolute()
    check_leaves(like, "like")
    _check_not_saving(path)
    warn_narrowed_likes(like)
    source, note = disk.find_source(path)
    if note:
        warnings.warn(note, stacklevel=2)
    manifest = _manifest(source, verify)
    abstract = [abstract_leaf(x) for x in jax.tree.leaves(like)]
    casts, records = {}, None
    if manifest is None:
        check_structure(_orbax_metadata(source), abstract, source)
    else:
        if verify:
            disk.verify_files(source, manifest)
        abstract, casts, records = match_like(like, abstract, manifest["leaves"], source)
    leaves = _read_leaves(source, like, abstract, legacy=manifest is None)
    if verify and records is not None:
        verify_leaves(leaves, records, source)
    leaves = [x.astype(casts[i]) if i in casts else x for i, x in enumerate(leaves)]
    # orbax rebuilds `like`'s structure from its leaves; keep `like`'s own pytree types exactly
    return jax.tree.unflatten(jax.tree.structure(like), leaves)


def _check_not_saving(path: Path) -> None:
    """Restoring while this process still writes `path` would read the old checkpoint or a half-swapped one."""
    with _IN_FLIGHT_LOCK:
        busy = any(t.parent == path.parent and t.name.startswith(f"{path.name}.tmp-") for t in _IN_FLIGHT)
    if busy:
        raise CheckpointError(f"autoshard.restore: a save to {path} is still in progress in this process "
                              "(autoshard.save(..., wait=False)). Fix: call .wait() on the result of that save "
                              "before restoring it.")


def _check_target(path: Path, overwrite: bool) -> None:
    """Refuse to save over anything that is not an autoshard checkpoint, or over one without `overwrite`."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"autoshard.save: {path} is a file; a checkpoint is a directory. Fix: pass the path of a "
                          "new directory (e.g. one per step), or of a checkpoint to replace with overwrite=True.")
    if path.is_dir() and any(path.iterdir()):
        if not overwrite:
            raise ConfigError(f"autoshard.save: {path} exists and is not empty; pass overwrite=True to replace it, "
                              "or save to a new directory (e.g. one per step).")
        if not ((path / STATE).exists() or (path / MANIFEST).exists()):
            raise ConfigError(f"autoshard.save: {path} holds files that are not an autoshard checkpoint; refusing to "
                              "overwrite them. Fix: choose another directory.")
    complete = disk.newest_first([p for p in disk.leftovers(path) if disk.is_complete(p)])
    if not path.exists() and complete and not overwrite:
        raise ConfigError(f"autoshard.save: an interrupted save to {path} left a complete checkpoint at {complete[0]} "
                          "(autoshard.restore reads it); pass overwrite=True to replace it, or save to a new "
                          "directory.")


def _start_writing(tree: Any, plan: Plan | None, tmp: Path) -> Any:
    """Create the new checkpoint's directory and start orbax writing into it (asynchronously)."""
    try:
        tmp.mkdir(parents=True, exist_ok=True)      # every process of a multi-process save makes it
        disk.crash_point("tmp_created")
        checkpointer = None
        if any(np.size(x) for x in jax.tree.leaves(tree)):      # orbax refuses trees without values
            checkpointer = ocp.StandardCheckpointer()
            checkpointer.save(tmp / STATE, jax.tree.map(lambda x: None if np.size(x) == 0 else x, tree))
        if plan is not None and jax.process_index() == 0:
            (tmp / PLAN).write_text(plan.to_json())
            disk.crash_point("plan_written")
    except OSError as e:
        raise CheckpointError(f"autoshard.save: cannot write the checkpoint beside {tmp.parent} "
                              f"({e.strerror or e}: {e.filename or tmp}). Fix: make that directory writable (and "
                              "not full), or save to another path; an existing checkpoint there is untouched.") from e
    return checkpointer


def _commit(checkpointer: Any, tmp: Path, path: Path, token: str, records: list, saved_ns: int,
            earlier: threading.Thread | None) -> None:
    """Finish the write, seal the new checkpoint with its manifest, swap it in after the `earlier` save
    to the same path (so the last save called is the one kept), drop the leftovers."""
    try:
        if checkpointer is not None:
            try:
                checkpointer.wait_until_finished()
            finally:
                checkpointer.close()
        disk.crash_point("state_written")
        if jax.process_index() == 0:
            disk.write_manifest(tmp, records, saved_ns)
            disk.crash_point("manifest_written")
    except Exception as e:
        _forget(tmp, discard=True)
        reason = f"{e.strerror or e}" if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
        raise CheckpointError(f"autoshard.save: writing the checkpoint {path} failed ({reason}); nothing was "
                              "replaced (a previous checkpoint there is intact). Fix: check the disk has room "
                              "and is writable, then save again.") from e
    if earlier is not None:
        earlier.join()            # its own error, if any, is raised by its `wait()`
    if jax.process_index() == 0:
        try:
            disk.swap_in(tmp, path, token)
        finally:
            _forget(tmp, discard=False)
        with _IN_FLIGHT_LOCK:
            stale = [p for p in disk.leftovers(path) if p not in _IN_FLIGHT]
        for leftover in stale:
            disk.discard(leftover)
        disk.crash_point("done")
    else:
        _forget(tmp, discard=False)
    if jax.process_count() > 1:         # no process returns before process 0 swapped the checkpoint in
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(f"autoshard-save-{token}")


def _commit_in_background(saving: Saving, *commit: Any) -> None:
    try:
        _commit(*commit)
    except Exception as e:          # raised again by `wait()`; said now too, in case nobody waits
        saving._error = e
        warnings.warn(str(e), RuntimeWarning, stacklevel=1)
    finally:
        with _IN_FLIGHT_LOCK:
            if _LAST_ASYNC.get(commit[2]) is threading.current_thread():
                del _LAST_ASYNC[commit[2]]


def _forget(tmp: Path, *, discard: bool) -> None:
    with _IN_FLIGHT_LOCK:
        _IN_FLIGHT.discard(tmp)
    if discard and tmp.exists():
        disk.discard(tmp)


def _manifest(source: Path, verify: bool) -> dict | None:
    if disk.is_complete(source):
        try:
            return disk.read_manifest(source)
        except CheckpointError:
            if verify:
                raise
            return None         # verify=False: the caller trusts the arrays; read them as orbax wrote them
    if verify:
        raise CheckpointError(f"autoshard.restore: the checkpoint at {source} has no {MANIFEST}, so its content "
                              "cannot be checked: it was written by an autoshard older than its manifests, or its "
                              "save never finished, or the file was deleted. Fix: if you trust it, "
                              "autoshard.restore(path, like, verify=False); otherwise restore an earlier checkpoint.")
    return None


def _orbax_metadata(source: Path) -> Any:
    checkpointer = ocp.StandardCheckpointer()
    try:
        metadata = checkpointer.metadata(source / STATE).item_metadata
        if not jax.tree.leaves(metadata):         # orbax reads a missing _METADATA as an empty tree
            raise FileNotFoundError(f"no arrays described in {source / STATE / '_METADATA'}")
        return metadata
    except Exception as e:
        raise CheckpointError(f"autoshard.restore: the checkpoint at {source} cannot be read: orbax's metadata in "
                              f"{source / STATE} is missing or damaged ({type(e).__name__}: {e}). Fix: restore "
                              "an earlier checkpoint.") from e
    finally:
        checkpointer.close()


def _read_leaves(source: Path, like: Any, abstract: list[jax.ShapeDtypeStruct], *, legacy: bool) -> list[Any]:
    """The arrays as `abstract` describes them: orbax reads those with values (zero-size ones were saved
    as empty nodes, since orbax refuses them), the zero-size ones are made here."""
    empty = [math.prod(x.shape) == 0 for x in abstract]
    held: list[Any] = []
    if not all(empty):
        wanted = [None if e else x for e, x in zip(empty, abstract, strict=True)]
        held = jax.tree.leaves(_read(source, jax.tree.unflatten(jax.tree.structure(like), wanted), legacy=legacy))
    held_iter = iter(held)
    return [jax.device_put(np.zeros(x.shape, x.dtype), x.sharding) if e else next(held_iter)
            for e, x in zip(empty, abstract, strict=True)]


def _read(source: Path, abstract: Any, *, legacy: bool) -> Any:
    checkpointer = ocp.StandardCheckpointer()
    try:
        return checkpointer.restore(source / STATE, abstract)
    except ValueError as e:
        if legacy:       # unchecked by a manifest: orbax's word on a tree that does not match what was saved
            raise ConfigError(f"autoshard.restore: the checkpoint at {source} does not match like=: {e}") from e
        raise CheckpointError(f"autoshard.restore: the checkpoint at {source} cannot be read ({e}).") from e
    except Exception as e:
        raise CheckpointError(f"autoshard.restore: the checkpoint at {source} cannot be read "
                              f"({type(e).__name__}: {e}). Fix: restore an earlier checkpoint.") from e
    finally:
        checkpointer.close()


def _shared_token() -> str:
    """A name for this save's scratch directory that every process agrees on."""
    token = uuid.uuid4().int & ((1 << 63) - 1)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        token = int(multihost_utils.broadcast_one_to_all(np.int64(token)))
    return f"{token:016x}"
