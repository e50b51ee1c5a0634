import ctypes
import mmap
import os
from pathlib import Path

import pytest

from geodiloco.coordinator import unbuffered
from geodiloco.coordinator.unbuffered import (
    BLOCK,
    BUFFER_BYTES,
    UnbufferedFile,
    UnbufferedReader,
    page_aligned,
    read_ahead,
    read_whole,
    taken_ahead,
)


@pytest.mark.parametrize("sizes", [[], [1], [BLOCK - 1, 1], [BLOCK + 1], [7, BUFFER_BYTES, BLOCK * 3 + 5]])
def test_the_file_holds_exactly_what_was_written(tmp_path: Path, sizes: list[int]) -> None:
    """Whatever the pieces' sizes against the block and the buffer: no padding left, no byte lost."""
    pieces = [os.urandom(n) for n in sizes]
    path = tmp_path / "f"
    with UnbufferedFile(path) as f:
        for piece in pieces:
            f.write(memoryview(piece))
        assert f.close() == sum(sizes)
    assert path.read_bytes() == b"".join(pieces)


def test_a_shorter_file_replaces_a_longer_one_whole(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(os.urandom(3 * BLOCK))
    with UnbufferedFile(path) as f:
        f.write(b"short")
        f.close()
    assert path.read_bytes() == b"short"


@pytest.mark.parametrize("size", [0, 5, BLOCK, 2 * BUFFER_BYTES + 3 * BLOCK + 11])
def test_reads_give_back_every_byte_in_order(tmp_path: Path, size: int) -> None:
    """Reads of odd sizes at odd offsets, across blocks and read-ahead buffers, then the rest."""
    data = os.urandom(size)
    path = tmp_path / "f"
    path.write_bytes(data)
    with UnbufferedReader(path) as f:
        assert f.size == size
        head = f.read(7)
        middle = bytearray(BUFFER_BYTES + 5)
        got = f.readinto(middle)
        rest = f.read()
        assert f.read(3) == b""  # at the end: nothing more, no error
    assert head + middle[:got] + rest == data
    assert got == min(len(middle), max(0, size - 7))


def test_seek_back_rereads(tmp_path: Path) -> None:
    data = os.urandom(BUFFER_BYTES * 2 + 100)
    path = tmp_path / "f"
    path.write_bytes(data)
    with UnbufferedReader(path) as f:
        assert f.read(8) == data[:8]
        f.read(BUFFER_BYTES + 50)  # the read-ahead is in flight past the first buffer
        f.seek(0)
        assert f.read() == data


@pytest.mark.parametrize("size", [0, 1, BLOCK, BLOCK + 1, 3 * (1 << 20) + 7])
def test_a_whole_read_gives_every_byte_in_aligned_memory(
    tmp_path: Path, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In pieces read at once (small pieces here, so a 3 MB file takes several and ends inside
    one), into fresh page-aligned memory or into a buffer given, where it fits."""
    monkeypatch.setattr(unbuffered, "PIECE_BYTES", 4 * BLOCK)
    data = os.urandom(size)
    path = tmp_path / "f"
    path.write_bytes(data)
    got = read_whole(path)
    assert bytes(got) == data
    roomy, small = page_aligned(size + BLOCK), page_aligned(1)
    into = read_whole(path, roomy)
    assert bytes(into) == data
    if size:
        assert _address(got) % mmap.PAGESIZE == 0
        assert _address(into) == _address(memoryview(roomy))
    if size > BLOCK:
        assert _address(read_whole(path, small)) != _address(memoryview(small))  # no room: fresh


def test_a_read_ahead_is_taken_only_for_the_same_file(tmp_path: Path) -> None:
    """Files are replaced by rename: a read ahead of the file that was replaced since is not the
    file's bytes any more, and is not given for them."""
    path = tmp_path / "state"
    path.write_bytes(b"first" * 1000)
    read_ahead(path)
    assert bytes(read_whole(path)) == b"first" * 1000  # taken (and so forgotten)
    assert taken_ahead(path) is None
    read_ahead(path)
    replacement = tmp_path / "state.tmp"
    replacement.write_bytes(b"second" * 1000)
    os.replace(replacement, path)
    assert taken_ahead(path) is None  # the read ahead was of the old file
    assert bytes(read_whole(path)) == b"second" * 1000
    read_ahead(path)
    unbuffered.drop_read_ahead()
    assert taken_ahead(path) is None
    read_ahead(tmp_path / "missing")  # nothing to read: nothing happens
    assert taken_ahead(tmp_path / "missing") is None


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def test_a_read_ahead_that_failed_is_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever stopped the read ahead (here out of memory), the reader is not left waiting on it:
    it reads the file itself."""
    path = tmp_path / "state"
    path.write_bytes(b"bytes" * 1000)
    real = unbuffered._read_fd
    calls = []

    def failing_once(*args: object) -> memoryview:
        calls.append(args)
        if len(calls) == 1:
            raise MemoryError("no room for the read ahead")
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(unbuffered, "_read_fd", failing_once)
    read_ahead(path)
    assert bytes(read_whole(path)) == b"bytes" * 1000
    assert len(calls) == 2
