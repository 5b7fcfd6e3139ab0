"""Publishing a folder without losing the previous one: what a save may replace, the durable rename into place,
the recovery of an interrupted one, and the cleaning of what crashed saves left behind.

A save writes everything into a temporary sibling `NAME.tmp-ID`, fsyncs its files and the folder, and then
renames it into place. Replacing an existing `NAME` takes two renames (POSIX cannot rename a folder over a
non-empty one): `NAME` -> `NAME.old-ID`, then `NAME.tmp-ID` -> `NAME`. A process killed between the two leaves
no `NAME`, so every reader resolves the path first (`resolve`): `NAME` missing and a complete `NAME.old-*`
beside it means that one (the checkpoint the interrupted save was replacing). Leftover `NAME.tmp-*` and
`NAME.old-*` folders are removed by the next successful save of the same path (`clean_leftovers`), never by a
load.

A save replaces only what is its own: an empty folder, or a previous checkpoint (a `manifest.json` of hf_zero)
or export (a model folder in `save_pretrained`'s layout). A regular file or a folder of anything else is refused with the
path and the way out (`overwrite=True`), untouched (`check_target`).
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Callable, List, Optional

from .source import MANIFEST, CheckpointError, read_manifest

logger = logging.getLogger("hf_zero")

def _leftover(directory: Path, kind: str) -> re.Pattern:
    return re.compile(re.escape(directory.name) + rf"\.{kind}-[0-9a-f]+")


def _siblings(directory: Path, kind: str) -> List[Path]:
    """`NAME.<kind>-ID` folders beside `directory` (kind: "tmp" or "old")."""
    parent = directory.parent
    if not parent.is_dir():
        return []
    pattern = _leftover(directory, kind)
    return sorted(p for p in parent.iterdir() if pattern.fullmatch(p.name))


# ---------------------------------------------------------------------------------------------- durability
def fsync_path(path: Path) -> None:
    """Flush a file's (or a folder's entries') bytes to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on a folder: the rename is as durable as they allow
        pass
    finally:
        os.close(fd)


def fsync_tree(folder: Path) -> None:
    """fsync every file under `folder`, then the folders themselves (deepest first)."""
    for root, dirs, files in os.walk(folder, topdown=False):
        for name in files:
            fsync_path(Path(root, name))
        fsync_path(Path(root))


# ---------------------------------------------------------------------------------------------- what may be replaced
def is_checkpoint(path: Path) -> bool:
    """A folder whose manifest says it is an hf_zero sharded checkpoint."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == "hf_zero-sharded"


_MODEL_WEIGHTS = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")


def is_export(path: Path) -> bool:
    """A folder holding a model in the layout `save_pretrained` writes (model*.safetensors or an index): an earlier
    export. hf_zero's exports are byte for byte what `save_pretrained` writes, so the two cannot be told apart and
    need not be: replacing a model folder with an export of the model is what an export to it asks for."""
    return any(_MODEL_WEIGHTS.fullmatch(p.name) for p in path.iterdir())


def check_target(path: Path, ours: Callable[[Path], bool], what: str, overwrite: bool) -> None:
    """Raise CheckpointError, touching nothing, when writing `what` to `path` would replace something that is not
    ours: a regular file, or a non-empty folder for which `ours(folder)` is false. `overwrite=True` allows it."""
    if overwrite or not (path.exists() or path.is_symlink()):
        return
    if not path.is_dir():
        raise CheckpointError(f"{path} exists and is not a folder: writing the {what} there would replace that file. "
                              f"Choose another path, or pass overwrite=True (--overwrite) to replace it")
    if next(path.iterdir(), None) is None or ours(path):
        return
    raise CheckpointError(f"{path} is a folder that holds files of its own (not an hf_zero {what}): writing the "
                          f"{what} there would delete them. Choose another path (e.g. a new subfolder), or pass "
                          f"overwrite=True (--overwrite) to replace the folder")


# ---------------------------------------------------------------------------------------------- the renames
def swap(tmp: Path, directory: Path) -> Optional[Path]:
    """Rename `tmp` to `directory`; an existing `directory` is moved aside to `NAME.old-ID` first (and back if the
    second rename fails). Returns where the previous one now is, if there was one."""
    old = None
    if directory.exists() or directory.is_symlink():
        old = directory.parent / f"{directory.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(directory, old)
    try:
        os.replace(tmp, directory)
    except BaseException:
        if old is not None:
            os.replace(old, directory)
        raise
    fsync_path(directory.parent)
    return old


def unswap(tmp: Path, directory: Path, old: Optional[Path]) -> None:
    """Undo `swap`: the new folder goes back to `tmp` (and is removed), the previous one back into place."""
    os.replace(directory, tmp)
    if old is not None:
        os.replace(old, directory)
    remove(tmp)


def remove(path: Optional[Path]) -> None:
    """Remove a folder or file, whatever it is (best effort: a leftover is cleaned by the next save)."""
    if path is None:
        return
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except OSError:
            pass


def swap_into_place(tmp: Path, directory: Path) -> None:
    """Rename `tmp` to `directory`, replacing an existing `directory`, and remove the previous one."""
    remove(swap(tmp, directory))


def clean_leftovers(directory: Path, keep: Optional[Path] = None) -> None:
    """Remove the `NAME.tmp-*` / `NAME.old-*` folders that crashed saves of `directory` left (after a successful
    save of it, so nothing there is needed any more)."""
    for p in _siblings(directory, "tmp") + _siblings(directory, "old"):
        if keep is None or p != keep:
            remove(p)


# ---------------------------------------------------------------------------------------------- recovery on open
def _complete(folder: Path) -> bool:
    """A checkpoint folder whose manifest lists files that are all there, at their recorded sizes."""
    if not is_checkpoint(folder):
        return False
    try:
        manifest = read_manifest(folder)  # checks that every name in it is a plain file of the folder
    except CheckpointError:
        return False
    sizes = manifest.get("file_bytes") or {}
    for name in manifest.get("files") or {}:
        f = folder / str(name)
        if not f.is_file() or (name in sizes and f.stat().st_size != sizes[name]):
            return False
    return True


def resolve(directory: os.PathLike) -> Path:
    """The folder to read the checkpoint `directory` from: itself, unless a save was killed between its two
    renames (no `directory`, a complete `NAME.old-*` beside it), then that previous checkpoint. Changes nothing on
    disk."""
    directory = Path(directory)
    if directory.exists() or directory.is_symlink():
        return directory
    olds = [p for p in _siblings(directory, "old") if _complete(p)]
    if not olds:
        return directory
    newest = max(olds, key=lambda p: (p / MANIFEST).stat().st_mtime)
    logger.warning("hf_zero: %s is missing but %s holds the checkpoint that an interrupted save was replacing: "
                   "reading that one (the next save of %s removes it)", directory, newest.name, directory.name)
    return newest
