"""A checkpoint directory's integrity on disk: the manifest, the atomic swap, crash recovery.

`autoshard.save` writes a new checkpoint into `<path>.tmp-<token>` beside `path`, then
`manifest.json` last (size and sha256 of every file, shape, dtype and sha256 of every array): a
directory with a readable manifest is complete. Only then is the old `path` renamed to
`<path>.old-<token>`, the new one renamed to `path`, and the old one deleted (its manifest first,
so a half-deleted directory never looks complete). A process killed in any window leaves `path`
or a complete sibling holding the previous or the new state; `find_source` picks the newest
complete one and the next save to `path` removes the leftovers.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import signal
import uuid
from pathlib import Path
from typing import Any

from ...core.errors import CheckpointError

STATE, PLAN, MANIFEST = "state", "plan.json", "manifest.json"
FORMAT = "autoshard-checkpoint-1"
FAULT_ENV = "AUTOSHARD_CHECKPOINT_FAULT"   # tests only: SIGKILL this process at the named save step
SAVE_STEPS = ("tmp_created", "plan_written", "state_written", "manifest_written", "old_moved", "new_moved",
              "old_unmarked", "done")
_CHUNK = 1 << 22


def crash_point(step: str) -> None:
    """Die here without cleanup when the fault-injection variable names `step` (the kill tests)."""
    if os.environ.get(FAULT_ENV) == step:
        os.kill(os.getpid(), signal.SIGKILL)


def sibling(path: Path, kind: str, token: str | None = None) -> Path:
    return path.with_name(f"{path.name}.{kind}-{token or uuid.uuid4().hex[:12]}")


def leftovers(path: Path) -> list[Path]:
    """The `<path>.tmp-*` / `<path>.old-*` directories interrupted saves to `path` left behind."""
    pattern = glob.escape(path.name)
    found = [*path.parent.glob(f"{pattern}.tmp-*"), *path.parent.glob(f"{pattern}.old-*")]
    return sorted(p for p in found if p.is_dir())


def is_complete(directory: Path) -> bool:
    return (directory / MANIFEST).is_file()


def file_digest(file: Path, *, sync: bool = False) -> tuple[int, str]:
    """(size, sha256) of a file; with `sync`, also flush it to the disk (the manifest vouches for it)."""
    h, size = hashlib.sha256(), 0
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        if sync:
            os.fsync(f.fileno())
    return size, h.hexdigest()


def write_manifest(directory: Path, leaves: list[dict[str, Any]], saved_ns: int) -> None:
    """Seal `directory`: hash (and fsync) every file in it, then write the manifest atomically."""
    files = {}
    for file in sorted(p for p in directory.rglob("*") if p.is_file()):
        size, digest = file_digest(file, sync=True)
        files[file.relative_to(directory).as_posix()] = {"size": size, "sha256": digest}
    body = {"format": FORMAT, "saved_ns": saved_ns, "leaves": leaves, "files": files}
    text = json.dumps({"sha256": _body_digest(body), "body": body}, indent=1)
    part = directory / (MANIFEST + ".part")
    with open(part, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, directory / MANIFEST)
    _fsync_dir(directory)


def read_manifest(directory: Path) -> dict[str, Any]:
    """The manifest's body, checked against its own digest (a flipped byte in it is corruption too)."""
    file = directory / MANIFEST
    try:
        outer = json.loads(file.read_bytes())
        body, digest = outer["body"], outer["sha256"]
        ok = body.get("format") == FORMAT and digest == _body_digest(body)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"autoshard.restore: the checkpoint at {directory} is corrupt: {file} cannot be read "
                              f"({type(e).__name__}: {e}).{_others_hint(directory)}") from e
    if not ok:
        raise CheckpointError(f"autoshard.restore: the checkpoint at {directory} is corrupt: {file} does not match "
                              f"its own checksum (or is not an autoshard manifest).{_others_hint(directory)}")
    return body


