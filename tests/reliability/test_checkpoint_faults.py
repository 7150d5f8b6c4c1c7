"""Checkpoints under faults and misuse (issue 29): a save killed at any step leaves the previous or the
new checkpoint restorable, any changed byte is detected, and every bad path or `like=` is a typed error
that names it, never a raw orbax error and never a lost checkpoint or array."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import autoshard
from autoshard import CheckpointError, ConfigError
from autoshard._src.bridge.checkpoint import disk

from ._ckpt_worker import state

WORKER = Path(__file__).with_name("_ckpt_worker.py")
ROOT = Path(__file__).resolve().parents[2]
OLD, NEW = 1, 2
# the save protocol's steps, and which state a kill right after each one leaves restorable
STEPS_LEAVE = {"tmp_created": OLD, "plan_written": OLD, "state_written": OLD, "manifest_written": OLD,
               "old_moved": NEW, "new_moved": NEW, "old_unmarked": NEW, "done": NEW}


def _assert_tree_equal(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.asarray(a).dtype == np.asarray(b).dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _restore_state(path, seed_like=OLD):
    return autoshard.restore(path, like=state(seed_like))


def _worker(*args, fault=None, stderr=subprocess.PIPE):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(disk.FAULT_ENV, None)
    if fault:
        env[disk.FAULT_ENV] = fault
    return subprocess.Popen([sys.executable, str(WORKER), *map(str, args)], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=stderr)


def test_the_fault_steps_are_the_save_protocols_steps():
    assert tuple(STEPS_LEAVE) == disk.SAVE_STEPS


@pytest.mark.slow
def test_a_save_killed_after_any_step_leaves_the_old_or_the_new_checkpoint(tmp_path):
    """SIGKILL right after each step of `save(overwrite=True)` (synchronous, and asynchronous for the
    steps its background thread runs): `restore` gives the old state before the new one is sealed and
    swapped, the new one after, exactly; the next save cleans up and is itself restorable."""
    runs = [(step, 1) for step in disk.SAVE_STEPS] + [(step, 0) for step in ("state_written", "old_moved", "done")]
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(_tiny_plan().to_json())
    procs = []
    for step, wait in runs:
        path = tmp_path / f"{step}-{wait}" / "ckpt"
        autoshard.save(path, state(OLD))
        procs.append((step, path, _worker("once", path, NEW, wait, plan_file, fault=step)))
    for step, _, proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == -signal.SIGKILL, (step, proc.returncode, err[-2000:])
        assert "saved" not in out
    for step, path, _ in procs:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = _restore_state(path)
        _assert_tree_equal(got, state(STEPS_LEAVE[step]))
        recovered = [w for w in caught if "was interrupted" in str(w.message)]
        assert bool(recovered) == (step == "old_moved"), step     # only then is `path` itself missing
        autoshard.save(path, state(3), overwrite=True)
        _assert_tree_equal(_restore_state(path), state(3))
        assert disk.leftovers(path) == [], step


def test_a_save_loop_killed_at_random_moments_always_restores(tmp_path):
    """Kills inside orbax's own writing too: a process saving states 1, 2, 3, ... over one path, killed
    at seeded moments; the path then restores state k or k + 1 (k the last save reported), exactly."""
    rng = np.random.default_rng(29)
    procs = [(tmp_path / f"run{i}" / "ckpt", _worker("loop", tmp_path / f"run{i}" / "ckpt", stderr=subprocess.DEVNULL))
             for i in range(3)]
    for i, (_, proc) in enumerate(procs):
        for line in proc.stdout:             # kill after the 1st, 2nd, 3rd reported save, a random time later
            if line == f"saved {i + 1}\n":
                break
        time.sleep(float(rng.uniform(0.0, 0.3)))
        proc.send_signal(signal.SIGKILL)
    for i, (path, proc) in enumerate(procs):
        out = proc.stdout.read()          # what the loop above read ahead too (communicate() would miss it)
        proc.wait(timeout=60)
        proc.stdout.close()
        last = max([i + 1] + [int(line.split()[1]) for line in out.splitlines()])
        got = _restore_state(path)
        k = int(np.asarray(got["count"]))
        assert k in (last, last + 1), (k, last)
        _assert_tree_equal(got, state(k))


def _tiny_plan():
    return autoshard.plan(lambda p, b: (p, jnp.sum(p["w"] * b)), {"w": jnp.ones((8, 4))}, jnp.ones((8, 4)),
                          mesh={"data": 8}, hardware="cpu-sim")


def _saved(tmp_path, name="ckpt", seed=OLD, **kw):
    path = tmp_path / name
    autoshard.save(path, state(seed), **kw)
    return path


def _files(path):
    return sorted(p for p in path.rglob("*") if p.is_file())


def test_any_flipped_byte_is_detected_and_names_the_file(tmp_path):
    """Seeded flips (one byte, or 64 in a row as in the issue) in every file of a checkpoint, the
    manifest included: restore always refuses with a CheckpointError, the original still restores."""
    good = _saved(tmp_path)
    rng = np.random.default_rng(0)
    for i, file in enumerate(_files(good)):
        for burst in (1, 64):
            bad = tmp_path / f"bad{i}-{burst}"
            shutil.copytree(good, bad)
            target = bad / file.relative_to(good)
            data = bytearray(target.read_bytes())
            at = int(rng.integers(0, max(1, len(data) - burst)))
            for j in range(at, min(len(data), at + burst)):
                data[j] ^= int(rng.integers(1, 256))
            target.write_bytes(bytes(data))
            with pytest.raises(CheckpointError, match="corrupt|truncated|incomplete") as err:
                _restore_state(bad)
            named = file.relative_to(good).as_posix()
            assert named in str(err.value) or disk.MANIFEST in str(err.value), (named, str(err.value))
            assert "like=" not in str(err.value)
    _assert_tree_equal(_restore_state(good), state(OLD))


def test_an_array_changed_behind_a_consistent_manifest_is_caught_by_its_checksum(tmp_path):
    """The per-array sha256 checks the values themselves: a data file replaced by another save's (with
    the manifest's file entries updated to match) still fails, naming the array."""
    good, other = _saved(tmp_path), _saved(tmp_path, "other", seed=NEW)
    manifest = json.loads((good / disk.MANIFEST).read_text())
    body, other_body = manifest["body"], json.loads((other / disk.MANIFEST).read_text())["body"]
    shutil.rmtree(good / disk.STATE)
    shutil.copytree(other / disk.STATE, good / disk.STATE)
    body["files"] = {k: v for k, v in {**body["files"], **other_body["files"]}.items()
                     if not k.startswith(disk.STATE) or k in other_body["files"]}
    manifest["sha256"] = disk._body_digest(body)
    (good / disk.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"the array \['\w+'\] read back differs"):
        _restore_state(good)


