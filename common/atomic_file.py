"""Replacing a file so that a reader, or a crash at any moment, sees the old or the new one.

The new content goes to a temporary file in the same directory (created by this process
alone, readable by its owner only), is fsynced, renamed over the old file, and the
directory is fsynced so that the rename itself survives a power cut.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Replace ``path`` with what ``write`` writes to the binary file it is given."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    atomic_write(path, lambda fh: fh.write(data))


def fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry is; Windows cannot open dirs.
    if os.name != "posix":
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def recycling_names(path: Path) -> tuple[Path, Path, Path]:
    """``write_recycling``'s files beside ``path``: the spare space, the write in
    progress, and the replaced file on its way to becoming the spare."""
    return (
        path.with_name(f".{path.name}.spare"),
        path.with_name(f".{path.name}.writing.tmp"),
        path.with_name(f".{path.name}.retired"),
    )


def write_recycling(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Replace ``path`` as ``atomic_write`` does, but write into the blocks of the file
    the last call replaced (kept as a spare) rather than into a new file.

    For large files written again and again (checkpoints) most of a new file's cost is
    the kernel's: allocating its blocks, and freeing the replaced file's (with discard,
    a trim of each), several times the CPU of copying the bytes. Overwriting blocks
    already allocated costs only the copy. The spare is never the file ``path`` names,
    so a crash mid-write still leaves the previous ``path`` whole; the price is a second
    file's worth of disk kept beside it."""
    spare, writing, retired = recycling_names(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if spare.exists():
        os.replace(spare, writing)
    try:
        with open(writing, "r+b" if writing.exists() else "wb") as fh:
            write(fh)
            fh.truncate()
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        writing.unlink(missing_ok=True)  # a failed write (a full disk) gives its space back
        raise
    kept = False
    if path.exists():
        retired.unlink(missing_ok=True)
        try:
            os.link(path, retired)  # the replaced file's blocks stay allocated
            kept = True
        except OSError:
            pass  # no hard links here: the replaced file is freed, as atomic_write does
    os.replace(writing, path)
    fsync_dir(path.parent)
    if kept:
        os.replace(retired, spare)


def recover_recycling(path: Path) -> list[Path]:
    """Tidy what a crash left of ``write_recycling`` (and of ``atomic_write``) beside
    ``path``; returns the writes it cut short. A cut write's file becomes the spare (its
    blocks are as good as any) unless there is one; other leftovers are deleted."""
    spare, writing, retired = recycling_names(path)
    cut = [writing] if writing.exists() else []
    for leftover in (writing, retired):
        if leftover.exists():
            if spare.exists():
                leftover.unlink()
            else:
                os.replace(leftover, spare)
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):  # atomic_write's, cut short
        tmp.unlink(missing_ok=True)
        cut.append(tmp)
    return cut
