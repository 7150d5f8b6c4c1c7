"""A checkpoint's arrays against the caller's trees: which leaves may be saved, the per-array
records of the manifest (path, shape, dtype, sha256), and how `like=` must match them on restore.
Zero-size arrays have no values: the manifest alone holds them (orbax refuses them), and an empty
tree is a checkpoint with no arrays."""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from ...core.errors import CheckpointError, ConfigError


def check_leaves(tree: Any, what: str) -> None:
    try:
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    except (ValueError, TypeError) as e:        # e.g. dict keys jax cannot sort ({1: x, "a": y})
        raise ConfigError(f"autoshard checkpoint: {what} is not a pytree jax can flatten ({e}). Fix: use dict "
                          "keys of one type (e.g. all str) and jax pytree containers.") from e
    for kp, x in flat:
        ok = isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, bool, jax.ShapeDtypeStruct))
        if not ok or not _numeric(getattr(x, "dtype", np.float32)):
            kind = type(x).__name__ + (f" of dtype {x.dtype}" if hasattr(x, "dtype") else "")
            raise ConfigError(f"autoshard checkpoint: {what}{jax.tree_util.keystr(kp)} is a {kind}; "
                              "checkpoints hold arrays and numbers. Fix: keep other values out of the saved tree.")
        if isinstance(x, jax.ShapeDtypeStruct) and what == "tree":
            raise ConfigError(f"autoshard.save: tree{jax.tree_util.keystr(kp)} is a jax.ShapeDtypeStruct, which has "
                              "no values to save. Fix: save the arrays themselves (ShapeDtypeStructs go in like= "
                              "of autoshard.restore).")
        if isinstance(x, jax.Array) and x.is_deleted():
            raise ConfigError(f"autoshard checkpoint: {what}{jax.tree_util.keystr(kp)} was deleted (donated to a "
                              "step); save the arrays the step returned.")
    _check_unique_names(tree, what)


def _check_unique_names(tree: Any, what: str) -> None:
    """Orbax stores each leaf (and empty container) under its keys joined by '.', so two leaves such as
    {"a.b": x, "a": {"b": y}}, or {"a": [x], "a.0": y}, share one name and one overwrites the other."""
    try:
        names = jax.tree_util.tree_flatten_with_path(ocp.tree.get_param_names(tree))[0]
    except ValueError as e:            # a custom pytree node whose keys orbax cannot name
        raise ConfigError(f"autoshard checkpoint: {what} holds a pytree node orbax cannot name ({e}). Fix: save "
                          "its arrays in dicts, lists, tuples or dataclasses instead.") from e
    seen: dict[str, str] = {}
    for kp, name in names:
        where = f"{what}{jax.tree_util.keystr(kp)}"
        if name in seen:
            raise ConfigError(f"autoshard checkpoint: {seen[name]} and {where} would both be stored under the name "
                              f"{name!r} (orbax joins the keys of a path with '.'), so one would overwrite the other. "
                              "Fix: rename one of these keys (e.g. without '.').")
        seen[name] = where


def _numeric(dtype: Any) -> bool:
    """Numbers and booleans, jax's own dtypes (bfloat16, float8, int4) included; not str/bytes/objects."""
    return bool(jax.numpy.issubdtype(dtype, jax.numpy.number) or jax.numpy.issubdtype(dtype, jax.numpy.bool_))


def abstract_leaf(x: Any) -> jax.ShapeDtypeStruct:
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return jax.ShapeDtypeStruct(np.shape(x), jax.numpy.result_type(x), sharding=sharding)


def leaf_records(tree: Any) -> list[dict[str, Any]]:
    """Path, shape, dtype (as restore gives it back) and sha256 of each leaf's bytes, hashed on the host
    now, before the caller can change the arrays (None for arrays this process cannot see whole). Warns
    when float64 arrays will come back as float32 (jax_enable_x64 off)."""
    records, narrowed = [], []
    for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        path = jax.tree_util.keystr(kp)
        dtype = _restored_dtype(x, path)
        if _narrowed_float(x, dtype):
            narrowed.append(f"{path} ({np.dtype(x.dtype)} -> {dtype})")
        whole = getattr(x, "is_fully_addressable", True)
        records.append({"path": path, "shape": list(np.shape(x)), "dtype": str(dtype),
                        "sha256": array_digest(x, dtype) if whole else None})
    if narrowed:
        warnings.warn(f"autoshard.save: {len(narrowed)} arrays are rounded to the narrower float dtype jax reads "
                      f"them back as (jax_enable_x64 is off): {_some(narrowed)}. Fix: enable jax_enable_x64 to keep "
                      "them exact, or cast them yourself before saving.", stacklevel=3)
    return records