def test_damaged_checkpoints_are_typed_errors_that_do_not_blame_like(tmp_path):
    good = _saved(tmp_path)
    cases = {
        "truncated": (lambda p: _truncate(max(_files(p / disk.STATE), key=lambda f: f.stat().st_size)),
                      "truncated or damaged"),
        "no manifest": (lambda p: (p / disk.MANIFEST).unlink(), "has no manifest.json.*verify=False"),
        "no orbax metadata": (lambda p: (p / disk.STATE / "_METADATA").unlink(), r"incomplete: state/_METADATA"),
        "no data": (lambda p: shutil.rmtree(p / disk.STATE), "incomplete: state/.* is missing"),
    }
    for name, (damage, message) in cases.items():
        bad = tmp_path / name.replace(" ", "_")
        shutil.copytree(good, bad)
        damage(bad)
        with pytest.raises(CheckpointError, match=message) as err:
            _restore_state(bad)
        assert "like=" not in str(err.value), name
    # unverified reads: a checkpoint without a manifest (as older autoshard wrote) still restores ...
    legacy = tmp_path / "legacy"
    shutil.copytree(good, legacy)
    (legacy / disk.MANIFEST).unlink()
    _assert_tree_equal(autoshard.restore(legacy, like=state(OLD), verify=False), state(OLD))
    with pytest.raises(ConfigError, match=r"asks for \(shape, dtype\) \[\(\(256,\), 'int8'\)\].*convert after"):
        autoshard.restore(legacy, like={**state(OLD), "ids": np.zeros(256, np.int8)}, verify=False)
    # ... and one whose orbax metadata is gone is a CheckpointError, not a complaint about like=
    (legacy / disk.STATE / "_METADATA").unlink()
    with pytest.raises(CheckpointError, match="cannot be read") as err:
        autoshard.restore(legacy, like=state(OLD), verify=False)
    assert "like=" not in str(err.value)
    _assert_tree_equal(_restore_state(good), state(OLD))


