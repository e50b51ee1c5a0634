import os
from pathlib import Path

import pytest

from geodiloco.coordinator.unbuffered import BLOCK, BUFFER_BYTES, UnbufferedFile, UnbufferedReader


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