def warn_narrowed_likes(like: Any) -> None:
    """`like` leaves of dtypes jax cannot hold (float64 with jax_enable_x64 off) come back narrower."""
    narrowed = [f"{jax.tree_util.keystr(kp)} ({np.dtype(x.dtype)} -> {np.dtype(jax.numpy.result_type(x))})"
                for kp, x in jax.tree_util.tree_flatten_with_path(like)[0]
                if _narrowed_float(x, np.dtype(jax.numpy.result_type(x)))]
    if narrowed:
        warnings.warn(f"autoshard.restore: like= asks for float dtypes jax cannot hold with jax_enable_x64 off; "
                      f"{len(narrowed)} arrays come back narrower: {_some(narrowed)}. Fix: enable jax_enable_x64, "
                      "or pass like= in the narrower dtype.", stacklevel=3)


def _narrowed_float(x: Any, dtype: np.dtype) -> bool:
    """An array whose own float dtype is wider than the one jax gives it (float64 -> float32)."""
    own = np.dtype(getattr(x, "dtype", dtype))
    return own != dtype and bool(jax.numpy.issubdtype(own, jax.numpy.inexact))


def _some(items: list[str]) -> str:
    return ", ".join(items[:3]) + (" ..." if len(items) > 3 else "")


def _restored_dtype(x: Any, path: str) -> np.dtype:
    """The dtype `x` comes back in (jax's: int64 -> int32 without jax_enable_x64); refused where that
    would change integer values, which the caller would only notice as wrong numbers later."""
    try:
        dtype = np.dtype(jax.numpy.result_type(x))
        narrowed = isinstance(x, (int, float)) or (np.dtype(getattr(x, "dtype", dtype)) != dtype)
        if narrowed and jax.numpy.issubdtype(dtype, jax.numpy.integer):
            a = np.asarray(x)
            ok = a.size == 0 or (np.iinfo(dtype).min <= a.min() and a.max() <= np.iinfo(dtype).max)
        else:
            ok = True
    except (OverflowError, TypeError) as e:
        ok, dtype = False, str(e)
    if not ok:
        raise ConfigError(f"autoshard.save: tree{path} holds integers that do not fit {dtype}, the dtype jax reads it "
                          "back as (jax_enable_x64 is off); restoring would wrap them around. Fix: enable "
                          "jax_enable_x64, or keep such values out of the checkpoint (or split them).")
    if narrowed and jax.numpy.issubdtype(dtype, jax.numpy.inexact):
        _check_float_range(np.asarray(x), dtype, path)
    return dtype


def _check_float_range(a: np.ndarray, dtype: np.dtype, path: str) -> None:
    """Finite float64 values beyond float32's range would come back as inf: refused like wrapped integers."""
    with np.errstate(over="ignore", invalid="ignore"):
        lost = np.isfinite(a) & ~np.isfinite(a.astype(dtype))
    if lost.any():
        biggest = np.abs(a[lost]).max()
        raise ConfigError(f"autoshard.save: tree{path} holds {a.dtype} values up to {biggest:.3g}, beyond {dtype}'s "
                          f"largest ({np.finfo(dtype).max:.3g}), the dtype jax reads it back as (jax_enable_x64 is "
                          f"off); restoring would give inf. Fix: enable jax_enable_x64, or rescale or cast the values "
                          "yourself before saving.")


def array_digest(x: Any, dtype: np.dtype) -> str:
    a = np.asarray(x)
    if a.dtype != dtype:          # e.g. a float64 numpy leaf, read back as float32 without jax_enable_x64
        a = a.astype(dtype)
    return hashlib.sha256(np.ascontiguousarray(a).reshape(-1).view(np.uint8)).hexdigest()