def _truncate(file):
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def test_paths_that_cannot_hold_a_checkpoint_are_typed_errors(tmp_path, monkeypatch):
    tree = state(OLD)
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(ConfigError, match="is a file; a checkpoint is a directory"):
        autoshard.save(notes, tree)
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint directory"):
        autoshard.restore(notes, like=tree)
    assert notes.read_text() == "mine"
    with pytest.raises(CheckpointError, match="cannot write the checkpoint"):
        autoshard.save(notes / "ckpt", tree)          # a file where a parent directory should be
    with pytest.raises(ConfigError, match="no checkpoint at"):
        autoshard.restore(tmp_path / "missing", like=tree)

    locked = tmp_path / "locked"
    kept = _saved(locked, seed=OLD)
    locked.chmod(0o555)
    if os.geteuid() == 0:          # root writes anyway: fail the way the kernel does for other users
        def refuse(self, *a, **k):
            raise PermissionError(13, "Permission denied", str(self))
        monkeypatch.setattr(Path, "mkdir", refuse)
    try:
        with pytest.raises(CheckpointError, match=r"cannot write the checkpoint beside .*locked.*Permission denied"):
            autoshard.save(kept, state(NEW), overwrite=True)
    finally:
        locked.chmod(0o755)
        monkeypatch.undo()
    _assert_tree_equal(_restore_state(kept), state(OLD))
    assert sorted(p.name for p in locked.iterdir()) == ["ckpt"]
    _assert_tree_equal(tree, state(OLD))       # the caller's arrays


def test_overwrite_replaces_the_whole_checkpoint(tmp_path):
    """A stale plan.json does not survive an overwrite without a plan (the new directory replaces the
    old one whole), and overwriting a checkpoint with another tree restores the new one."""
    path = tmp_path / "ckpt"
    autoshard.save(path, state(OLD), plan=_tiny_plan())
    assert (path / disk.PLAN).is_file()
    autoshard.save(path, {"x": np.arange(3)}, overwrite=True)
    assert not (path / disk.PLAN).exists()
    _assert_tree_equal(autoshard.restore(path, like={"x": np.arange(3, dtype=np.int32)}),
                       {"x": np.arange(3, dtype=np.int32)})
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_dtypes_are_never_converted_silently(tmp_path):
    """float -> float casts with a warning naming the leaves; every other dtype change is refused naming
    the leaf and the fix."""
    path = _saved(tmp_path)
    tree = state(OLD)
    for leaf, dtype in (("w", jnp.int8), ("ids", jnp.int8), ("ids", jnp.float32), ("count", jnp.bool_)):
        like = {**tree, leaf: jax.ShapeDtypeStruct(np.shape(tree[leaf]), dtype)}
        with pytest.raises(ConfigError, match=rf"like\['{leaf}'\] asks for {np.dtype(dtype)}.*pass like= with dtype"):
            autoshard.restore(path, like=like)
    like = {**tree, "w": jax.ShapeDtypeStruct(tree["w"].shape, jnp.bfloat16)}
    with pytest.warns(UserWarning, match=r"casting 1 arrays: \['w'\] \(float32 -> bfloat16\)"):
        got = autoshard.restore(path, like=like)
    assert got["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got["w"]), tree["w"].astype(jnp.bfloat16))
    _assert_tree_equal(tree, state(OLD))


def test_interrupted_saves_are_found_or_explained(tmp_path):
    """With `path` gone mid-swap, restore reads the newest complete sibling (and save without overwrite
    refuses to replace it); a lone incomplete one is named as holding nothing to restore."""
    path = tmp_path / "ckpt"
    older, newer = _saved(tmp_path, "ckpt.old-1", seed=OLD), _saved(tmp_path, "ckpt.tmp-2", seed=NEW)
    assert disk.leftovers(path) == [older, newer]
    with pytest.warns(UserWarning, match=r"was interrupted.*ckpt\.tmp-2"):
        _assert_tree_equal(_restore_state(path), state(NEW))
    with pytest.raises(ConfigError, match=r"left a complete checkpoint at .*ckpt\.tmp-2.*overwrite=True"):
        autoshard.save(path, state(3))
    autoshard.save(path, state(3), overwrite=True)
    assert disk.leftovers(path) == []
    _assert_tree_equal(_restore_state(path), state(3))

    lone = tmp_path / "lone"
    (tmp_path / "lone.tmp-9" / disk.STATE).mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"no checkpoint at .*lone.tmp-9, which is incomplete"):
        _restore_state(lone)


def test_async_save_is_atomic_and_verified(tmp_path):
    path = _saved(tmp_path)
    saving = autoshard.save(path, state(NEW), overwrite=True, wait=False)
    assert saving.wait() == path
    _assert_tree_equal(_restore_state(path), state(NEW))
    assert disk.leftovers(path) == []


