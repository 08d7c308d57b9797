"""Files replaced so that a crash leaves the old or the new one: ``write_recycling``
reuses the replaced file's blocks, and ``recover_recycling`` tidies after a kill."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import pytest

from common.atomic_file import recover_recycling, recycling_names, write_recycling


def _writes(data: bytes) -> Callable[[BinaryIO], None]:
    def write(fh: BinaryIO) -> None:
        fh.write(data)

    return write


def test_each_write_reuses_the_file_the_one_before_it_replaced(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    spare, _, _ = recycling_names(path)
    write_recycling(path, _writes(b"first" * 1000))
    first = path.stat().st_ino
    assert not spare.exists()
    write_recycling(path, _writes(b"second" * 1000))
    second = path.stat().st_ino
    assert second != first and spare.stat().st_ino == first  # the old one kept as space
    write_recycling(path, _writes(b"third"))
    assert path.stat().st_ino == first and spare.stat().st_ino == second
    assert path.read_bytes() == b"third"  # a shorter write leaves nothing of the longer
    assert sorted(p.name for p in tmp_path.iterdir()) == [".checkpoint.pt.spare", "checkpoint.pt"]


def test_a_failed_write_leaves_the_previous_file_and_no_partial_one(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    write_recycling(path, _writes(b"one"))
    write_recycling(path, _writes(b"two"))

    def full_disk(fh: BinaryIO) -> None:
        fh.write(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_recycling(path, full_disk)
    assert path.read_bytes() == b"two"
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # its space given back


@pytest.mark.parametrize("had_spare", [False, True])
def test_recovery_keeps_a_cut_write_as_the_spare_and_removes_the_rest(
    tmp_path: Path, had_spare: bool
) -> None:
    path = tmp_path / "checkpoint.pt"
    spare, writing, retired = recycling_names(path)
    path.write_bytes(b"whole")
    if had_spare:
        spare.write_bytes(b"old")
    writing.write_bytes(b"half a checkpoint")  # a kill during the write
    retired.write_bytes(b"whole")  # (a kill between the rename and keeping the old one)
    stale = tmp_path / ".checkpoint.pt.abc123.tmp"  # atomic_write's, cut short
    stale.write_bytes(b"half")
    cut = recover_recycling(path)
    assert sorted(cut) == sorted([writing, stale])
    assert sorted(p.name for p in tmp_path.iterdir()) == [".checkpoint.pt.spare", "checkpoint.pt"]
    assert path.read_bytes() == b"whole"
    write_recycling(path, _writes(b"next"))
    assert path.read_bytes() == b"next"
    assert recover_recycling(path) == []


def test_without_hard_links_the_replaced_file_is_freed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(src: object, dst: object) -> None:
        raise OSError("hard links not supported")

    monkeypatch.setattr(os, "link", no_links)
    path = tmp_path / "checkpoint.pt"
    for data in (b"a", b"b", b"c"):
        write_recycling(path, _writes(data))
        assert path.read_bytes() == data
        assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]