def match_like(like: Any, abstract: list[jax.ShapeDtypeStruct], saved: list[dict[str, Any]],
               source: Path) -> tuple[list[jax.ShapeDtypeStruct], dict[int, np.dtype], list | None]:
    """What orbax should read (the saved dtypes, in `like`'s shardings), the float leaves to cast to
    `like`'s dtype afterwards, and the records to check the arrays against (None when `like`'s paths
    differ from the saved tree's, e.g. an optax state given as dicts: then shapes are compared as multisets)."""
    if len(saved) != len(abstract):
        raise ConfigError(f"autoshard.restore: the checkpoint at {source} has {len(saved)} arrays, like= has "
                          f"{len(abstract)}; pass a like= with the structure of the saved tree (e.g. (params, "
                          "opt_state)).")
    paths = [jax.tree_util.keystr(kp) for kp, _ in jax.tree_util.tree_flatten_with_path(like)[0]]
    if paths != [r["path"] for r in saved]:
        _match_as_multisets(abstract, saved, source)
        return abstract, {}, None
    read, casts = [], {}
    for i, (want, rec) in enumerate(zip(abstract, saved, strict=True)):
        have = np.dtype(rec["dtype"])
        if tuple(want.shape) != tuple(rec["shape"]):
            raise ConfigError(f"autoshard.restore: like{rec['path']} has shape {tuple(want.shape)}, but the checkpoint "
                              f"at {source} does not hold that shape there (it holds {tuple(rec['shape'])} "
                              f"{have}); restore into a tree of the model that was saved.")
        if want.dtype != have:
            _check_cast(rec["path"], have, np.dtype(want.dtype), source)
            casts[i] = want.dtype
        read.append(jax.ShapeDtypeStruct(want.shape, have, sharding=want.sharding))
    if casts:
        names = ", ".join(f"{saved[i]['path']} ({saved[i]['dtype']} -> {np.dtype(d)})" for i, d in
                          list(casts.items())[:3])
        warnings.warn(f"autoshard.restore: like= asks for other float dtypes than saved in {source}; casting "
                      f"{len(casts)} arrays: {names}{' ...' if len(casts) > 3 else ''}.", stacklevel=3)
    return read, casts, saved


def _check_cast(path: str, have: np.dtype, want: np.dtype, source: Path) -> None:
    """Only float -> float casts are done (with a warning); any other one would change values silently."""
    if jax.numpy.issubdtype(have, jax.numpy.floating) and jax.numpy.issubdtype(want, jax.numpy.floating):
        return
    raise ConfigError(f"autoshard.restore: like{path} asks for {want}, but the checkpoint at {source} holds {have} "
                      f"there; converting {have} to {want} would change the values, so autoshard does not. Fix: pass "
                      f"like= with dtype {have} for this leaf and convert the restored array yourself if you mean to.")


def _match_as_multisets(abstract: list[jax.ShapeDtypeStruct], saved: list[dict[str, Any]], source: Path) -> None:
    got = sorted((tuple(r["shape"]), r["dtype"]) for r in saved)
    want = sorted((tuple(x.shape), str(np.dtype(x.dtype))) for x in abstract)
    if [s for s, _ in got] != [s for s, _ in want]:
        diff = sorted({s for s, _ in want} - {s for s, _ in got})[:3]
        raise ConfigError(f"autoshard.restore: like= has arrays of shapes {diff} that the checkpoint at {source} does "
                          "not hold; restore into a tree of the model that was saved.")
    if got != want:
        diff, held = sorted(set(want) - set(got))[:3], sorted(set(got) - set(want))[:3]
        raise ConfigError(f"autoshard.restore: like= asks for (shape, dtype) {diff}, which the checkpoint at {source} "
                          f"holds in other dtypes ({held}); converting would change values, so autoshard does not. "
                          "Fix: pass like= with the saved dtypes, and convert after restoring.")


def verify_leaves(leaves: list[Any], saved: list[dict[str, Any]], source: Path) -> None:
    """Each array read back has the bytes that were saved (the end-to-end check behind the files' one)."""
    for x, rec in zip(leaves, saved, strict=True):
        if rec["sha256"] is None or not getattr(x, "is_fully_addressable", True):
            continue
        if array_digest(x, np.dtype(rec["dtype"])) != rec["sha256"]:
            raise CheckpointError(f"autoshard.restore: the checkpoint at {source} is corrupt: the array "
                                  f"{rec['path']} read back differs from the one saved (sha256 differs). Fix: restore "
                                  "an earlier checkpoint.")


def check_structure(saved: Any, abstract: list[jax.ShapeDtypeStruct], path: Path) -> None:
    """For checkpoints without a manifest: `like` must hold as many leaves as were saved, with the saved
    shapes and dtypes (on disk an optax state is plain containers, so paths differ in kind: compared as
    multisets)."""
    records = [{"shape": list(getattr(m, "shape", ()) or ()),
                "dtype": str(jax.dtypes.canonicalize_dtype(getattr(m, "dtype", np.float32)))}
               for m in jax.tree.leaves(saved)]
    if len(records) != len(abstract):
        raise ConfigError(f"autoshard.restore: the checkpoint at {path} has {len(records)} arrays, like= has "
                          f"{len(abstract)}; pass a like= with the structure of the saved tree (e.g. (params, "
                          "opt_state)).")
    _match_as_multisets(abstract, records, path)