@pytest.mark.parametrize("wait", [True, False])
def test_a_save_that_fails_midway_replaces_nothing(tmp_path, monkeypatch, wait):
    """A disk that fills up while the new checkpoint is sealed: a CheckpointError (from `save`, or from
    `wait()` and as a warning when asynchronous), the previous checkpoint intact, no leftovers."""
    path = _saved(tmp_path)

    def full(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(disk, "write_manifest", full)
    with pytest.raises(CheckpointError, match="No space left on device.*nothing was replaced"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            autoshard.save(path, state(NEW), overwrite=True, wait=wait).wait()
    assert wait or any("No space left" in str(w.message) for w in caught)
    monkeypatch.undo()
    _assert_tree_equal(_restore_state(path), state(OLD))
    assert disk.leftovers(path) == []


def test_leaves_a_checkpoint_cannot_give_back_are_refused_at_save(tmp_path):
    for bad, message in (({"a": jax.ShapeDtypeStruct((3,), jnp.float32)}, r"tree\['a'\] is a jax.ShapeDtypeStruct"),
                         ({"a": np.array(["x"])}, r"tree\['a'\] is a ndarray of dtype <U1"),
                         ({"a": 2 ** 40}, r"tree\['a'\] holds integers that do not fit int32"),
                         ({"a": np.array([1, 2 ** 40])}, r"tree\['a'\] holds integers that do not fit int32")):
        with pytest.raises(ConfigError, match=message):
            autoshard.save(tmp_path / "c", bad)
        assert not (tmp_path / "c").exists() and disk.leftovers(tmp_path / "c") == []
    autoshard.save(tmp_path / "c", {"a": np.array([1, 2], dtype=np.int64), "b": 3})      # fits: int32 on restore
    got = autoshard.restore(tmp_path / "c", like={"a": np.zeros(2, np.int32), "b": 0})
    assert np.asarray(got["a"]).tolist() == [1, 2] and int(got["b"]) == 3


def test_trees_whose_leaves_share_a_stored_name_are_refused(tmp_path):
    """Orbax stores a leaf under its keys joined by '.': leaves that would share a name (one silently
    lost) are refused at save and in like=, naming both; '.' in keys that do not collide is fine."""
    path = _saved(tmp_path)
    colliding = ({"a.b": jnp.ones(2), "a": {"b": jnp.zeros(2)}},
                 {"a": [jnp.ones(2)], "a.0": jnp.zeros(2)},
                 {"a": {"b": {}}, "a.b": jnp.zeros(2)})          # an empty container has a name too
    for tree in colliding:
        kept = jax.tree.map(np.asarray, tree)
        with pytest.raises(ConfigError, match=r"tree\['a'\]\S* and tree\['a\.\w'\] would both be stored under"):
            autoshard.save(path, tree, overwrite=True)
        with pytest.raises(ConfigError, match=r"like\['a'\]\S* and like\['a\.\w'\] would both be stored under"):
            autoshard.restore(path, like=tree)
        _assert_tree_equal(tree, kept)
    with pytest.raises(ConfigError, match=r"tree is not a pytree jax can flatten.*keys of one type"):
        autoshard.save(tmp_path / "mixed", {1: jnp.ones(2), "a": jnp.zeros(2)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    _assert_tree_equal(_restore_state(path), state(OLD))
    dotted = {"a.b": np.ones(2, np.float32), "a": {"c": np.zeros(2, np.float32)}}
    autoshard.save(tmp_path / "dotted", dotted)
    _assert_tree_equal(autoshard.restore(tmp_path / "dotted", like=dotted), dotted)


def test_float64_values_float32_cannot_hold_are_refused_and_narrowing_warns(tmp_path):
    """Without jax_enable_x64 a float64 leaf comes back float32: values beyond its range (inf on
    restore) are refused at save like wrapped integers; in range, save and restore both warn."""
    path = _saved(tmp_path)
    huge = np.array([1e300, 1.0 + 1e-12, 1e-60])
    for tree in ({"a": huge}, {"a": -1e39}):
        with pytest.raises(ConfigError, match=r"tree\['a'\] holds float64 values up to 1e\+(300|39), beyond "
                                              r"float32's largest.*restoring would give inf.*jax_enable_x64"):
            autoshard.save(path, tree, overwrite=True)
    np.testing.assert_array_equal(huge, [1e300, 1.0 + 1e-12, 1e-60])
    _assert_tree_equal(_restore_state(path), state(OLD))
    fine = {"a": np.array([1.5, 1.0 + 1e-12, 1e-60]), "b": np.float32(2.0)}
    with pytest.warns(UserWarning, match=r"rounded to the narrower float dtype.*\['a'\] \(float64 -> float32\)"):
        autoshard.save(tmp_path / "f64", fine)
    with pytest.warns(UserWarning, match=r"1 arrays come back narrower: \['a'\] \(float64 -> float32\)"):
        got = autoshard.restore(tmp_path / "f64", like=fine)
    np.testing.assert_array_equal(np.asarray(got["a"]), fine["a"].astype(np.float32))
    assert got["a"].dtype == np.float32 and fine["a"].dtype == np.float64


@pytest.mark.parametrize("wait", [True, False])
def test_empty_trees_and_zero_size_arrays_round_trip(tmp_path, wait):
    """Orbax refuses both; the manifest holds them, so they restore exactly (shape, dtype, sharding),
    beside ordinary arrays too, and a like= of another shape is still refused."""
    mesh = jax.make_mesh((8,), ("data",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    mixed = {"a": jax.device_put(jnp.zeros((0, 4)), rows), "b": jnp.arange(3),
             "c": np.zeros((2, 0), np.int8), "d": [jnp.zeros((8, 0), jnp.bfloat16)]}
    for i, tree in enumerate(({}, (), {"a": jnp.zeros((0, 4))}, {"a": None}, mixed)):
        path = tmp_path / f"c{i}"
        autoshard.save(path, tree, wait=wait).wait()
        got = autoshard.restore(path, like=tree)
        _assert_tree_equal(got, tree)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(tree), strict=True):
            assert getattr(b, "sharding", None) is None or a.sharding == b.sharding
    assert autoshard.restore(tmp_path / "c4", like=mixed)["a"].sharding == rows
    with pytest.raises(ConfigError, match=r"like\['a'\] has shape \(1, 4\).*holds \(0, 4\) float32"):
        autoshard.restore(tmp_path / "c2", like={"a": jnp.zeros((1, 4))})
    with pytest.raises(ConfigError, match="has 0 arrays, like= has 1"):
        autoshard.restore(tmp_path / "c0", like={"a": jnp.zeros(2)})


def test_restoring_a_path_this_process_is_still_saving_says_so(tmp_path, monkeypatch):
    """Before `.wait()` of an asynchronous save the path holds the old checkpoint (or nothing): restore
    refuses, saying the save is in progress and to call `.wait()`; afterwards it gives the new state."""
    path = _saved(tmp_path)
    release, write_manifest = threading.Event(), disk.write_manifest

    def slow_manifest(*a, **k):
        release.wait(timeout=60)
        write_manifest(*a, **k)
    monkeypatch.setattr(disk, "write_manifest", slow_manifest)
    savings = [autoshard.save(path, state(NEW), overwrite=True, wait=False),
               autoshard.save(tmp_path / "new", state(NEW), wait=False)]
    try:
        for saving in savings:
            with pytest.raises(CheckpointError, match=r"a save to .* is still in progress in this process.*\.wait\(\)"):
                _restore_state(saving.path)
    finally:
        release.set()
    for saving in savings:
        saving.wait()
        _assert_tree_equal(_restore_state(saving.path), state(NEW))


def test_saves_to_one_path_are_swapped_in_the_order_they_were_called(tmp_path, monkeypatch):
    """Two asynchronous saves over one path whose first finishes writing last: the second (newest)
    state is the one kept, not whichever commit happened to finish last."""
    path = tmp_path / "ckpt"
    first_may_seal, sealed, write_manifest = threading.Event(), [], disk.write_manifest

    def manifest_first_slow(directory, *a, **k):
        if not sealed:
            sealed.append("first")
            first_may_seal.wait(timeout=60)
        write_manifest(directory, *a, **k)
        sealed.append(directory)
    monkeypatch.setattr(disk, "write_manifest", manifest_first_slow)
    first = autoshard.save(path, state(OLD), wait=False)
    while not sealed:
        time.sleep(0.01)
    second = autoshard.save(path, state(NEW), wait=False, overwrite=True)
    while len(sealed) < 2:               # the second is sealed while the first still waits
        time.sleep(0.01)
    first_may_seal.set()
    first.wait(), second.wait()
    _assert_tree_equal(_restore_state(path), state(NEW))
    assert disk.leftovers(path) == []