def verify_files(directory: Path, manifest: dict[str, Any]) -> None:
    """Every file the manifest lists is there, whole and unchanged, before orbax reads any of them."""
    for name, want in manifest["files"].items():
        file = directory / name
        if not file.is_file():
            raise CheckpointError(f"autoshard.restore: the checkpoint at {directory} is incomplete: {name} is "
                                  f"missing (deleted or never copied).{_others_hint(directory)}")
        size, digest = file_digest(file)
        if size != want["size"]:
            raise CheckpointError(f"autoshard.restore: the checkpoint at {directory} is truncated or damaged: {name} "
                                  f"has {size} bytes, {want['size']} were written.{_others_hint(directory)}")
        if digest != want["sha256"]:
            raise CheckpointError(f"autoshard.restore: the checkpoint at {directory} is corrupt: the content of "
                                  f"{name} changed since it was written (sha256 differs).{_others_hint(directory)}")


def find_source(path: Path) -> tuple[Path, str | None]:
    """The directory to restore `path` from and, when it is not `path` itself, a note saying why."""
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"autoshard.restore: {path} is a file, not a checkpoint directory; pass the directory "
                              "autoshard.save wrote.")
    if path.is_dir() and ((path / STATE).is_dir() or is_complete(path)):
        return path, None
    complete = newest_first([p for p in leftovers(path) if is_complete(p)])
    if complete and not path.exists():
        return complete[0], (f"autoshard.restore: the save to {path} was interrupted (the process died between "
                             f"its steps); restoring the newest complete checkpoint, {complete[0]}. The next "
                             f"autoshard.save to {path} removes the leftovers.")
    partial = [p for p in leftovers(path) if not is_complete(p)]
    note = (f" An interrupted save left {partial[0]}, which is incomplete (killed before it finished) and holds "
            "nothing to restore." if partial else "")
    raise CheckpointError(f"autoshard.restore: no checkpoint at {path} (expected the directory {path / STATE} "
                          f"written by autoshard.save).{note}")


def newest_first(directories: list[Path]) -> list[Path]:
    def saved_ns(d: Path) -> int:
        try:
            return int(json.loads((d / MANIFEST).read_bytes())["body"]["saved_ns"])
        except (OSError, ValueError, KeyError, TypeError):
            return -1
    return sorted(directories, key=saved_ns, reverse=True)


def swap_in(new: Path, path: Path, token: str) -> None:
    """Make the complete checkpoint `new` the one at `path`; the old one stays intact until then."""
    old = sibling(path, "old", token)
    try:
        if path.exists():
            os.rename(path, old)
            _fsync_dir(path.parent)
            crash_point("old_moved")
        os.rename(new, path)
        _fsync_dir(path.parent)
    except OSError as e:
        where = f"; the previous one is at {old}" if old.exists() else ""
        raise CheckpointError(f"autoshard.save: could not move the new checkpoint into {path} ({e.strerror or e}). "
                              f"It is complete at {new}{where}. Fix: save to a path whose parent you can rename "
                              "entries in (a mount point itself cannot be replaced; save into a subdirectory).") from e
    crash_point("new_moved")
    if old.exists():
        discard(old)


def discard(directory: Path) -> None:
    """Delete a checkpoint directory, unmarking it first so a half-deleted one never looks complete."""
    try:
        (directory / MANIFEST).unlink(missing_ok=True)
        _fsync_dir(directory)
        crash_point("old_unmarked")
        shutil.rmtree(directory)
    except OSError:
        pass          # a leftover that cannot be deleted now is tried again on the next save


def _body_digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _others_hint(directory: Path) -> str:
    """Where a previous complete checkpoint of the same path is, if an interrupted save left one."""
    base = directory
    for kind in (".tmp-", ".old-"):
        if kind in directory.name:
            base = directory.with_name(directory.name.split(kind)[0])
    others = [p for p in newest_first([base, *leftovers(base)]) if p != directory and is_complete(p)]
    if others:
        return f" Another complete checkpoint of {base} is at {others[0]} (check it before relying on it)."
    return " Restore an earlier checkpoint (e.g. the previous step's) instead."

